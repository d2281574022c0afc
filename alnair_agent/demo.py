"""`alnair-agent --demo`: the agent on simulated GPUs against an in-process kubelet emulator, no GPU or cluster.

It starts the emulator, runs the real agent (real gRPC over unix sockets in a temporary folder), admits three
containers as kubelet would, prints what was registered and allocated, and shuts down.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import uvloop

from alnair_agent import logs
from alnair_agent.app import Agent
from alnair_agent.config import Settings, parse_sim_gpus
from alnair_agent.constants import ENV_COMPUTE_LIMIT, ENV_MEMORY_LIMIT, ENV_VISIBLE_DEVICES, RESOURCE_COMPUTE, RESOURCE_MEMORY
from alnair_agent.gpu.simulated import SimulatedBackend
from alnair_agent.kube.wiring import pod_resources_lister
from alnair_agent.kubelet.emulator import AdmissionError, KubeletEmulator

DEMO_CONTAINERS = (
    ("default", "train-a", "main", {RESOURCE_MEMORY: 8, RESOURCE_COMPUTE: 50}),
    ("default", "infer-b", "main", {RESOURCE_MEMORY: 4, RESOURCE_COMPUTE: 30}),
    ("default", "notebook-c", "main", {RESOURCE_MEMORY: 6, RESOURCE_COMPUTE: 20}),
    ("default", "too-big-d", "main", {RESOURCE_MEMORY: 12, RESOURCE_COMPUTE: 10}),
)


async def demo(root: Path) -> None:
    settings = Settings(
        node_name="demo-node",
        device_plugin_dir=root / "device-plugins",
        pod_resources_socket=root / "pod-resources" / "kubelet.sock",
        workspace=root / "workspace",
        shim_dir=root / "lib",
        gpu_backend="simulated",
        sim_gpus=parse_sim_gpus("2x16GiB"),
        kubernetes="off",
        metrics_port=0,
        log_format="console",
        log_level="warning",
    )
    stop = asyncio.Event()
    async with (KubeletEmulator(settings.device_plugin_dir, settings.pod_resources_socket) as kubelet,
                pod_resources_lister(settings) as list_held):
        agent = Agent(settings, SimulatedBackend.from_settings(settings), list_held=list_held)
        task = asyncio.create_task(agent.run(stop), name="agent")
        await kubelet.wait_for(lambda k: all(k.healthy_devices(r) for r in (RESOURCE_MEMORY, RESOURCE_COMPUTE)), 10)
        print("Registered with kubelet:")
        for resource, view in kubelet.plugins.items():
            print(f"  {resource:22} {len(view.devices):4} devices via {view.endpoint}")
        print(f"\nAdmitting containers (policy {settings.gpu_policy}, 1 memory unit = {settings.memory_unit_mib} MiB):")
        print(f"  {'pod/container':22} {'memory':>6} {'compute':>7}  result")
        for ns, pod, container, requests in DEMO_CONTAINERS:
            want = f"{requests[RESOURCE_MEMORY]:>4}Gi {requests[RESOURCE_COMPUTE]:>6}%"
            try:
                answers = await kubelet.admit(ns, pod, container, requests)
            except AdmissionError as e:
                print(f"  {pod + '/' + container:22} {want}  refused: {e.code.name if e.code else ''} {e.details}")
                continue
            env: dict[str, str] = {}
            for answer in answers.values():  # merged first-wins, as kubelet does
                env = {**answer.envs, **env}
            print(f"  {pod + '/' + container:22} {want}  GPU {env[ENV_VISIBLE_DEVICES]} "
                  f"{ENV_MEMORY_LIMIT}={env[ENV_MEMORY_LIMIT]} {ENV_COMPUTE_LIMIT}={env.get(ENV_COMPUTE_LIMIT)}")
        print("\nWorkspaces:", ", ".join(sorted(p.name for p in settings.workspace.iterdir())))
        stop.set()
        await task
    print("Agent stopped; sockets removed:", not any((root / "device-plugins").glob("alnair-*.sock")))


def run_demo() -> int:
    logs.configure("console", "warning")
    with tempfile.TemporaryDirectory(prefix="alnair-demo-") as tmp:
        uvloop.run(demo(Path(tmp)))
    return 0
