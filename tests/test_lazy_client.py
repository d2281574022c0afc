"""kubernetes-asyncio's packages made lazy (alnair_agent/kube/lazy_client.py): the same classes and the same
deserialized objects as the library's eager import, a fraction of its modules loaded, and the eager import back
(with a warning) when a package's __init__.py is not what the hook expects."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import kubernetes_asyncio
import kubernetes_asyncio.client.models
import pytest
from kubernetes_asyncio import watch
from kubernetes_asyncio.client import CoreV1Api
from structlog.testing import capture_logs

from alnair_agent.kube import lazy_client
from alnair_standins.apiserver import FakeApiServer, make_node, make_pod

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]

# What the agent and the scheduler take from kubernetes_asyncio's lazy packages (grep kubernetes_asyncio
# alnair_agent), and a sample of what ApiClient deserializes for them.
USED = {
    "kubernetes_asyncio": ["client", "config", "watch"],
    "kubernetes_asyncio.client": ["ApiClient", "Configuration", "CoreV1Api", "AdmissionregistrationV1Api", "ResourceV1Api",
                                  "ApiException", "exceptions", "rest", "models", "api"],
    "kubernetes_asyncio.client.models": ["V1Pod", "V1PodList", "V1Node", "V1NodeList", "CoreV1Event",
                                         "V1ObjectMeta", "V1Binding", "V1MutatingWebhookConfiguration"],
}


def _python(code: str, *, lazy: bool) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter: with the lazy packages installed first (as the agent does), or the
    library's own eager import (nothing of alnair_agent imported)."""
    prelude = "import alnair_agent.kube\n" if lazy else ""
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=ROOT, capture_output=True,
                          text=True, timeout=50)


# Prints, for every name each lazy package binds in the eager import, what it is: "module:qualname" for classes and
# functions, the module name for modules, repr for constants; and which packages were made lazy.
DESCRIBE = f"LAZY = {list(lazy_client.LAZY)!r}\n" + """
import importlib, json, sys, types
def what(obj):
    if isinstance(obj, types.ModuleType):
        return "module " + obj.__name__
    if hasattr(obj, "__qualname__"):
        return obj.__module__ + ":" + obj.__qualname__
    return repr(obj)
names = json.loads(sys.argv[1]) if len(sys.argv) > 1 else None
out = {"lazy": [], "described": {}}
for package in LAZY:
    module = importlib.import_module(package)
    if "LazyLoader" in type(module.__spec__.loader).__name__:
        out["lazy"].append(package)
    wanted = names[package] if names else [n for n in vars(module) if not n.startswith("_")] + [
        n for n in ("__all__", "__version__") if hasattr(module, n)]
    out["described"][package] = {n: what(getattr(module, n)) for n in wanted}
print(json.dumps(out))
"""


def test_the_lazy_packages_resolve_every_name_to_the_eager_import_s_object() -> None:
    eager = _python(DESCRIBE, lazy=False)
    assert eager.returncode == 0, eager.stderr
    eager_out = json.loads(eager.stdout)
    assert eager_out["lazy"] == []
    names = {p: sorted(d) for p, d in eager_out["described"].items()}
    for package, used in USED.items():
        assert set(used) <= set(names[package]), package
    assert len(names["kubernetes_asyncio.client.models"]) > 500  # the whole table, not a sample
    lazy = subprocess.run([sys.executable, "-c", "import alnair_agent.kube\n" + DESCRIBE, json.dumps(names)],
                          cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert lazy.returncode == 0, lazy.stderr
    lazy_out = json.loads(lazy.stdout)
    assert lazy_out["lazy"] == list(lazy_client.LAZY)
    assert lazy_out["described"] == eager_out["described"]


def test_in_this_process_the_packages_are_lazy_and_names_are_one_object() -> None:
    # conftest imports alnair_agent.kube before anything imports kubernetes_asyncio, as the agent does
    models = kubernetes_asyncio.client.models
    for package in (kubernetes_asyncio, kubernetes_asyncio.client, models, kubernetes_asyncio.client.api):
        assert isinstance(package.__spec__.loader, lazy_client._LazyLoader), package.__name__
        assert package.__file__.endswith("__init__.py") and package.__path__
    from kubernetes_asyncio.client.models.v1_pod import V1Pod
    assert models.V1Pod is kubernetes_asyncio.client.V1Pod is V1Pod
    assert kubernetes_asyncio.watch is watch and kubernetes_asyncio.client.CoreV1Api is CoreV1Api
    assert "V1PodList" in dir(models) and "watch" in dir(kubernetes_asyncio)
    assert kubernetes_asyncio.__version__ == kubernetes_asyncio.client.__version__
    with pytest.raises(AttributeError, match="V1NoSuchThing"):
        _ = models.V1NoSuchThing
    assert not hasattr(kubernetes_asyncio.client, "no_such_module")


def test_importing_the_agent_or_the_scheduler_loads_few_kubernetes_asyncio_modules() -> None:
    count = """
    import sys
    print(sum(k.startswith("kubernetes_asyncio.client.models.") for k in sys.modules),
          sum(k.startswith("kubernetes_asyncio.client.api.") for k in sys.modules),
          sum(k.startswith("kubernetes_asyncio") for k in sys.modules))
    """
    for entry in ("alnair_agent.main", "alnair_agent.scheduler.main"):
        r = _python(f"import {entry}\n" + textwrap.dedent(count), lazy=False)
        assert r.returncode == 0, r.stderr
        models, apis, total = map(int, r.stdout.split())
        assert models < 100 and apis < 10 and total < 100, (entry, models, apis, total)
    r = _python("import kubernetes_asyncio.client\n" + textwrap.dedent(count), lazy=False)  # the library alone
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.split()[0]) > 500


# Deserializes pods, nodes, an event and watch events from fixed JSON through the real ApiClient and Watch, and
# prints what came out: the classes and the objects serialized back.
DESERIALIZE = """
import asyncio, json
from datetime import datetime, timezone
from types import SimpleNamespace
from kubernetes_asyncio import watch
from kubernetes_asyncio.client import ApiClient, CoreV1Api
from alnair_standins.apiserver import make_node, make_pod
async def main():  # ApiClient wants a running loop (its aiohttp session)
    api = ApiClient()
    at = datetime(2026, 12, 1, 7, 0, tzinfo=timezone.utc)
    pods = {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "7"},
            "items": [make_pod("a", node="n", containers=[{"name": "main", "memory": 2, "compute": 30}], uid="u1",
                               scheduled_at=at),
                      make_pod("b", containers=[{"name": "x", "memory": 1}, {"name": "y", "compute": 10}], uid="u2",
                               scheduled_at=at)]}
    node = make_node("n", {"k": "v"})
    node["metadata"].update(uid="u3", creationTimestamp="2026-12-01T07:00:00Z")
    nodes = {"kind": "NodeList", "apiVersion": "v1", "metadata": {}, "items": [node]}
    event = {"kind": "Event", "apiVersion": "v1", "metadata": {"name": "e", "namespace": "default"},
             "involvedObject": {"kind": "Pod", "name": "a"}, "reason": "R", "message": "m", "type": "Normal",
             "firstTimestamp": "2026-12-01T07:00:00Z", "count": 1}
    out = []
    for data, klass in ((pods, "V1PodList"), (nodes, "V1NodeList"), (event, "CoreV1Event")):
        obj = api.deserialize(SimpleNamespace(data=json.dumps(data)), klass)
        out.append([type(obj).__module__ + "." + type(obj).__qualname__, repr(obj.to_dict()),
                    api.sanitize_for_serialization(obj)])
    w = watch.Watch()
    rt = w.get_return_type(CoreV1Api(api).list_pod_for_all_namespaces)
    for kind in ("ADDED", "MODIFIED"):
        e = w.unmarshal_event(json.dumps({"type": kind, "object": pods["items"][0]}), rt)
        out.append([rt, e["type"], type(e["object"]).__qualname__, api.sanitize_for_serialization(e["object"])])
    print(json.dumps(out, sort_keys=True, default=str))
    await api.close()
    await w.close()
asyncio.run(main())
"""


def test_deserialized_pods_nodes_events_and_watch_events_are_the_eager_import_s() -> None:
    eager = _python(DESERIALIZE, lazy=False)
    lazy = _python(DESERIALIZE, lazy=True)
    assert eager.returncode == 0, eager.stderr
    assert lazy.returncode == 0, lazy.stderr
    assert lazy.stdout == eager.stdout
    out = json.loads(lazy.stdout)
    assert [o[0] for o in out[:3]] == ["kubernetes_asyncio.client.models.v1_pod_list.V1PodList",
                                       "kubernetes_asyncio.client.models.v1_node_list.V1NodeList",
                                       "kubernetes_asyncio.client.models.core_v1_event.CoreV1Event"]
    assert out[3][:3] == ["V1Pod", "ADDED", "V1Pod"]


async def test_the_real_client_deserializes_through_the_lazy_models_from_the_stand_in() -> None:
    async with FakeApiServer() as api:
        api.add_pod(make_pod("a", node="n", containers=[{"name": "main", "memory": 2}]))
        api.add_node("n", {"k": "v"})
        async with api.api_client() as client:
            core = CoreV1Api(client)
            pods = await core.list_pod_for_all_namespaces()
            nodes = await core.list_node()
            async with watch.Watch() as w:
                events = []
                async for e in w.stream(core.list_pod_for_all_namespaces, timeout_seconds=1):
                    events.append(e)
                    break
            node = client.deserialize(SimpleNamespace(data=json.dumps(make_node("m"))), "V1Node")
    models = kubernetes_asyncio.client.models
    assert type(pods) is models.V1PodList and type(pods.items[0]) is models.V1Pod
    assert pods.items[0].metadata.name == "a" and pods.items[0].spec.node_name == "n"
    assert pods.items[0].spec.containers[0].resources.limits == {"alnair/vgpu-memory": "2"}
    assert type(nodes.items[0]) is models.V1Node and nodes.items[0].metadata.annotations == {"k": "v"}
    assert [(e["type"], type(e["object"])) for e in events] == [("ADDED", models.V1Pod)]
    assert type(node) is models.V1Node and node.metadata.name == "m"


# -- the hook on a package of its own: what it makes lazy, and when it steps aside ---------------------------

def _package(root: Path, name: str, init: str, modules: dict[str, str]) -> None:
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text(textwrap.dedent(init))
    for module, text in modules.items():
        (root / name / f"{module}.py").write_text(textwrap.dedent(text))


def _run_with_finder(root: Path, package: str, code: str) -> subprocess.CompletedProcess[str]:
    script = f"""
    import sys
    from alnair_agent.kube.lazy_client import LazyPackageFinder
    finder = LazyPackageFinder([{package!r}])
    sys.meta_path.insert(0, finder)
    """
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script) + textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=50,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))})


MODULES = {"alpha": "print('alpha loaded')\nclass A: pass\n", "beta": "print('beta loaded')\nclass B: pass\n"}


def test_a_package_of_plain_imports_is_lazy(tmp_path: Path) -> None:
    _package(tmp_path, "fakekube", """
        '''doc'''
        from __future__ import absolute_import
        __version__ = "1.0"
        from fakekube.alpha import A
        from .beta import B as Beta
        import fakekube.alpha as alpha_module
        __all__ = ["A", "Beta"]
        """, MODULES)
    r = _run_with_finder(tmp_path, "fakekube", """
        import fakekube
        print("imported", fakekube.__version__, fakekube.__all__, finder.eager)
        from fakekube import Beta
        print(Beta.__module__, fakekube.alpha_module.A is fakekube.A)
        """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["imported 1.0 ['A', 'Beta'] {}", "beta loaded", "alpha loaded",
                                     "fakekube.beta True"]


@pytest.mark.parametrize("init", [
    "import logging\nfrom fakekube.alpha import A\n",  # an import that binds no alias
    "from fakekube.alpha import A\nfrom fakekube.gamma import G\n",  # a module that has no file
    "from fakekube.alpha import A\nA.x = 1\n",  # a statement with an effect
    "from fakekube.alpha import *\n",
    "from fakekube.alpha import A\n__all__ = ['A', 'Missing']\n",
    "from fakekube.alpha import A\nVERSION = '.'.join(['1', '0'])\n",
])
def test_an_unexpected_init_is_imported_eagerly_with_a_warning(tmp_path: Path, init: str) -> None:
    _package(tmp_path, "fakekube", init, MODULES)
    r = _run_with_finder(tmp_path, "fakekube", """
        try:
            import fakekube
            print("imported by", type(fakekube.__spec__.loader).__name__)
        except Exception as e:  # the eager import's own error (the missing module), not the hook's
            print("imported by SourceFileLoader: failed with", type(e).__name__)
        print(sorted(finder.eager))
        """)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "kube_client_eager" in lines[0] and "fakekube" in lines[0]  # the warning, before the import ran
    assert "alpha loaded" in lines  # the __init__ itself ran
    assert lines[-2].startswith("imported by SourceFileLoader") and lines[-1] == "['fakekube']"


def test_kubernetes_asyncio_falls_back_to_the_eager_import_and_the_agent_still_works() -> None:
    # the layout check refusing every package (as it would for a kubernetes-asyncio whose __init__ changed)
    r = _python("""
    import sys
    from alnair_agent.kube import lazy_client
    def refuse(package, *args):
        raise lazy_client.UnexpectedLayout(f"{package}: changed")
    lazy_client.parse_init = refuse
    import alnair_agent.main
    from alnair_agent.kube.client import ApiClient
    from kubernetes_asyncio.client import CoreV1Api
    finder = lazy_client.install()
    print(sorted(finder.eager), sum(k.startswith("kubernetes_asyncio.client.models.") for k in sys.modules))
    """, lazy=False)
    assert r.returncode == 0, r.stderr
    eager, models = r.stdout.strip().splitlines()[-1].rsplit(" ", 1)
    assert eager == str(sorted(lazy_client.LAZY)) and int(models) > 500
    assert r.stdout.count("kube_client_eager") == len(lazy_client.LAZY)


def test_a_package_imported_before_install_stays_as_it_was() -> None:
    r = _python("""
    import kubernetes_asyncio.client, sys
    import alnair_agent.kube
    from kubernetes_asyncio.client import CoreV1Api
    print(type(kubernetes_asyncio.client.__spec__.loader).__name__)
    """, lazy=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "SourceFileLoader"


def test_the_warning_names_the_package_and_the_reason() -> None:
    finder = lazy_client.LazyPackageFinder(["nothing"])
    with capture_logs() as logs:
        finder._step_aside("kubernetes_asyncio.client", "changed")
    assert logs == [{"event": "kube_client_eager", "log_level": "warning", "package": "kubernetes_asyncio.client",
                     "reason": "changed"}]
