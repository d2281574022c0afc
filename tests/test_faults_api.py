"""Fault suite, part 3: the API server goes away (60 s in the slow run, 3 s otherwise) and comes back, under the
real agent process: no crash, bounded memory, retries jittered, and the latest figures written after."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from faults_util import count, events, free_port, http_get, stop, wait_until

from alnair_agent.constants import (
    NODE_GPU_DEVICES,
    RESOURCE_COMPUTE,
    RESOURCE_MEMORY,
    USAGE_ANNOTATION,
)
from alnair_agent.node.decision import ALLOCATED_ANNOTATION
from alnair_standins.apiserver import FakeApiServer, make_pod
from alnair_standins.kubelet import KubeletEmulator
from alnair_standins.node import NODE, AgentProcess, node_settings, registered

MEM, SM = RESOURCE_MEMORY, RESOURCE_COMPUTE


def kubeconfig(path: Path, host: str) -> Path:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": host}}],
        "users": [{"name": "fake", "user": {}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
    }))
    return path


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def heartbeat(api: FakeApiServer) -> str:
    raw = api.node_annotations(NODE).get(NODE_GPU_DEVICES)
    return json.loads(raw).get("heartbeat", "") if raw else ""


def usage(api: FakeApiServer, pod: str) -> dict[str, object]:
    """The pod's container "main" as its usage annotation has it ({} before the first figures)."""
    raw = api.pod_annotations("default", pod).get(USAGE_ANNOTATION)
    return json.loads(raw).get("main", {}) if raw else {}


async def outage_then_back(root: Path, outage_s: float) -> None:
    async with FakeApiServer() as api:
        api.add_node(NODE)
        settings = node_settings(root, metrics_port=free_port())
        agent = AgentProcess(settings, extra_env={
            "ALNAIR_KUBERNETES": "auto", "KUBECONFIG": str(kubeconfig(root / "kubeconfig", api.host)),
            "ALNAIR_ANNOTATE_INTERVAL_S": "0.5"})
        async with KubeletEmulator(settings.device_plugin_dir, settings.pod_resources_socket) as kubelet:
            agent.start()
            try:
                await registered(kubelet, timeout=20)
                for name in ("a", "b"):  # run once: "a"'s container ending below is for good
                    api.add_pod(make_pod(name, node=NODE, containers=[{"name": "main", "memory": 1, "compute": 10}],
                                         restart_policy="Never"))
                    await kubelet.admit("default", name, "main", {MEM: 1, SM: 10})
                    api.set_container_running("default", name, "main")
                await wait_until(lambda: all(ALLOCATED_ANNOTATION in api.pod_annotations("default", n)
                                             for n in ("a", "b")), 10)
                await asyncio.sleep(1.0)
                rss_before = rss_bytes(agent.proc.pid)
                await api.outage()
                down_at = time.monotonic()
                # While the server is away: container "a" ends (the API server's store changes without it).
                api.set_container_terminated("default", "a", "main")
                while time.monotonic() - down_at < outage_s:
                    assert agent.proc.poll() is None, agent.output()[-2000:]
                    status, _ = await http_get(settings.metrics_port, "/livez")
                    assert status == 200
                    await asyncio.sleep(0.5)
                beat_before = heartbeat(api)
                await api.recover()
                # The latest figures: a's final usage (written after the outage: it ended during it), b's running
                # usage, the node report's heartbeat.
                await wait_until(lambda: usage(api, "a").get("state") == "ended", 40)
                await wait_until(lambda: usage(api, "b").get("state") == "running", 40)
                await wait_until(lambda: heartbeat(api) != beat_before, 40)
                assert agent.proc.poll() is None
                grown = rss_bytes(agent.proc.pid) - rss_before
                assert grown < 40 << 20, f"RSS grew {grown >> 20} MiB over the outage"
                delays = [e["retry_in_s"] for e in events(agent) if e.get("event") == "pod_watch_failed"]
                assert delays and len(set(delays)) > len(delays) / 2, delays  # jittered: hardly two alike
                assert count(agent, "service_ended") == 0
                # And it still admits, once its pod watch is back (kubelet's own watch comes back the same way).
                await wait_until(lambda: api.open_watches >= 1, 20)
                api.add_pod(make_pod("c", node=NODE, containers=[{"name": "main", "memory": 1, "compute": 10}]))
                await kubelet.admit("default", "c", "main", {MEM: 1, SM: 10})
            finally:
                stop(agent)


async def test_api_server_away_then_back(root):
    await outage_then_back(root, 3.0)


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_api_server_away_60s_then_back(root):
    await outage_then_back(root, 60.0)
