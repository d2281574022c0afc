"""Where the agent's API client comes from: off, in-cluster, kubeconfig, or none (with one warning)."""

from __future__ import annotations

from pathlib import Path

import pytest
from kubernetes_asyncio.client import CoreV1Api
from structlog.testing import capture_logs

from alnair_agent.config import Settings
from alnair_agent.kube.client import KubeConfigError, api_client, read_json
from fakes.apiserver import FakeApiServer, make_pod

pytestmark = pytest.mark.timeout(20)


async def test_off_means_no_client(tmp_path: Path) -> None:
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBECONFIG": str(tmp_path / "config")}
    assert await api_client(Settings(node_name="n", kubernetes="off"), env) is None


async def test_auto_without_cluster_or_kubeconfig_runs_without_api_server(tmp_path: Path) -> None:
    with capture_logs() as logs:
        assert await api_client(Settings(node_name="n"), {"HOME": str(tmp_path)}) is None
    assert [(e["event"], e["log_level"], e["message"]) for e in logs] == [
        ("kubernetes_unavailable", "warning", "running without an API server")]


async def test_auto_uses_the_kubeconfig(tmp_path: Path) -> None:
    async with FakeApiServer() as api:
        api.add_pod(make_pod("p", node="n"))
        kubeconfig = tmp_path / "config"
        kubeconfig.write_text(f"""
apiVersion: v1
kind: Config
clusters: [{{name: stand-in, cluster: {{server: "{api.host}"}}}}]
users: [{{name: agent, user: {{token: secret}}}}]
contexts: [{{name: ctx, context: {{cluster: stand-in, user: agent}}}}]
current-context: ctx
""")
        for env in ({"KUBECONFIG": str(kubeconfig)}, {"HOME": str(tmp_path), "KUBECONFIG": ""}):
            if "HOME" in env:
                (tmp_path / ".kube").mkdir(exist_ok=True)
                kubeconfig.rename(tmp_path / ".kube" / "config")
            client = await api_client(Settings(node_name="n"), env)
            assert client is not None
            async with client:
                resp = await CoreV1Api(client).list_pod_for_all_namespaces(_preload_content=False)
                body = await read_json(resp)
            assert [p["metadata"]["name"] for p in body["items"]] == ["p"]


async def test_in_cluster_without_service_account_is_a_clear_error(tmp_path: Path) -> None:
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443", "HOME": str(tmp_path)}
    with pytest.raises(KubeConfigError, match="in-cluster.*token"):
        await api_client(Settings(node_name="n"), env)


async def test_bad_kubeconfig_is_a_clear_error(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\nclusters: []\ncontexts: []\n")
    with pytest.raises(KubeConfigError, match=str(kubeconfig)):
        await api_client(Settings(node_name="n"), {"KUBECONFIG": str(kubeconfig)})
