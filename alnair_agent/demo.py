"""`alnair-agent demo [--seconds N]`: the system working on one machine, with no GPU and no cluster.

The real agent runs on simulated GPUs against an in-process kubelet emulator (real gRPC over unix sockets in a
temporary folder) and admits four containers as kubelet would. Three of them then run a CUDA workload (`simapp`)
through the real shim (`libalnair.so`, preloaded as the container runtime would, with the env and mounts Allocate
returned) against the simulated driver (`tests/shim/simcuda`, which `pip install` builds into the package beside the
shim, so the demo runs from any folder; its per-GPU timelines are what the agent's profiler samples, as it samples
NVML on a real node). A table refreshes every second (container, GPU, cap, measured utilization, memory used/limit,
time throttled), then a summary.

What it shows is what the system guarantees today: no container exceeds its compute cap or its memory limit, and
capped containers sharing a GPU each get their cap (they take turns on it). The agent's log goes to a file, never
into the table.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import uvloop

from alnair_agent import logs
from alnair_agent.app import Agent
from alnair_agent.config import Settings, parse_sim_gpus
from alnair_agent.constants import (
    ENV_COMPUTE_LIMIT,
    ENV_MEMORY_LIMIT,
    ENV_VISIBLE_DEVICES,
    PACKAGE_SIM_DRIVER_DIR,
    RESOURCE_COMPUTE,
    RESOURCE_MEMORY,
    SIM_DRIVER_FILES,
)
from alnair_agent.gpu.simulated import SimulatedBackend
from alnair_agent.kube.wiring import pod_resources_lister
from alnair_agent.kubelet.emulator import AdmissionError, KubeletEmulator
from alnair_agent.shim_install import install_shim

GiB = 1 << 30
REFRESH_S = 1.0


@dataclass(frozen=True)
class Workload:
    pod: str
    memory: int  # alnair/vgpu-memory units (GiB)
    compute: int  # alnair/vgpu-compute units (%)
    what: str  # shown in the summary
    ops: tuple[str, ...]  # simapp operations, "{ms}" replaced by the run's length


DEMO_WORKLOADS = (
    Workload("train-a", 8, 30, "kernels back to back, 6 GiB held", ("init", "ctx", f"alloc:{6 * GiB}",
                                                                     "run:{ms}:1000000")),
    Workload("train-b", 8, 70, "kernels back to back, 6 GiB held", ("init", "ctx", f"alloc:{6 * GiB}",
                                                                     "run:{ms}:1000000")),
    Workload("notebook-c", 4, 20, "bursts (busy 40 % of the time), 3 GiB held, then asks 2 GiB more",
             ("init", "ctx", f"alloc:{3 * GiB}", f"alloc:{2 * GiB}", "bursts:{ms}")),
    Workload("too-big-d", 14, 10, "asks more memory than any GPU has left", ()),
)


class DemoUnavailable(RuntimeError):
    """The demo cannot run here (a package built without the simulated driver, and no checkout or no `make` to
    build it); the message says why."""


@dataclass
class Row:
    workload: Workload
    gpu: str = ""
    allocation: str = ""
    memory_limit: int = 0
    compute_limit: int = 0
    refused: str = ""
    util_now: float = 0.0
    util_mean: float = 0.0
    util_max: float = 0.0
    memory_used: int = 0
    memory_max: int = 0
    throttled_s: float = 0.0
    output: list[str] = field(default_factory=list)
    returncode: int | None = None


@dataclass
class DemoResult:
    rows: list[Row]
    seconds: float


# -- the simulated driver --------------------------------------------------------------------------------------------

def packaged_simulated_driver() -> Path:
    """The simulated driver built into the package (setup.py builds it into alnair_agent/lib/sim/)."""
    return Path(__file__).resolve().parent / PACKAGE_SIM_DRIVER_DIR


def _source_root() -> Path | None:
    """The checkout with tests/shim/simcuda and shim/ (the package's parent in a checkout, else the working dir)."""
    for root in (Path(__file__).resolve().parents[1], Path.cwd()):
        if (root / "tests/shim/simcuda/Makefile").is_file() and (root / "shim/cuda_abi.h").is_file():
            return root
    return None


def simulated_driver(out: Path) -> Path:
    """The simulated driver (libcuda.so.1, libnvidia-ml.so.1) and simapp in `out`: copied from the package, or
    built from a checkout when the package holds none (run from a source tree that was never installed)."""
    packaged = packaged_simulated_driver()
    if all((packaged / name).is_file() for name in SIM_DRIVER_FILES):
        out.mkdir(parents=True, exist_ok=True)
        for name in SIM_DRIVER_FILES:
            shutil.copyfile(packaged / name, out / name)
            os.chmod(out / name, 0o755)  # simapp runs; a wheel's installer need not have kept the mode
        return out
    return build_simulated_driver(out)


def build_simulated_driver(out: Path) -> Path:
    """`make` the simulated driver (libcuda.so.1, libnvidia-ml.so.1) and simapp into `out`; the folder."""
    root = _source_root()
    if root is None:
        raise DemoUnavailable(f"the package holds no simulated CUDA driver ({packaged_simulated_driver()}) and no "
                              "checkout of the project is here to build it from: reinstall it from a checkout "
                              "(`pip install .` builds the driver beside the shim)")
    if shutil.which("make") is None:
        raise DemoUnavailable("the demo builds the simulated CUDA driver with `make` and a C compiler; install them")
    done = subprocess.run(["make", "-s", "-C", str(root / "tests/shim/simcuda"), f"BUILD={out}",
                           f"SHIM={root / 'shim'}"], capture_output=True, text=True)
    if done.returncode != 0:
        raise DemoUnavailable(f"building the simulated CUDA driver failed: {done.stderr.strip()[-400:]}")
    return out


def _ops(w: Workload, seconds: float) -> list[str]:
    ms = int(seconds * 1000)
    out: list[str] = []
    for op in w.ops:
        if op == "bursts:{ms}":  # 20 ms of 1 ms kernels, 30 ms asleep
            out += ["burst:20:1000000", "sleep:30"] * max(1, ms // 50)
        else:
            out.append(op.replace("{ms}", str(ms)))
    return out


def container_env(answers: dict, sim: Path, timelines: Path) -> dict[str, str]:
    """The container's environment as the runtime would make it from Allocate's answer: its variables, with the
    container paths of its two mounts (the shim folder, its region folder) mapped to where they are on the host."""
    env: dict[str, str] = {}
    mounts: dict[str, str] = {}
    for answer in answers.values():  # merged first-wins, as kubelet does
        env = {**answer.envs, **env}
        mounts.update({m.container_path: m.host_path for m in answer.mounts})

    def host(path: str) -> str:
        for container_path, host_path in mounts.items():
            if path.startswith(container_path.rstrip("/") + "/"):
                return host_path.rstrip("/") + path[len(container_path.rstrip("/")):]
        return path

    base = {k: v for k, v in os.environ.items() if not k.startswith(("ALNAIR_", "SIMCUDA_", "LD_", "NVIDIA_"))}
    out = {**base, **env, "LD_LIBRARY_PATH": str(sim), "SIMCUDA_TIMELINE_DIR": str(timelines)}
    for key in ("LD_PRELOAD", "ALNAIR_REGION"):
        if key in out:
            out[key] = host(out[key])
    return out


# -- the table -------------------------------------------------------------------------------------------------------

def _gib(n: int) -> str:
    return f"{n / GiB:.1f}"


HEADER = (f"{'container':16} {'GPU':5} {'cap':>5} {'util now':>8} {'util mean':>9} {'max':>5} "
          f"{'memory used/limit':>18} {'throttled':>9}")


def table(rows: list[Row], gpus: dict[str, int], elapsed: float, seconds: float, final: bool = False) -> list[str]:
    lines = ["after the run (processes ended)" if final else f"t = {elapsed:4.1f} s of {seconds:g} s", HEADER]
    for r in rows:
        name = f"{r.workload.pod}/main"
        if r.refused:
            lines.append(f"{name:16} {'-':5} {str(r.workload.compute) + '%':>5} refused at admission")
            continue
        lines.append(f"{name:16} {'GPU' + str(gpus.get(r.gpu, '?')):5} {str(r.compute_limit) + '%':>5} "
                     f"{r.util_now:7.1f}% {r.util_mean:8.1f}% {r.util_max:4.0f}% "
                     f"{_gib(r.memory_used) + ' / ' + _gib(r.memory_limit) + ' GiB':>18} {r.throttled_s:8.1f}s")
    return lines


def _refresh(agent: Agent, rows: list[Row]) -> None:
    usage = agent.profiler.usage if agent.profiler is not None else {}
    for r in rows:
        u = usage.get(r.allocation)
        if u is None:
            continue
        e = u.entry()
        r.util_now, r.util_mean, r.util_max = u.gpu_util_now, float(e["gpu_util_mean"]), float(e["gpu_util_max"])
        r.memory_used, r.memory_max = u.memory_now_bytes, int(e["memory_max_bytes"])
        r.throttled_s = float(e["throttled_seconds"])


class Screen:
    """Redraws the table in place on a terminal; elsewhere (a pipe, CI) prints it every few seconds."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.tty = out.isatty()
        self.drawn = 0
        self.last_print = -1e9

    def draw(self, lines: list[str], final: bool = False) -> None:
        if self.tty:
            if self.drawn:
                self.out.write(f"\x1b[{self.drawn}F\x1b[J")
            self.out.write("\n".join(lines) + "\n")
            self.drawn = len(lines)
        elif final or time.monotonic() - self.last_print >= 5.0:
            self.out.write("\n".join(lines) + "\n\n")
            self.last_print = time.monotonic()
        self.out.flush()


# -- the run ---------------------------------------------------------------------------------------------------------

async def demo(root: Path, seconds: float = 15.0, out: TextIO = sys.stdout) -> DemoResult:
    sim = simulated_driver(root / "sim")
    timelines = root / "timelines"
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
        profile_interval_s=0.5,
        sim_timeline_dir=timelines,
    )
    settings.shim_dir.mkdir(parents=True)
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):  # its line is for the init container's log
        if install_shim(settings.shim_dir) != 0:  # what the DaemonSet's init container does
            raise DemoUnavailable("the package was built without libalnair.so")
    rows = [Row(w) for w in DEMO_WORKLOADS]
    stop = asyncio.Event()
    async with (KubeletEmulator(settings.device_plugin_dir, settings.pod_resources_socket) as kubelet,
                pod_resources_lister(settings) as list_held):
        agent = Agent(settings, SimulatedBackend.from_settings(settings), list_held=list_held)
        task = asyncio.create_task(agent.run(stop), name="agent")
        try:
            await kubelet.wait_for(lambda k: all(k.healthy_devices(r) for r in (RESOURCE_MEMORY, RESOURCE_COMPUTE)), 10)
            gpus = {g.uuid: g.index for g in agent.gpus}
            out.write(f"Alnair demo: the agent on 2 simulated 16 GiB GPUs, the shim in every container, "
                      f"{seconds:g} s of work.\n")
            out.write(f"Registered with kubelet: {', '.join(sorted(kubelet.plugins))}\n\nAdmitting containers:\n")
            procs: list[tuple[Row, asyncio.subprocess.Process]] = []
            for r in rows:
                w = r.workload
                try:
                    answers = await kubelet.admit("default", w.pod, "main",
                                                  {RESOURCE_MEMORY: w.memory, RESOURCE_COMPUTE: w.compute})
                except AdmissionError as e:
                    r.refused = e.details
                    out.write(f"  {w.pod + '/main':16} {w.memory:>3} GiB {w.compute:>3} %  refused: {e.details}\n")
                    continue
                env = container_env(answers, sim, timelines)
                r.gpu = env[ENV_VISIBLE_DEVICES]
                r.memory_limit, r.compute_limit = int(env[ENV_MEMORY_LIMIT]), int(env.get(ENV_COMPUTE_LIMIT) or 0)
                r.allocation = Path(env["ALNAIR_REGION"]).parent.parent.name
                out.write(f"  {w.pod + '/main':16} {w.memory:>3} GiB {w.compute:>3} %  GPU{gpus[r.gpu]} "
                          f"({r.gpu}), LD_PRELOAD={answers_env(answers, 'LD_PRELOAD')}\n")
                if w.ops:
                    procs.append((r, await start_workload(w, sim, env, seconds)))
            out.write("\n")
            await watch_workloads(agent, rows, gpus, procs, seconds, out, settings.profile_interval_s * 2)
        finally:
            stop.set()
            await task
    summary(rows, out)
    return DemoResult(rows, seconds)


async def start_workload(w: Workload, sim: Path, env: dict[str, str], seconds: float) -> asyncio.subprocess.Process:
    """The workload's CUDA program (simapp) in the container's environment."""
    return await asyncio.create_subprocess_exec(str(sim / "simapp"), *_ops(w, seconds), env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)


async def watch_workloads(agent: Agent, rows: list[Row], gpus: dict[str, int],
                          procs: list[tuple[Row, asyncio.subprocess.Process]], seconds: float, out: TextIO,
                          settle_s: float) -> None:
    """The table every REFRESH_S while the workloads run; their output once they end; after `settle_s` (the
    profiler's last windows) the final table."""
    screen = Screen(out)
    started = time.monotonic()
    waiting = asyncio.gather(*(p.communicate() for _, p in procs))
    while not waiting.done():
        _refresh(agent, rows)
        screen.draw(table(rows, gpus, min(time.monotonic() - started, seconds), seconds))
        await asyncio.wait([waiting], timeout=REFRESH_S)
    for (r, p), (stdout, _) in zip(procs, waiting.result()):
        r.output, r.returncode = stdout.decode().splitlines(), p.returncode
    await asyncio.sleep(settle_s)
    _refresh(agent, rows)
    screen.draw(table(rows, gpus, seconds, seconds, final=True), final=True)


def answers_env(answers: dict, key: str) -> str:
    for answer in answers.values():
        if key in answer.envs:
            return answer.envs[key]
    return ""


def failure(r: Row) -> str:
    """The summary's line for a container whose program did not end well ('' for one that did): its row shows 0 %,
    which would otherwise pass for a container that had nothing to do."""
    if not r.returncode:
        return ""
    ended = f"signal {-r.returncode}" if r.returncode < 0 else f"exit code {r.returncode}"
    return f"    its program FAILED: it ended with {ended}.\n"


def summary(rows: list[Row], out: TextIO) -> None:
    out.write("Summary\n")
    for r in rows:
        w = r.workload
        name = f"{w.pod}/main"
        if r.refused:
            out.write(f"  {name}: refused at admission: no GPU has {w.memory} GiB left (on a cluster, alnair-scheduler "
                      "would place it on no node and it would stay Pending).\n")
            continue
        within = "within" if r.util_mean <= r.compute_limit + 2 else "ABOVE"
        out.write(f"  {name}: {w.what}. Cap {r.compute_limit} %: used {r.util_mean:.1f} % on average "
                  f"({within} its cap), waited {r.throttled_s:.1f} s for its turn; memory at most "
                  f"{_gib(r.memory_max)} of {_gib(r.memory_limit)} GiB.\n")
        out.write(failure(r))
        refused = [ln for ln in r.output if ln.startswith("alloc ") and "rc=2 " in ln]
        for ln in refused:
            size = int(ln.split()[1])
            out.write(f"    an allocation of {_gib(size)} GiB past its limit got CUDA_ERROR_OUT_OF_MEMORY from "
                      "the shim.\n")
    out.write("Caps are ceilings: the shim holds each container to its cap and its memory limit. A container may get "
              "less than its cap while another shares its GPU.\n")


def run_demo(seconds: float = 15.0) -> int:
    with tempfile.TemporaryDirectory(prefix="alnair-demo-") as tmp:
        log_path = Path(tmp) / "agent.log"
        with open(log_path, "w") as log_file:
            # The agent's log, and anything the C libraries (gRPC) write on stderr: into a file, never the table.
            logs.configure("json", "info", log_file)
            sys.stderr.flush()
            saved = os.dup(2)
            os.dup2(log_file.fileno(), 2)
            from alnair_agent.demo_dra import demo_all  # the device plugin run, then the DRA run

            try:
                uvloop.run(demo_all(Path(tmp), seconds))
            except DemoUnavailable as e:
                problem = str(e)
            else:
                problem = ""
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                os.close(saved)
            if problem:
                print(f"alnair-agent demo: {problem}", file=sys.stderr)
                return 1
        lines = log_path.read_text().splitlines()
        warnings = sum('"level": "warning"' in ln or '"level": "error"' in ln for ln in lines)
        print(f"The agent logged {len(lines)} lines ({warnings} warnings or errors) into a file, deleted now.")
    return 0
