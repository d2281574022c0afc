"""The dispatcher end to end, without a GPU: real processes under the real shim run kernels on the simulated
driver's shared GPU timeline; the real agent (simulated backend reading that timeline, profiler, dispatcher) admits
them through the kubelet emulator. What each container really got is read from the timeline itself (the truth),
not from the agent."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from agent_harness import NODE, kubernetes_for, node_settings, registered, running_agent
from fakes.apiserver import make_pod

from alnair_agent.constants import (COMPUTE_POLICY_ANNOTATION, ENV_COMPUTE_LIMIT, ENV_MEMORY_LIMIT,
                                    ENV_VISIBLE_DEVICES, RESOURCE_COMPUTE)
from alnair_agent.gpu import simtimeline as TL
from alnair_agent.kubelet.emulator import KubeletEmulator

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[1]
KERNEL_NS = 1_000_000  # the tenants' kernels: 1 ms, back to back
RECORDERS: dict[Path, "Recorder"] = {}


@pytest.fixture(autouse=True)
async def _recorders():
    yield
    for r in RECORDERS.values():
        if r.task is not None:
            r.task.cancel()
            await asyncio.gather(r.task, return_exceptions=True)
            r.poll()
    RECORDERS.clear()


@dataclass(frozen=True)
class Build:
    shim: Path
    sim: Path


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Build:
    out = tmp_path_factory.mktemp("dispbuild")
    for args in (["make", "-s", "-C", str(ROOT / "shim"), f"BUILD={out / 'shim'}"],
                 ["make", "-s", "-C", str(ROOT / "tests/shim/simcuda"), f"BUILD={out / 'sim'}",
                  f"SHIM={ROOT / 'shim'}"]):
        subprocess.run(args, check=True, capture_output=True, text=True)
    return Build(out / "shim" / "libalnair.so", out / "sim")


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


class Tenant:
    """One container (its Allocate answer) running simapp: `run:MS:1ms` kernels back to back."""

    def __init__(self, build: Build, answers: dict, timelines: Path) -> None:
        env = {k: v for answer in answers.values() for k, v in answer.envs.items()}
        run_dir = next(m.host_path for answer in answers.values() for m in answer.mounts
                       if m.container_path == "/run/alnair")
        base = {k: v for k, v in os.environ.items() if not k.startswith(("ALNAIR_", "SIMCUDA_", "LD_"))}
        self.gpu = env[ENV_VISIBLE_DEVICES]
        self.region = Path(run_dir) / "region"
        self.timeline = timelines / self.gpu
        self.env = {**base, "LD_LIBRARY_PATH": str(build.sim), "LD_PRELOAD": str(build.shim),
                    "ALNAIR_REGION": str(self.region), ENV_MEMORY_LIMIT: env.get(ENV_MEMORY_LIMIT, "0"),
                    ENV_COMPUTE_LIMIT: env.get(ENV_COMPUTE_LIMIT, "0"), ENV_VISIBLE_DEVICES: self.gpu,
                    "ALNAIR_CONTEXT_BYTES": "0", "SIMCUDA_TIMELINE_DIR": str(timelines)}
        self.app = build.sim / "simapp"
        self.procs: list[asyncio.subprocess.Process] = []
        self.recorder = RECORDERS.setdefault(self.timeline, Recorder(self.timeline))
        if self.recorder.task is None:
            self.recorder.task = asyncio.create_task(self.recorder.run())

    async def start(self, ms: int, *extra: str) -> asyncio.subprocess.Process:
        p = await asyncio.create_subprocess_exec(str(self.app), "init", "ctx", *extra, f"run:{ms}:{KERNEL_NS}",
                                                 env=self.env, stdout=asyncio.subprocess.PIPE,
                                                 stderr=asyncio.subprocess.PIPE)
        self.procs.append(p)
        return p

    async def wait(self) -> None:
        for p in self.procs:
            out, err = await p.communicate()
            assert p.returncode == 0, err.decode()

    def share(self, t0_ns: int, t1_ns: int) -> float:
        """Percent of the GPU this tenant's processes got over [t0, t1] (whole 10 ms buckets), from the timeline
        as the recorder saw it."""
        return self.recorder.share({p.pid for p in self.procs}, t0_ns, t1_ns)

    def series(self, t0_ns: int, t1_ns: int, step_ns: int) -> list[float]:
        return [self.share(t, t + step_ns) for t in range(t0_ns, t1_ns - step_ns + 1, step_ns)]


class Recorder:
    """Copies a GPU's timeline buckets as they complete (the file keeps only 5.12 s): the truth of who ran when."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.busy: dict[int, dict[int, int]] = {}  # bucket -> pid -> ns
        self.k = now_ns() // TL.BUCKET_NS
        self.task: asyncio.Task | None = None

    def poll(self) -> None:
        k1 = now_ns() // TL.BUCKET_NS
        for k in range(self.k, k1):
            w = TL.read_window(self.path, k, k + 1)
            if w is not None:
                self.busy[k] = {s.pid: s.busy_ns for s in w.slots if s.busy_ns}
        self.k = k1

    async def run(self) -> None:
        while True:
            await asyncio.to_thread(self.poll)
            await asyncio.sleep(0.5)

    def share(self, pids: set[int], t0_ns: int, t1_ns: int) -> float:
        k0, k1 = -(-t0_ns // TL.BUCKET_NS), t1_ns // TL.BUCKET_NS
        total = sum(ns for k in range(k0, k1) for pid, ns in self.busy.get(k, {}).items() if pid in pids)
        return 100.0 * total / max(1, (k1 - k0) * TL.BUCKET_NS)


@pytest.fixture
def timelines(root: Path) -> Path:
    path = root / "timelines"
    path.mkdir()
    return path


def settings_for(root: Path, timelines: Path, gpus: int = 1, **kw: object):  # type: ignore[no-untyped-def]
    from alnair_agent.config import parse_sim_gpus
    return node_settings(root, sim_timeline_dir=timelines, sim_gpus=parse_sim_gpus(f"{gpus}x16GiB"),
                         gpu_policy="spread", profile_interval_s=kw.pop("profile_interval_s", 0.25), **kw)


async def admit(api, kubelet: KubeletEmulator, build: Build, timelines: Path, name: str, compute: int,  # type: ignore[no-untyped-def]
                policy: str | None = None) -> Tenant:
    pod = make_pod(name, node=NODE, restart_policy="Never", containers=[{"name": "main", "compute": compute}])
    if policy is not None:
        pod["metadata"].setdefault("annotations", {})[COMPUTE_POLICY_ANNOTATION] = policy
    api.add_pod(pod)
    await asyncio.sleep(0.2)  # the pod watch has it
    answers = await kubelet.admit("default", name, "main", {RESOURCE_COMPUTE: compute})
    return Tenant(build, answers, timelines)


async def test_two_tenants_30_70_split_3_to_7(root, api, build, timelines):
    settings = settings_for(root, timelines, dispatch_gain=float(os.environ.get("G", 0.5)), dispatch_fast_gain=float(os.environ.get("FG", 0.9)))
    async with api.api_client() as client, running_agent(settings, kubernetes_for(client)) as running, \
            KubeletEmulator(settings.device_plugin_dir, settings.pod_resources_socket) as kubelet:
        await registered(kubelet)
        a = await admit(api, kubelet, build, timelines, "a", 30)
        b = await admit(api, kubelet, build, timelines, "b", 70)
        t0 = now_ns()
        async def watch():
            while True:
                print(round((now_ns()-t0)/1e9,2), {k[:4]: (round(c.k, 2), c.rate//10**7, round(c.target,1), None if c.measured is None else round(c.measured,1), round(c.taken_rate/1e7,1), round(c.wait_frac,2)) for k, c in running.agent.dispatcher.state.items()})
                await asyncio.sleep(1)
        w = asyncio.create_task(watch())
        await a.start(10_000)
        await b.start(10_000)
        await asyncio.gather(a.wait(), b.wait())
        w.cancel()
        t1 = now_ns()
        a.recorder.poll()
        sa, sb = a.share(t0, t1), b.share(t0, t1)
        print("30/70 shares", round(sa, 2), round(sb, 2), "ratio", round(sa / sb, 3),
              "per s", [round(x, 1) for x in a.series(t0, t1, 1_000_000_000)],
              [round(x, 1) for x in b.series(t0, t1, 1_000_000_000)],
              {k: (round(c.k, 2), c.rate) for k, c in running.agent.dispatcher.state.items()})
        assert abs(sa / sb / (3 / 7) - 1) <= 0.05
