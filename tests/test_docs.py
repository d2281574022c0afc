"""The docs match the project: the README's test command is what CI runs, the README and docs/ stand alone (no
path outside the repository, every repository path they name exists), and the files their commands apply exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REPO_DIRS = ("alnair_agent/", "alnair_standins/", "shim/", "manifests/", "examples/", "docs/", "tests/", "bench/", ".ci/")


def fenced_commands(text: str) -> list[str]:
    return [ln.strip() for block in re.findall(r"```sh\n(.*?)```", text, flags=re.S) for ln in block.splitlines()
            if ln.strip()]


def test_readme_test_command_is_what_ci_runs() -> None:
    readme = fenced_commands((ROOT / "README.md").read_text())
    ci = [ln for ln in (ROOT / ".ci/run").read_text().splitlines() if ln and not ln.startswith(("#", "set ", "cd "))]
    assert ci and ci[0] in readme
    assert "python3 -m venv .venv && .venv/bin/pip install -q . && .venv/bin/alnair-agent demo" in readme


def test_docs_stand_alone() -> None:
    for doc in DOCS:
        text = doc.read_text()
        assert "../" not in text, f"{doc.name} points outside the repository"
        for target in re.findall(r"\]\(([^)]+)\)", text):  # markdown links: repository files only
            assert not re.match(r"[a-z]+://", target), f"{doc.name} links outside the repository: {target}"
            assert (ROOT / target.split("#")[0]).exists(), f"{doc.name} links to missing {target}"
        for path in re.findall(r"`([A-Za-z0-9_./-]+)`", text):
            if path.startswith(REPO_DIRS) and "<" not in path and "*" not in path:
                assert (ROOT / path).exists(), f"{doc.name} names {path}, which does not exist"


def test_files_the_readme_applies_exist() -> None:
    for command in fenced_commands((ROOT / "README.md").read_text()):
        for path in re.findall(r"-f (\S+)", command):
            assert (ROOT / path).exists(), f"README applies {path}, which does not exist"
