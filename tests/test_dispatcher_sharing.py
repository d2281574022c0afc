"""The dispatcher's two regimes on a shared GPU, driven tick by tick with stand-in regions and profiler (the control
law is in test_dispatcher_control.py; real processes in test_dispatcher.py):
- a GPU whose NVML per-process utilization is a share per process: factors are learnt, the shims are told nothing;
- a GPU whose driver gives each sampling period to one process (the H200): factors stay 1, every capped container's
  shim is told how many others run there (uncapped ones included), and strict targets fit the measured capacity."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from alnair_agent.dispatcher.service import Dispatcher
from alnair_agent.gpu.backend import GpuSample, Samples
from alnair_agent.node.region import SlotReading

GPU = "GPU-0"


@dataclass
class FakeRegion:
    """What the dispatcher reads and writes of one container's region. `took`: tokens per tick it takes."""

    took: int
    taken: int = 0
    launches: int = 0
    rate: int = 0
    sharers: int = 0
    writes: list[int] = field(default_factory=list)

    def advance(self) -> None:
        self.taken += self.took
        self.launches += 10 if self.took else 0

    def slots(self) -> list[SlotReading]:
        return [SlotReading(0, 1, 1, 0, self.launches, self.taken, 0, int(0.9 * 0.05e9) * self.launches // 10)]

    def grant_line(self) -> tuple[int, int, int]:
        return (0, 0, 0)

    def set_grant_line(self, rate: int) -> None:
        self.rate = rate

    def set_sharers(self, n: int) -> None:
        self.sharers = n
        self.writes.append(n)

    def close(self) -> None:
        pass


def node(caps: dict[str, int], took: dict[str, int], sampled: bool | None):
    regions = {k: FakeRegion(took[k]) for k in caps}
    allocs = {k: SimpleNamespace(id=k, compute_limit=cap, gpu_uuid=GPU, identified=False) for k, cap in caps.items()}
    profiler = SimpleNamespace(samples=0, sample_at=0.0, sampled_s=0.0, usage={}, hurried=[],
                               last=Samples(gpus=(GpuSample(GPU, process_util_sampled=sampled),)))
    profiler.hurry = profiler.hurried.append
    d = Dispatcher(SimpleNamespace(allocations=allocs), SimpleNamespace(open_region=lambda k: regions[k]), profiler,
                   None)
    return d, regions, profiler


def run(d: Dispatcher, regions: dict[str, FakeRegion], profiler, shares: dict[str, float], seconds: float) -> None:
    """Tick every 50 ms, on from the last run's time; every 250 ms the profiler saw each container use `shares` %
    of the GPU."""
    t = d._last if d.ticks else 1000.0
    integral = {k: 0.0 for k in shares}
    for i in range(int(seconds / 0.05)):
        t += 0.05
        for r in regions.values():
            r.advance()
        if i % 5 == 4:
            for k, s in shares.items():
                integral[k] += s * 0.25
            profiler.samples += 1
            profiler.sample_at = t
            profiler.sampled_s += 0.25
            profiler.usage = {k: SimpleNamespace(gpu_util_integral=v) for k, v in integral.items()}
        d.tick(t)
    assert d._last == t


TOK30, TOK70 = int(0.30e9 * 0.05), int(0.70e9 * 0.05)  # tokens per 50 ms tick at 30 % and 70 %


def test_where_shares_are_exact_factors_are_learnt_and_shims_are_told_nothing():
    d, regions, profiler = node({"a": 30, "b": 70}, {"a": TOK30, "b": TOK70}, sampled=False)
    run(d, regions, profiler, {"a": 20.0, "b": 70.0}, 6.0)  # a is charged 1.5x what it really gets
    assert d.gpus[GPU].learn
    assert d.state["a"].k == pytest.approx(1.5, rel=0.1)
    assert all(r.sharers == 0 for r in regions.values())


def test_where_nvml_samples_by_period_factors_stay_1_and_shims_are_told_who_shares():
    d, regions, profiler = node({"a": 30, "b": 70, "u": 0}, {"a": TOK30, "b": TOK70, "u": 0}, sampled=True)
    run(d, regions, profiler, {"a": 20.0, "b": 70.0}, 2.0)
    assert not d.gpus[GPU].learn
    assert d.state["a"].k == 1.0 and d.state["b"].k == 1.0
    assert regions["a"].sharers == 1 and regions["b"].sharers == 1  # u has launched nothing: not a sharer
    regions["u"].took = 1  # an uncapped container starts launching: it time-slices the GPU too
    run(d, regions, profiler, {"a": 20.0, "b": 70.0}, 1.0)
    assert regions["a"].sharers == 2 and regions["b"].sharers == 2
    assert regions["u"].writes == []  # no cap: its shim meters nothing, and is told nothing


def test_where_nvml_samples_by_period_caps_fit_what_the_gpu_delivers():
    # b is held by the GPU: granted 70 % but takes 57 % (time-slicing lost 13 points)
    d, regions, profiler = node({"a": 30, "b": 70}, {"a": TOK30, "b": int(0.57e9 * 0.05)}, sampled=True)
    run(d, regions, profiler, {"a": 30.0, "b": 57.0}, 4.0)
    scale = d.gpus[GPU].scale
    assert 0.8 <= scale <= 0.9, scale
    assert regions["a"].rate / regions["b"].rate == pytest.approx(3 / 7, rel=0.02)


def test_elastic_borrowers_held_by_tokens_on_an_idle_gpu_are_lent_it():
    # both elastic, both waiting for tokens, yet NVML says the device is 40 % busy: their charges over-state
    d, regions, profiler = node({"a": 50, "b": 50}, {"a": int(0.5e9 * 0.05), "b": int(0.5e9 * 0.05)}, sampled=True)
    d.policy = "elastic"
    profiler.last = Samples(gpus=(GpuSample(GPU, gpu_util=40.0, process_util_sampled=True),))
    run(d, regions, profiler, {"a": 20.0, "b": 20.0}, 2.0)
    assert d.gpus[GPU].boost > 2.0
    assert regions["a"].rate > 2 * 50 * 10_000_000


def test_a_window_that_began_before_a_container_started_teaches_nothing():
    # NVML shows a process at start-up (context creation, the first kernels) in a window that began before its
    # region showed any launch: that window says nothing about its charge factor, even on the tick it starts
    d, regions, profiler = node({"a": 30}, {"a": 0}, sampled=False)
    run(d, regions, profiler, {"a": 0.0}, 1.0)  # idle: not active, windows of nothing
    regions["a"].took = TOK30
    t = 1000.0 + 1.0 + 0.05
    regions["a"].advance()
    profiler.samples += 1  # a window ends on the very tick its first launches show
    profiler.sample_at = t
    profiler.sampled_s += 0.25
    profiler.usage = {"a": SimpleNamespace(gpu_util_integral=90.0 * 0.25)}
    d.tick(t)
    assert d.state["a"].k == 1.0


@pytest.mark.parametrize("sampled, policies, hurried", [
    (False, ("strict", "strict"), True),     # factors are learnt from the profiler's windows
    (None, ("strict", "strict"), True),      # not known yet: learnt until the driver is seen to sample by period
    (True, ("strict", "strict"), False),     # factors stay 1: no window is used, the profiler keeps its own pace
    (True, ("elastic", "elastic"), True),    # the boost reads the device's utilization per window
    (True, ("elastic", "strict"), False),    # a strict container active: no boost
])
def test_the_profiler_is_hurried_only_where_its_windows_steer(sampled, policies, hurried):
    d, regions, profiler = node({"a": 30, "b": 50}, {"a": TOK30, "b": TOK30}, sampled=sampled)
    d._policy = lambda alloc: dict(zip("ab", policies))[alloc.id]
    run(d, regions, profiler, {"a": 30.0, "b": 30.0}, 1.0)  # the driver's sampling is known by now
    profiler.hurried.clear()
    run(d, regions, profiler, {"a": 30.0, "b": 30.0}, 0.5)
    assert bool(profiler.hurried) is hurried
    regions["a"].took = regions["b"].took = 0  # nobody active: never hurried
    run(d, regions, profiler, {"a": 0.0, "b": 0.0}, 0.5)
    profiler.hurried.clear()
    run(d, regions, profiler, {"a": 0.0, "b": 0.0}, 0.5)
    assert profiler.hurried == []
