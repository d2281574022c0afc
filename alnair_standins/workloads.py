"""What the GPU tests and the GPU benchmarks (bench/dispatcher_gpu.py, bench/shares_gpu.py) share: one matmul's
calibration, a tenant program run in a child process, a tenant's environment as its container would get it, the
device's own utilization polled from outside the shim, an agent (NVML backend) serving a kubelet emulator, and a
fresh node of both in a temporary folder (Node).

Heavy imports (the agent, pynvml) happen when used, so importing this module needs neither a GPU nor the agent's
dependencies.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from alnair_agent.app import Agent
    from alnair_agent.config import Settings
    from alnair_standins.kubelet import KubeletEmulator

# One bf16 4096^3 matmul's GPU time, back to back after a warm-up: {"matmul_s": seconds}
CALIBRATE = """
import json, torch
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
for _ in range(50):
    a @ a
torch.cuda.synchronize()
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
n = 500
s.record()
for _ in range(n):
    a @ a
e.record()
torch.cuda.synchronize()
print(json.dumps({"matmul_s": s.elapsed_time(e) / 1000 / n}), flush=True)
"""


async def run_py(code: str, env: dict[str, str], *args: str, timeout: float = 600) -> dict:
    """Run `code` with `args` in a child Python; its last line of output, as JSON. A failure raises with its stderr."""
    p = await asyncio.create_subprocess_exec(sys.executable, "-c", code, *args, env=env,
                                             stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(p.communicate(), timeout)
    if p.returncode != 0:
        raise RuntimeError(f"child exited {p.returncode}: {err.decode()[-3000:]}")
    return json.loads(out.decode().strip().splitlines()[-1])


def skip_without_gpu_or_shim(shim: Path) -> None:
    """Skip the calling test where there is no NVIDIA driver or GPU (CI), or no shim at `shim`."""
    import pynvml
    import pytest

    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        pytest.skip("no NVIDIA driver / GPU here")
    if not shim.exists():
        pytest.skip(f"no shim at {shim}")


def plain_env(index: int | str = 0) -> dict[str, str]:
    """This process's environment without the shim, on one GPU."""
    return {**{k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}, "CUDA_VISIBLE_DEVICES": str(index)}


def tenant_env(answers: dict, agent: "Agent", shim: Path) -> dict[str, str]:
    """The environment a container gets from these Allocate answers (per resource), the shim preloaded, with
    CUDA_VISIBLE_DEVICES for what NVIDIA_VISIBLE_DEVICES does in a container.

    Every variable of the answers is passed on (whatever the sharing mechanism hands a container, it gets), a value
    naming a path under one of the answers' mounts rewritten to that mount's folder on this host: a process here
    sees the host's paths, not the container's."""
    from alnair_agent.constants import (
        ENV_COMPUTE_LIMIT,
        ENV_MEMORY_LIMIT,
        ENV_VISIBLE_DEVICES,
    )

    env: dict[str, str] = {}
    for a in answers.values():
        for k, v in a.envs.items():
            env.setdefault(k, v)  # kubelet merges the answers first-wins per variable
    mounts = sorted(((m.container_path.rstrip("/"), m.host_path) for a in answers.values() for m in a.mounts),
                    key=lambda m: -len(m[0]))  # the deepest mount first

    def on_host(value: str) -> str:
        for container, host in mounts:
            if value == container or value.startswith(container + "/"):
                return host + value[len(container):]
        return value

    index = next(g.index for g in agent.gpus if g.uuid == env[ENV_VISIBLE_DEVICES])
    return {**os.environ, **{k: on_host(v) for k, v in env.items()}, "LD_PRELOAD": str(shim),
            ENV_MEMORY_LIMIT: env.get(ENV_MEMORY_LIMIT, "0"), ENV_COMPUTE_LIMIT: env.get(ENV_COMPUTE_LIMIT, "0"),
            "CUDA_VISIBLE_DEVICES": str(index)}


class NvmlUtilization:
    """The device's own utilization (NVML, the figure nvidia-smi shows: the fraction of time a kernel ran), polled
    every `interval_s` by a thread of this process (not under the shim): samples of (wall s, percent)."""

    def __init__(self, index: int, interval_s: float = 0.05) -> None:
        import pynvml

        self.nvml = pynvml
        pynvml.nvmlInit()
        self.h = pynvml.nvmlDeviceGetHandleByIndex(index)
        self.interval_s = interval_s
        self.samples: list[tuple[float, int]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="nvml-utilization", daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(self.interval_s):
            self.samples.append((time.time(), self.nvml.nvmlDeviceGetUtilizationRates(self.h).gpu))

    def __enter__(self) -> "NvmlUtilization":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.nvml.nvmlShutdown()

    def mean(self, t0: float, t1: float, skip_s: float = 0.0) -> float:
        """Mean percent over [t0 + skip_s, t1] (wall s; NaN without samples). A sample covers the driver's last
        period, so a window that starts with a process skips ~0.5 s."""
        xs = [u for t, u in self.samples if t0 + skip_s <= t <= t1]
        return sum(xs) / len(xs) if xs else float("nan")


@asynccontextmanager
async def gpu_agent(settings: "Settings", kubernetes: Any = None) -> AsyncIterator[tuple["Agent", "KubeletEmulator"]]:
    """The agent (NVML backend) running against a kubelet emulator, both plugins registered with devices; stopped
    (and waited for) on exit."""
    from alnair_agent.app import Agent
    from alnair_agent.constants import RESOURCE_COMPUTE, RESOURCE_MEMORY
    from alnair_agent.gpu.nvml import NvmlBackend
    from alnair_agent.kube.wiring import pod_resources_lister
    from alnair_standins.kubelet import KubeletEmulator

    async with (KubeletEmulator(settings.device_plugin_dir, settings.pod_resources_socket) as kubelet,
                pod_resources_lister(settings) as list_held):
        agent = Agent(settings, NvmlBackend(), kubernetes, list_held=list_held)
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop), name="agent")
        try:
            await kubelet.wait_for(lambda k: all(r in k.plugins and k.plugins[r].devices
                                                 for r in (RESOURCE_MEMORY, RESOURCE_COMPUTE)), 60)
            yield agent, kubelet
        finally:
            stop.set()
            await asyncio.wait_for(task, 20)


class Node:
    """A fresh agent (NVML backend) and kubelet emulator in a folder of their own under /tmp, the profiler and the
    dispatcher at their defaults; admit() returns a tenant's environment from the agent's own Allocate answers.
    `settings`: further Settings fields (e.g. a sharing mechanism's own), passed as they are."""

    def __init__(self, shim: Path, policy: str = "strict", dispatcher: str = "on", **settings: Any) -> None:
        self.shim, self.policy, self.dispatcher, self.settings = shim, policy, dispatcher, settings
        self.n = 0

    async def __aenter__(self) -> "Node":
        from alnair_agent.config import Settings

        self.root = r = Path(tempfile.mkdtemp(prefix="aln-", dir="/tmp"))
        settings = Settings(node_name="gpu-node", device_plugin_dir=r / "dp", pod_resources_socket=r / "pr" / "k.sock",
                            workspace=r / "ws", shim_dir=self.shim.parent, gpu_backend="nvml", kubernetes="off",
                            metrics_port=0, resync_interval_s=0.5, compute_policy=self.policy,
                            dispatcher=self.dispatcher, **self.settings)
        self.running = gpu_agent(settings)
        try:
            self.agent, self.kubelet = await self.running.__aenter__()
        except BaseException:
            shutil.rmtree(r, ignore_errors=True)
            raise
        return self

    async def admit(self, compute: int, memory_gib: int = 16, policy: str | None = None) -> dict[str, str]:
        """A container of a new pod asking for `compute` % (0: no compute limit) and `memory_gib` GiB; `policy`
        (strict, elastic, latency) stands for its pod's compute-policy annotation (no API server here), else the
        node's default."""
        from alnair_agent.constants import ENV_ALLOCATION_ID, RESOURCE_COMPUTE, RESOURCE_MEMORY

        self.n += 1
        req = {RESOURCE_MEMORY: memory_gib, **({RESOURCE_COMPUTE: compute} if compute else {})}
        env = tenant_env(await self.kubelet.admit("default", f"t{self.n}", "main", req), self.agent, self.shim)
        if policy is not None:
            if self.agent.dispatcher is None:
                raise RuntimeError("a compute policy needs the dispatcher on")
            self.agent.dispatcher.set_policy(env[ENV_ALLOCATION_ID], policy)
        return env

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.running.__aexit__(None, None, None)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
