"""An agent that restarts (stopped, or killed with SIGKILL) loses no allocation and double-books nothing."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import time
from pathlib import Path

from alnair_agent.constants import (
    ENV_VISIBLE_DEVICES,
    RESOURCE_COMPUTE,
    RESOURCE_MEMORY,
)
from alnair_standins.apiserver import FakeApiServer, make_pod
from alnair_standins.gpu import sim_uuid
from alnair_standins.kubelet import KubeletEmulator
from alnair_standins.node import (
    NODE,
    AgentProcess,
    gpu_of,
    kubernetes_for,
    node_settings,
    registered,
    running_agent,
)

MEM, SM = RESOURCE_MEMORY, RESOURCE_COMPUTE


def records(workspace: Path) -> dict[str, tuple]:
    """Each allocation's GPU, device IDs and limits (who holds it may be learnt later from pod-resources)."""
    out = {}
    for path in workspace.glob("*/allocation.json"):
        r = json.loads(path.read_text())
        out[path.parent.name] = (r["gpu_uuid"], r["device_ids"], r["memory_limit"], r["compute_limit"])
    return out


async def admit(api: FakeApiServer, kubelet: KubeletEmulator, name: str, memory: int, compute: int) -> dict:
    api.add_pod(make_pod(name, node=NODE, containers=[{"name": "main", "memory": memory, "compute": compute}]))
    return await kubelet.admit("default", name, "main", {MEM: memory, SM: compute})


async def test_restart_keeps_allocations_and_never_double_books(root, api):
    settings = node_settings(root, gpu_policy="binpack")
    clients = [api.api_client(), api.api_client()]
    async with KubeletEmulator(settings.device_plugin_dir, settings.pod_resources_socket) as kubelet:
        async with running_agent(settings, kubernetes_for(clients[0])):
            await registered(kubelet)
            await admit(api, kubelet, "a", 2, 60)
            await admit(api, kubelet, "b", 2, 30)
            before = records(settings.workspace)
        assert len(before) == 2
        async with running_agent(settings, kubernetes_for(clients[1])) as running:
            await registered(kubelet, since=2)
            assert records(settings.workspace) == before
            assert set(running.agent.ledger.allocations) == set(before)
            # GPU 0 has 10 % compute left: a container asking 20 % must go to GPU 1 even though binpack prefers
            # the fuller GPU. Only a restored ledger knows that (kubelet only lists free IDs of one resource).
            answers = await admit(api, kubelet, "c", 2, 20)
            assert answers[MEM].envs[ENV_VISIBLE_DEVICES] == sim_uuid(1, NODE)
            held = [i for c in kubelet.assigned.values() for ids in c.values() for i in ids]
            assert len(held) == len(set(held))
    for client in clients:
        await client.close()


async def test_restart_with_lost_workspace_learns_held_devices_from_pod_resources(root, api):
    settings = node_settings(root)
    clients = [api.api_client(), api.api_client()]
    async with KubeletEmulator(settings.device_plugin_dir, settings.pod_resources_socket) as kubelet:
        async with running_agent(settings, kubernetes_for(clients[0])):
            await registered(kubelet)
            await admit(api, kubelet, "a", 2, 95)
        shutil.rmtree(settings.workspace)  # e.g. a node whose host folder was wiped
        async with running_agent(settings, kubernetes_for(clients[1])) as running:
            await registered(kubelet, since=2)
            assert len(running.agent.ledger.external_held) == 2 + 95
            answers = await admit(api, kubelet, "b", 1, 10)
            assert answers[MEM].envs[ENV_VISIBLE_DEVICES] == sim_uuid(1, NODE)
    for client in clients:
        await client.close()


async def _wait(predicate, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_sigkilled_agent_process_comes_back_with_the_same_allocations(root):
    # Without an API server the agent places one resource at a time; spread keeps this about the restart.
    settings = node_settings(root, gpu_policy="spread")
    async with KubeletEmulator(settings.device_plugin_dir, settings.pod_resources_socket) as kubelet:
        agent = AgentProcess(settings)
        agent.start()
        try:
            await registered(kubelet, timeout=20)
            first = await kubelet.admit("default", "a", "main", {MEM: 4, SM: 50})
            before = records(settings.workspace)
            agent.proc.send_signal(signal.SIGKILL)
            agent.proc.wait(5)
            count = len(kubelet.registrations)
            agent.start()  # the DaemonSet restarts it; stale sockets are still in the folder
            await registered(kubelet, timeout=20, since=count)
            assert records(settings.workspace) == before
            second = await kubelet.admit("default", "b", "main", {MEM: 4, SM: 60})
            gpu_a = first[MEM].envs[ENV_VISIBLE_DEVICES]
            assert second[MEM].envs[ENV_VISIBLE_DEVICES] != gpu_a  # 50 + 60 > 100 on one GPU
            held = [i for c in kubelet.assigned.values() for ids in c.values() for i in ids]
            assert len(held) == len(set(held))
            assert {gpu_of(i) for i in kubelet.assigned[next(k for k in kubelet.assigned if k.pod == "b")][SM]} \
                == {second[SM].envs[ENV_VISIBLE_DEVICES]}
        finally:
            if agent.proc.poll() is None:
                agent.proc.send_signal(signal.SIGTERM)
                agent.proc.wait(10)
