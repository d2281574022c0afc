"""A node: the real agent (in-process or as a subprocess) beside the kubelet emulator and, optionally, the API
server stand-in, for the tests and benchmarks. Sockets live under a short /tmp folder (unix socket paths are
limited). The pytest fixtures built on it (`root`, `api`) are in tests/conftest.py: this package does not need
pytest."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path

from kubernetes_asyncio.client import ApiClient

from alnair_agent.app import Agent, Kubernetes
from alnair_agent.config import Settings, parse_sim_gpus
from alnair_agent.constants import RESOURCE_COMPUTE, RESOURCE_MEMORY, RESOURCES
from alnair_agent.kube.annotations import AnnotationWriter, WriterTiming
from alnair_agent.kube.events import EventWriter
from alnair_agent.kube.podwatch import PodWatch
from alnair_agent.kube.resourceapi import ResourceApi
from alnair_agent.kube.wiring import pod_resources_client
from alnair_standins.gpu import SimulatedBackend
from alnair_standins.kubelet import KubeletEmulator

NODE = "node-1"


def short_tmp() -> Path:
    return Path(tempfile.mkdtemp(prefix="aln-", dir="/tmp"))


def remove_tree(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)


def node_settings(root: Path, **overrides: object) -> Settings:
    base = Settings(
        node_name=NODE,
        device_plugin_dir=root / "dp",
        pod_resources_socket=root / "pr" / "kubelet.sock",
        workspace=root / "ws",
        shim_dir=root / "lib",
        gpu_backend="simulated",
        sim_gpus=parse_sim_gpus("2x16GiB"),
        kubernetes="off",
        metrics_port=0,
        resync_interval_s=0.1,
        health_interval_s=0.05,
        place_unscheduled=True,  # these node tests admit pods without the extender; the cluster tests do not
    )
    return replace(base, **overrides)  # type: ignore[arg-type]


def env_for(settings: Settings) -> dict[str, str]:
    """The same settings as ALNAIR_* variables, for an agent run as a process."""
    sims = ",".join(f"{g.memory_bytes >> 20}MiB" for g in settings.sim_gpus)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ALNAIR_")}
    env.update({
        "ALNAIR_NODE_NAME": settings.node_name,
        "ALNAIR_DEVICE_PLUGIN_DIR": str(settings.device_plugin_dir),
        "ALNAIR_POD_RESOURCES_SOCKET": str(settings.pod_resources_socket),
        "ALNAIR_WORKSPACE": str(settings.workspace),
        "ALNAIR_SHIM_DIR": str(settings.shim_dir),
        "ALNAIR_GPU_BACKEND": "simulated",
        "ALNAIR_SIM_GPUS": sims,
        "ALNAIR_GPU_POLICY": settings.gpu_policy,
        "ALNAIR_KUBERNETES": "off",
        "ALNAIR_METRICS_PORT": str(settings.metrics_port),
        "ALNAIR_RESYNC_INTERVAL_S": str(settings.resync_interval_s),
        "ALNAIR_PLACE_UNSCHEDULED": "true" if settings.place_unscheduled else "false",
        "ALNAIR_LOG_FORMAT": "json",
        "ALNAIR_HEALTH_INTERVAL_S": str(settings.health_interval_s),
        "ALNAIR_FRONTEND": settings.frontend,
        "ALNAIR_DRA_PLUGIN_DIR": str(settings.dra_plugin_dir),
        "ALNAIR_PLUGINS_REGISTRY_DIR": str(settings.plugins_registry_dir),
        "ALNAIR_CDI_DIR": str(settings.cdi_dir),
        "PYTHONUNBUFFERED": "1",  # the log file is read while the agent runs
    })
    if settings.sim_faults_file is not None:
        env["ALNAIR_SIM_FAULTS_FILE"] = str(settings.sim_faults_file)
    return env


def kubernetes_for(client: ApiClient, dra: bool = False, node: str = NODE,
                   events: EventWriter | None = None) -> Kubernetes:
    """The agent's Kubernetes side wired to an API client (the stand-in's), with short writer intervals; `dra`
    adds resource.k8s.io/v1 (as production wiring does), so the agent may choose the DRA front-end; `events`: its
    Event writer (none: the agent writes no Events; a test that passes one drains it)."""
    watch = PodWatch(client, node)
    writer = AnnotationWriter(client, node, WriterTiming(min_interval_s=0.05))
    return Kubernetes(pods=watch, annotations=writer,
                      services=[("pod-watch", watch.run), ("annotations", writer.run)],
                      resources=ResourceApi(client) if dra else None, events=events)


def gpu_of(device_id: str) -> str:
    return device_id.split("::")[0]


@dataclass
class RunningAgent:
    agent: Agent
    backend: SimulatedBackend
    stop: asyncio.Event
    task: asyncio.Task[None]

    async def shutdown(self) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, 5)


@contextlib.asynccontextmanager
async def running_agent(settings: Settings, kubernetes: Kubernetes | None = None,
                        unseen_grace_s: float | None = None) -> AsyncIterator[RunningAgent]:
    backend = SimulatedBackend.from_settings(settings)
    async with pod_resources_client(settings) as pod_resources:
        async with _agent(settings, backend, kubernetes, pod_resources.list, unseen_grace_s,
                          pod_resources.list_claims) as running:
            yield running


@contextlib.asynccontextmanager
async def _agent(settings: Settings, backend: SimulatedBackend, kubernetes: Kubernetes | None, list_held,  # type: ignore[no-untyped-def]
                 unseen_grace_s: float | None, list_claims=None) -> AsyncIterator[RunningAgent]:  # type: ignore[no-untyped-def]
    agent = Agent(settings, backend, kubernetes, list_held=list_held,
                  unseen_grace_s=unseen_grace_s, list_claims=list_claims)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop), name="agent-under-test")
    running = RunningAgent(agent, backend, stop, task)
    try:
        await asyncio.wait_for(agent.ready.wait(), 10)
        yield running
    finally:
        if not task.done():
            await running.shutdown()
        else:
            await task


async def registered(kubelet: KubeletEmulator, timeout: float = 5.0, since: int = 0) -> None:
    """Both resources registered (more than `since` registrations so far) and their device lists received."""
    await kubelet.wait_for(lambda k: len(k.registrations) >= since + len(RESOURCES)
                           and all(r in k.plugins and k.plugins[r].devices for r in RESOURCES), timeout)


@dataclass
class AgentProcess:
    """`python -m alnair_agent.main` with the settings as environment variables; output goes to a log file."""

    settings: Settings
    proc: subprocess.Popen[bytes] | None = None
    extra_env: dict[str, str] | None = None  # on top of the settings (e.g. KUBECONFIG, ALNAIR_KUBERNETES=auto)

    @property
    def log_path(self) -> Path:
        return self.settings.workspace.parent / "agent.log"

    def start(self) -> None:
        self.settings.workspace.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "alnair_agent.main"],
                                         env=env_for(self.settings) | (self.extra_env or {}),
                                         stdout=out, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log_path.read_text()


__all__ = ["RESOURCE_COMPUTE", "RESOURCE_MEMORY"]
