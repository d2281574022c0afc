"""Where the agent's API client comes from: off, in-cluster, kubeconfig, or none (with one warning)."""

from __future__ import annotations

from pathlib import Path

import pytest
from kubernetes_asyncio.client import CoreV1Api
from structlog.testing import capture_logs

from alnair_agent.config import Settings
from alnair_agent.kube.client import KubeConfigError, api_client, read_json
from alnair_standins.apiserver import FakeApiServer, make_pod

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


@pytest.mark.parametrize(("env", "proxy"), [
    ({}, None),
    ({"HTTP_PROXY": "http://proxy:3128"}, "http://proxy:3128"),
    ({"HTTP_PROXY": "http://upper:1", "http_proxy": "http://lower:2"}, "http://lower:2"),
    ({"HTTPS_PROXY": "http://proxy:3128"}, None),  # the stand-in is plain http: only an http proxy applies
    ({"http_proxy": "http://proxy:3128", "NO_PROXY": "127.0.0.1"}, None),
])
def test_the_environments_proxy_for_the_api_server(env: dict[str, str], proxy: str | None) -> None:
    from alnair_agent.kube.client import env_proxy

    assert env_proxy("http://127.0.0.1:6443", env) == proxy


async def test_the_client_reads_the_proxy_environment_once_not_per_request(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """kubernetes-asyncio's session would look up the proxy environment and ~/.netrc in a worker thread on every
    request (two thread round trips per API call)."""
    import asyncio

    async with FakeApiServer() as api:
        api.add_pod(make_pod("p", node="n"))
        client = await api_client(Settings(node_name="n"), {"KUBECONFIG": str(api.write_kubeconfig(tmp_path / "k")),
                                                            "https_proxy": "http://user:pw@proxy.invalid:3128"})
        assert client is not None
        assert client.configuration.proxy is None  # an http API server: the https proxy is not for it
        loop = asyncio.get_running_loop()
        jobs: list[object] = []
        real = loop.run_in_executor
        monkeypatch.setattr(loop, "run_in_executor", lambda *a: jobs.append(a) or real(*a))
        async with client:
            for _ in range(3):
                await read_json(await CoreV1Api(client).list_pod_for_all_namespaces(_preload_content=False))
        assert jobs == []


async def test_a_proxy_with_credentials_becomes_a_proxy_authorization_header(tmp_path: Path) -> None:
    async with FakeApiServer() as api:
        client = await api_client(Settings(node_name="n"), {"KUBECONFIG": str(api.write_kubeconfig(tmp_path / "k")),
                                                            "http_proxy": "http://us%40er:pw@proxy.invalid:3128"})
        assert client is not None
        async with client:
            assert client.configuration.proxy == "http://proxy.invalid:3128"
            assert client.configuration.proxy_headers == {"Proxy-Authorization": "Basic dXNAZXI6cHc="}
