"""What the demo's two runs share: the four workloads, a row of the table and the table itself, a container's
environment as the runtime makes it from the agent's answer, and the workloads run and watched through the real
shim on the simulated driver (alnair_standins.simdriver) while the profiler samples them.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from alnair_agent.app import Agent

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
    """The demo cannot run here (a package built without libalnair.so); the message says why. A missing simulated
    driver is alnair_standins.simdriver.DriverUnavailable."""


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

def gib(n: int) -> str:
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
                     f"{gib(r.memory_used) + ' / ' + gib(r.memory_limit) + ' GiB':>18} {r.throttled_s:8.1f}s")
    return lines


def _refresh(agent: Agent, rows: list[Row]) -> None:
    usage = agent.profiler.usage if agent.profiler is not None else {}
    for r in rows:
        u = usage.get(r.allocation)
        if u is None:
            continue
        e = u.entry()
        r.util_now, r.util_mean, r.util_max = u.gpu_util_now, _number(e["gpu_util_mean"]), _number(e["gpu_util_max"])
        r.memory_used, r.memory_max = u.memory_now_bytes, int(_number(e["memory_max_bytes"]))
        r.throttled_s = _number(e["throttled_seconds"])


def _number(value: object) -> float:
    """A figure of the usage entry (JSON numbers)."""
    return float(value) if isinstance(value, (int, float)) else 0.0


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


# -- the run: what both front-ends' runs share -------------------------------------------------------------------

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
    for (r, p), (stdout, _) in zip(procs, waiting.result(), strict=True):
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


