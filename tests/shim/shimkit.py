"""Helpers for the shim tests: run programs under the shim against the simulated driver, read what they print.

The simulated driver (simcuda/) is a libcuda.so.1 + libnvidia-ml.so.1 written for these tests; `simapp` is a
driver-API program that reaches it by direct calls, dlopen+dlsym or cuGetProcAddress_v2. The agent's side of the
region is the real `alnair_agent.node.region.Region`.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from alnair_standins.simbuild import ROOT, SIM_SRC, Build  # noqa: F401 - the shim tests' names for them

GiB = 1 << 30
MiB = 1 << 20


@dataclass
class Result:
    lines: list[str]
    stderr: str
    stats: dict[str, int] = field(default_factory=dict)
    returncode: int = 0

    def line(self, prefix: str, nth: int = 0) -> dict[str, str]:
        """The nth output line starting with `prefix`, as {key: value} of its key=value words."""
        found = [ln for ln in self.lines if ln.split(" ", 1)[0] == prefix]
        assert len(found) > nth, f"no {prefix!r} line #{nth} in {self.lines}"
        return words(found[nth])

    def rcs(self, prefix: str) -> list[int]:
        return [int(words(ln)["rc"])
                for ln in self.lines if ln.split(" ", 1)[0] == prefix]


def words(line: str) -> dict[str, str]:
    """One output line's key=value words."""
    return dict(w.split("=", 1) for w in line.split() if "=" in w)


def gpu_share(run: dict[str, str]) -> float:
    """The GPU's share of the wall time of one `run` line's words."""
    return int(run["gpu_ns"]) / int(run["wall_ns"])


def share(res: Result, nth: int = 0) -> tuple[float, float]:
    """The GPU's and a CPU's share of the wall time of the `nth` `run` line (no bad launches in it)."""
    run = res.line("run", nth)
    assert run["bad"] == "0", res.lines
    return gpu_share(run), int(run["cpu_ns"]) / int(run["wall_ns"])


def _env(build: Build, tmp: Path, preload: bool, region: Path | None, extra: dict[str, str] | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ALNAIR_", "SIMCUDA_", "LD_"))}
    env["LD_LIBRARY_PATH"] = str(build.sim)
    if preload:
        env["LD_PRELOAD"] = str(build.shim)
    if region is not None:
        env["ALNAIR_REGION"] = str(region)
    env["ALNAIR_CONTEXT_BYTES"] = "0"  # tests that count contexts set it themselves
    env.update(extra or {})
    return env


def one_gpu(tmp: Path) -> dict[str, str]:
    """Environment that puts processes on one simulated GPU whose time they share (its timeline file): without it
    each process's streams run on a GPU of their own."""
    timelines = tmp / "timelines"
    timelines.mkdir(exist_ok=True)
    return {"SIMCUDA_TIMELINE_DIR": str(timelines), "NVIDIA_VISIBLE_DEVICES": "GPU-sim-0"}


class Runner:
    """Runs simapp under the shim (or not) against the simulated driver."""

    def __init__(self, build: Build, tmp: Path) -> None:
        self.build = build
        self.tmp = tmp
        self.n = 0

    def env(self, preload: bool = True, region: Path | None = None, extra: dict | None = None) -> dict:
        return _env(self.build, self.tmp, preload, region, extra)

    def run(self, *ops: str, preload: bool = True, region: Path | None = None, env: dict | None = None,
            timeout: float = 60) -> Result:
        self.n += 1
        stats = self.tmp / f"stats{self.n}"
        e = self.env(preload, region, env)
        e["SIMCUDA_STATS"] = str(stats)
        p = subprocess.run([str(self.build.app), *ops], env=e, capture_output=True, text=True, timeout=timeout)
        return Result(p.stdout.splitlines(), p.stderr, read_stats(stats), p.returncode)

    def start(self, *ops: str, region: Path | None = None, env: dict | None = None) -> subprocess.Popen:
        """Start simapp; its ops should end in `hold` (it then waits for a line on stdin)."""
        return subprocess.Popen([str(self.build.app), *ops], env=self.env(True, region, env), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read_stats(path: Path) -> dict[str, int]:
    if not path.exists():
        return {}
    return {k: int(v) for k, v in (ln.split() for ln in path.read_text().splitlines() if ln.strip())}


def wait_holding(p: subprocess.Popen) -> list[str]:
    """Read a held process's output up to its 'holding' line (a hang is stopped by pytest-timeout)."""
    lines = []
    while True:
        ln = p.stdout.readline()
        assert ln, f"pid {p.pid} ended before holding: {lines} {p.stderr.read() if p.stderr else ''}"
        lines.append(ln.strip())
        if ln.strip() == "holding":
            return lines


def shares_together(runner: "Runner", regions: list[Path], op: str, tmp: Path) -> list[float]:
    """Processes running `op` at once on one simulated GPU, one per region: each one's GPU time / wall time."""
    env = one_gpu(tmp)
    procs = [runner.start("init", op, "hold", region=path, env=env) for path in regions]
    shares = []
    try:
        for p in procs:
            lines = wait_holding(p)
            shares.append(gpu_share(words(lines[-2])))
    finally:
        for p in procs:
            release(p)
    return shares


def release(p: subprocess.Popen) -> str:
    out, _ = p.communicate("go\n", timeout=30)
    return out or ""


def kill9(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    for f in (p.stdin, p.stdout, p.stderr):
        if f:
            f.close()
