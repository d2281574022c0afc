"""kubernetes-asyncio without the ~1000 modules the agent never uses: its packages become lazy.

Why: `kubernetes_asyncio/__init__.py` imports client, config, dynamic, stream, utils and watch, and
`kubernetes_asyncio.client` (like `.client.api` and `.client.models`) imports every API class and every model class
in its `__init__.py`: about 850 modules, where the agent and the scheduler use a handful of APIs and models.
Measured (2 vCPU dev box, Python 3.11.7, kubernetes-asyncio 36.1.0): `python -c "import alnair_agent.main"` ends at
VmRSS 78.6 MB with 859 kubernetes_asyncio modules loaded, 45.4 MB with 15 through this module.

What: `install()` puts a meta-path finder in front of `sys.meta_path` for the four package names in `LAZY`. For
each, the finder asks the finders behind it for the real spec (so `__file__`, `__path__` and `__spec__` stay the
real package's) and parses the package's own `__init__.py` once, exactly (`ast`): every `from M import N [as A]`
becomes "A is N from M", every `import M as A` becomes "A is module M" (and the older `import kubernetes_asyncio.M`
is understood too), literal assignments (`__all__`, `__version__`) are kept as they are. The module is then made
with that table instead of running the `__init__`: a PEP 562 `__getattr__` imports the one module a name needs on
first access (and caches it in the module), `__dir__` lists every name, `__all__` is the original. So `from
kubernetes_asyncio.client import ApiClient, CoreV1Api`, `from kubernetes_asyncio import watch, config` and
`getattr(kubernetes_asyncio.client.models, "V1Pod")` (how `ApiClient` deserializes) give the very same objects as
the eager import, loading only what they need. A name that is not in the table but is a submodule of the package
(e.g. `kubernetes_asyncio.client.rest`, which the eager `__init__` loads as a side effect) is imported on access
too.

Never break: when a package's `__init__.py` holds anything else (a statement the table cannot express, an import
whose module file is missing: a kubernetes-asyncio whose layout changed), or it cannot be read, the finder steps
aside for that package with one warning (`kube_client_eager`) and the normal eager import runs.
tests/test_lazy_client.py compares the lazy packages with the eager import of the installed kubernetes-asyncio
(36.1.0 in CI; passed by hand, 2026-12-01, with 30.1.0, 31.1.1, 32.3.2, 33.3.0, 34.3.3 and 35.0.1 too, the range
setup.cfg pins: `pip install --no-deps --target DIR kubernetes-asyncio==V`, then pytest with PYTHONPATH=DIR).

Install it before the first `kubernetes_asyncio` import: `alnair_agent.kube` and `alnair_agent.scheduler` do, on
import. Packages imported before `install()` stay as they were loaded (eagerly).
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.util
import os
import sys
import threading
from collections.abc import Iterable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

LAZY = (
    "kubernetes_asyncio",
    "kubernetes_asyncio.client",
    "kubernetes_asyncio.client.api",
    "kubernetes_asyncio.client.models",
)


class UnexpectedLayout(Exception):
    """A package's `__init__.py` is not one the lazy table can stand in for."""


class _Table:
    """What a package's `__init__.py` binds: name → (module, attribute or None for the module itself)."""

    def __init__(self, names: dict[str, tuple[str, str | None]], constants: dict[str, Any]) -> None:
        self.names = names
        self.constants = constants


def _module_exists(name: str, root_name: str, root_dir: str, listings: dict[str, frozenset[str]]) -> bool:
    """Whether module `name` (inside package `root_name`, found at `root_dir`) has a file: `x.py` or `x/__init__.py`.
    One listdir per folder (cached in `listings`), not a stat per name."""
    if name == root_name:
        return True
    if not name.startswith(root_name + "."):
        return False
    *folders, last = name[len(root_name) + 1:].split(".")
    folder = os.path.join(root_dir, *folders)
    if folder not in listings:
        try:
            listings[folder] = frozenset(os.listdir(folder))
        except OSError:
            listings[folder] = frozenset()
    entries = listings[folder]
    if last + ".py" in entries:
        return True
    return last in entries and os.path.isfile(os.path.join(folder, last, "__init__.py"))


def parse_init(package: str, path: str, root_name: str, root_dir: str) -> _Table:
    """The table of `package`'s `__init__.py` at `path`; UnexpectedLayout when it holds anything but imports of
    modules of `root_name` (whose files must exist under `root_dir`), `from __future__` and literal assignments."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError) as e:
        raise UnexpectedLayout(f"{path}: {e}") from None
    names: dict[str, tuple[str, str | None]] = {}
    constants: dict[str, Any] = {}
    listings: dict[str, frozenset[str]] = {}

    def target(module: str) -> str:
        if not _module_exists(module, root_name, root_dir, listings):
            raise UnexpectedLayout(f"{path}:{node.lineno}: imports {module}, which has no file under {root_dir}")
        return module

    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            continue  # the docstring
        if isinstance(node, ast.ImportFrom):
            if node.module == "__future__":  # binds its feature names too, like any from-import
                for alias in node.names:
                    names[alias.asname or alias.name] = ("__future__", alias.name)
                continue
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) if node.level \
                else node.module
            for alias in node.names:
                if alias.name == "*" or base is None:
                    raise UnexpectedLayout(f"{path}:{node.lineno}: star import")
                names[alias.asname or alias.name] = (target(base), alias.name)
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:  # `import M as A`: A is module M
                    names[alias.asname] = (target(alias.name), None)
                    continue
                # `import root.M` (kubernetes-asyncio < 36): binds the name `root` (the top package) and, by
                # loading root.M, makes M an attribute of its parent; __getattr__ imports such submodules anyway
                top = alias.name.split(".")[0]
                if top != root_name:
                    raise UnexpectedLayout(f"{path}:{node.lineno}: imports {alias.name}, outside {root_name}")
                target(alias.name)
                names[top] = (top, None)
            continue
        if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
            try:
                value = ast.literal_eval(node.value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                raise UnexpectedLayout(f"{path}:{node.lineno}: assignment of a non-literal") from None
            for t in node.targets:
                constants[t.id] = value  # type: ignore[attr-defined]
            continue
        raise UnexpectedLayout(f"{path}:{node.lineno}: {type(node).__name__} statement")
    if "__all__" in constants and not all(n in names or n in constants for n in constants["__all__"]):
        raise UnexpectedLayout(f"{path}: __all__ names something the file does not bind")
    return _Table(names, constants)


def _make_lazy(module: ModuleType, table: _Table) -> None:
    """Give `module` the names of `table`: constants now, the rest on first access (PEP 562)."""
    package = module.__name__
    namespace = module.__dict__
    submodules: dict[str, bool] = {}

    def is_submodule(name: str) -> bool:
        if name not in submodules:
            submodules[name] = not name.startswith("__") and any(
                os.path.isfile(os.path.join(d, name + ".py")) or os.path.isfile(os.path.join(d, name, "__init__.py"))
                for d in (namespace.get("__path__") or ()))
        return submodules[name]

    def __getattr__(name: str) -> Any:
        entry = table.names.get(name)
        if entry is None:
            if is_submodule(name):
                return importlib.import_module(f"{package}.{name}")  # the import system sets the attribute
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        # No lock of our own (the import system's per-module locks serialize the imports; a second lock around
        # them could deadlock against those): two threads resolving one name get the same object.
        source, attr = entry
        value: Any = importlib.import_module(source)
        if attr is not None:
            try:
                value = getattr(value, attr)
            except AttributeError:  # `from package import submodule`
                value = importlib.import_module(f"{source}.{attr}")
        namespace[name] = value  # later accesses find it without __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table.names))

    namespace.update(table.constants)
    namespace["__getattr__"] = __getattr__
    namespace["__dir__"] = __dir__


class _LazyLoader(importlib.abc.Loader):
    """Makes the package from its table instead of running its `__init__.py`; anything else goes to the real
    loader (e.g. `get_resource_reader`)."""

    def __init__(self, real: importlib.abc.Loader, table: _Table) -> None:
        self._real = real
        self._table = table

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return None  # the default module object; module_from_spec sets __file__, __path__, __spec__

    def exec_module(self, module: ModuleType) -> None:
        _make_lazy(module, self._table)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class LazyPackageFinder(importlib.abc.MetaPathFinder):
    """Finds `packages` with the finders behind it and hands them to a _LazyLoader when their `__init__.py` parses
    into a table (see the module doc); otherwise (with one warning) it returns the real spec as found, and the
    package's own `__init__.py` runs."""

    def __init__(self, packages: Iterable[str]) -> None:
        self.packages = frozenset(packages)
        self.eager: dict[str, str] = {}  # package → why it was imported eagerly

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> ModuleSpec | None:
        if fullname not in self.packages:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, LazyPackageFinder) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None:
            return None
        try:
            table = self._table(fullname, spec)
        except UnexpectedLayout as e:
            self._step_aside(fullname, str(e))
            return spec
        spec.loader = _LazyLoader(spec.loader, table)  # type: ignore[arg-type]
        return spec

    def _table(self, fullname: str, spec: ModuleSpec) -> _Table:
        origin = spec.origin
        if spec.loader is None or not spec.submodule_search_locations or not origin \
                or os.path.basename(origin) != "__init__.py":
            raise UnexpectedLayout(f"{fullname} is not a package with an __init__.py (origin {origin})")
        root_name = fullname.split(".")[0]
        # the folder of the top package: this package's folder, one level up per dot in its name
        root_dir = os.path.dirname(origin)
        for _ in range(fullname.count(".")):
            root_dir = os.path.dirname(root_dir)
        return parse_init(fullname, origin, root_name, root_dir)

    def _step_aside(self, fullname: str, reason: str) -> None:
        self.eager[fullname] = reason
        import structlog  # only here: this module stays cheap to import

        structlog.get_logger(__name__).warning("kube_client_eager", package=fullname, reason=reason)


_finder: LazyPackageFinder | None = None
_install_lock = threading.Lock()


def install() -> LazyPackageFinder:
    """Put the finder for `LAZY` first on sys.meta_path (once per process); returns it."""
    global _finder
    with _install_lock:
        if _finder is None:
            _finder = LazyPackageFinder(LAZY)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
        return _finder
