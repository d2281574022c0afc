"""The GPU time a host-bound program is counted: the diagnostic build that takes an idle GPU's host time off a
sample (-DIDLE_SAMPLE=1, shim/launch_internal.h: why it is not the default) beside the shipped build.

A sample is a pair of events around one launch. On a GPU with nothing queued the start event runs at once and the
kernel only when the host's launch call has queued it, so the sample holds the launch call's host time too. For a
program that leaves the GPU idle between launches (a training step, batch-1 inference, small kernels) every
estimate is then too long: its slot counts more GPU time than it used (the profiler's usage of a capped container
is that count), its fences come as often as the inflated charges say, and its estimated queue runs ahead of the
real one. The simulated driver has the H200 VM's host costs here (a 4 us launch call, 3.4 us per event call) and
the program runs elastic, lent the whole GPU, where it must cost nothing.

What the diagnostic build still cannot tell: a kernel shorter than the end event's own record call (3.4 us here), whose end
event then runs when the host records it. Its estimate stays that long (the `small` row)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from shimkit import Build, Runner

from alnair_agent.node.region import Region, Turn, monotonic_ns
from alnair_standins.simbuild import build_shim_and_driver

HOST = {"SIMCUDA_LAUNCH_HOLD_NS": "4000", "SIMCUDA_EVENT_NS": "3400"}


@dataclass(frozen=True)
class Row:
    op: str
    low: float  # counted / used, with the diagnostic build: at least
    high: float  # ... and at most
    env: tuple[tuple[str, str], ...] = ()


ROWS = {
    # 79 distinct 20 us kernels a step, 25 us of host before each, a wait for the GPU each step
    "train": Row("hsteps:1500:79:20000:25000", 0.85, 1.15),
    # one 20 us kernel after 30 us of host, never a sync
    "host-loop": Row("loop:1500:20000:0:30000", 0.85, 1.15),
    # 2 us kernels after 5 us of host: shorter than the end event's record call, counted that long (4.0 before)
    "small": Row("loop:1500:2000:0:5000", 0.5, 2.2),
    # GPU-bound: 100 us kernels queued ahead, a wait every 20; its samples are queued behind work and unchanged
    "mm-sync": Row("loop:1500:100000:20:0", 0.9, 1.1),
    # 40 distinct 30 us kernels a step, each one's first launch loading its module for 3 ms (lazy loading)
    "first-load": Row("steps:1500:40:30000", 0.8, 1.3, (("SIMCUDA_FIRST_LAUNCH_NS", "3000000"),)),
}


@pytest.fixture(scope="session")
def idle_build(tmp_path_factory: pytest.TempPathFactory) -> Build:
    """The diagnostic build: an idle GPU's host time taken off a sample."""
    return build_shim_and_driver(tmp_path_factory.mktemp("idle1"), "-O2 -DIDLE_SAMPLE=1")


def counted_over_used(build: Build, tmp: Path, name: str, row: Row) -> tuple[float, dict[str, int], int]:
    """Run the row's program lent the whole GPU (a cap of 50 with a lease over the run): the GPU time its slot
    counted over the GPU time its kernels took, the simulated driver's call counts and the launches."""
    path = tmp / name
    region = Region.create(path, 0, 50)
    try:
        now = monotonic_ns()
        region.set_turn(Turn(now, 100_000_000, 0, 50_000_000, now + 60_000_000_000))
        res = Runner(build, tmp).run("init", row.op, region=path, env={**HOST, **dict(row.env)})
        run = res.line("run")
        assert run["bad"] == "0", res.lines
        [slot] = region.slots()
        return slot.gpu_ns / int(run["gpu_ns"]), res.stats, int(run["launches"])
    finally:
        region.close()


@pytest.mark.parametrize("shape", sorted(ROWS))
def test_a_host_bound_programs_gpu_time_is_counted_as_the_gpu_ran_it(build, idle_build, tmp_path, shape):
    row = ROWS[shape]
    shipped, s_stats, s_n = counted_over_used(build, tmp_path, "shipped", row)
    idle, i_stats, i_n = counted_over_used(idle_build, tmp_path, "idle", row)
    per = {k: (1000 * s_stats.get(k, 0) / s_n, 1000 * i_stats.get(k, 0) / i_n) for k in ("cuEventRecord",
                                                                                          "cuEventQuery")}
    print(shape, f"counted / used: shipped {shipped:.2f}, IDLE_SAMPLE=1 {idle:.2f};",
          " ".join(f"{k} per 1000 launches {a:.1f} / {b:.1f}" for k, (a, b) in per.items()))
    assert row.low <= idle <= row.high, (shape, idle)
    assert idle <= shipped * 1.1, (shape, shipped, idle)  # never counted more than the shipped build counts
