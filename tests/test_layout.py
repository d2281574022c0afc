"""The package map holds: no import circles among the agent's modules, and the agent reaches into the stand-ins
(alnair_standins) only where it is told to simulate. Read from the source with ast, nothing imported."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Where the agent may import a stand-in: the simulated GPU backend (ALNAIR_GPU_BACKEND=simulated) and the demo.
MAY_IMPORT_STANDINS = ("alnair_agent.gpu", "alnair_agent.demo")


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Modules imported anywhere in the file, under `if TYPE_CHECKING:` too: a circle for the type checker is a
    circle in the design."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in (ROOT / "alnair_agent").rglob("*.py") if "proto" not in p.parts}
    return {m: {i for i in _imports(p) if i in files and i != m} for m, p in files.items()}


def test_the_agent_has_no_import_circles() -> None:
    graph = _graph()
    # Tarjan's strongly connected components: any of more than one module is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for n in graph[m]:
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while True:
                n = stack.pop()
                component.append(n)
                if n == m:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    assert circles == []


def test_only_the_simulated_backend_and_the_demo_import_the_stand_ins() -> None:
    offenders = sorted(
        _module(p) for p in (ROOT / "alnair_agent").rglob("*.py")
        if not _module(p).startswith(MAY_IMPORT_STANDINS)
        and any(i == "alnair_standins" or i.startswith("alnair_standins.") for i in _imports(p)))
    assert offenders == []


def test_nothing_edits_sys_path() -> None:
    """Tests and benchmarks import the installed packages; bench/ modules come through pytest's pythonpath. Left:
    setup.py (a PEP 517 build does not put the source tree on sys.path)."""
    allowed = {"setup.py"}
    edits = sorted(str(p.relative_to(ROOT)) for folder in ("alnair_agent", "alnair_standins", "tests", "bench")
                   for p in (ROOT / folder).rglob("*.py")
                   if str(p.relative_to(ROOT)) not in allowed and p != Path(__file__)
                   and ("sys.path.insert" in p.read_text() or "sys.path[:0]" in p.read_text()))
    assert edits == []
