"""The dispatcher service tick by tick with stand-in regions and profiler (the rules are in
test_dispatcher_control.py; real processes under the real shim in test_dispatcher.py): what it writes into each
container's region, over many seeds of who starts when."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from alnair_agent.dispatcher import control as C
from alnair_agent.dispatcher.service import Dispatcher
from alnair_agent.gpu.backend import GpuSample, Samples
from alnair_agent.node.region import RegionError, SlotReading, Turn

GPU = "GPU-0"


@dataclass
class FakeRegion:
    """What the dispatcher reads and writes of one container's region."""

    launching: bool = False
    launches: int = 0
    broken: bool = False
    turns: list[Turn] = field(default_factory=list)
    per_tick: int = 10  # launches per tick while launching on its windows
    per_tick_lent: int | None = None  # ... while lent the GPU (None: the same)

    def advance(self) -> None:
        lent = bool(self.turns) and self.turns[-1].free_until_ns > 0
        rate = self.per_tick_lent if lent and self.per_tick_lent is not None else self.per_tick
        self.launches += rate if self.launching else 0

    def slots(self) -> list[SlotReading]:
        if self.broken:
            raise RegionError("truncated")
        return [SlotReading(0, 1, 1, 0, self.launches, 0, 0, 0)]

    def set_turn(self, turn: Turn) -> bool:
        if self.turns and self.turns[-1] == turn:
            return False
        self.turns.append(turn)
        return True

    def set_class(self, compute_class: int, board_slot: int = 0, hold_mask: int = 0, hold_pct: int = 0) -> None:
        self.compute_class = (compute_class, board_slot, hold_mask, hold_pct)

    def close(self) -> None:
        pass


def node(caps: dict[str, int], policy: str = C.STRICT, gpus: dict[str, str] | None = None):
    regions = {k: FakeRegion() for k in caps}
    allocs = {k: SimpleNamespace(id=k, compute_limit=cap, gpu_uuid=(gpus or {}).get(k, GPU), identified=False)
              for k, cap in caps.items()}
    profiler = SimpleNamespace(samples=0, sample_at=0.0, last=Samples(gpus=(GpuSample(GPU),)))
    d = Dispatcher(SimpleNamespace(allocations=allocs), SimpleNamespace(open_region=lambda k: regions[k]), profiler,
                   None, policy=policy)
    return d, regions, profiler


def ticks(d: Dispatcher, regions: dict[str, FakeRegion], n: int, t: list[float]) -> None:
    for _ in range(n):
        t[0] += 0.05
        for r in regions.values():
            r.advance()
        d.tick(t[0])


def windows(regions: dict[str, FakeRegion]) -> dict[str, tuple[int, int]]:
    return {k: (r.turns[-1].offset_ns, r.turns[-1].length_ns) for k, r in regions.items() if r.turns}


def test_capped_containers_of_a_gpu_get_disjoint_windows_of_their_caps_and_uncapped_ones_none():
    d, regions, _ = node({"a": 20, "b": 30, "c": 50, "u": 0})
    ticks(d, regions, 2, [100.0])
    w = windows(regions)
    assert "u" not in w
    assert {k: round(100 * n / d.period_ns) for k, (_, n) in w.items()} == {"a": 20, "b": 30, "c": 50}
    spans = sorted((o, o + n) for o, n in w.values())
    assert all(x[1] <= y[0] for x, y in zip(spans, spans[1:], strict=False))
    assert len({r.turns[-1].epoch_ns for k, r in regions.items() if k != "u"}) == 1  # one period for the GPU


def test_gpus_are_laid_out_apart():
    d, regions, _ = node({"a": 60, "b": 60}, gpus={"a": "GPU-0", "b": "GPU-1"})
    ticks(d, regions, 1, [100.0])
    assert windows(regions) == {"a": (0, int(0.6 * d.period_ns)), "b": (0, int(0.6 * d.period_ns))}


@pytest.mark.parametrize("seed", range(20))
def test_an_elastic_lender_is_back_in_its_window_the_tick_anyone_starts(seed):
    """Over many seeds of who launches when: an elastic container is lent the GPU (a lease past now) exactly while
    it is the only active one, and the tick another container's launches appear its lease is gone."""
    rng = random.Random(seed)
    d, regions, _ = node({"lender": 30, "other": 70, "third": 0}, policy=C.ELASTIC)
    regions["lender"].launching = True
    t = [100.0]
    ticks(d, regions, 5, t)
    for _ in range(30):
        who = rng.choice(["other", "third"])
        regions[who].launching = rng.random() < 0.5
        ticks(d, regions, rng.randint(1, 8), t)
        lender = regions["lender"].turns[-1]
        others_active = any(d.state[k].active(t[0], d.idle_s) for k in ("other",) if k in d.state) or \
            (d._uncapped.get("third") is not None and t[0] - d._uncapped["third"][1] <= d.idle_s)
        lent = lender.free_until_ns > 0
        assert lent == (not others_active), (seed, t[0])


def test_a_lease_is_short_and_renewed():
    d, regions, _ = node({"a": 30}, policy=C.ELASTIC)
    regions["a"].launching = True
    ticks(d, regions, 3, [100.0])
    a, b = regions["a"].turns[-2:]
    assert b.free_until_ns > a.free_until_ns
    assert b.free_until_ns - b.epoch_ns < 10e9  # a lease outlives a few ticks, not the agent


def sample_util(profiler, t: float, util: float) -> None:
    profiler.samples += 1
    profiler.sample_at = t
    profiler.last = Samples(gpus=(GpuSample(GPU, gpu_util=util),))


def lent_flags(regions: dict[str, FakeRegion]) -> list[bool]:
    return [r.turns[-1].free_until_ns > 0 for r in regions.values()]


@pytest.mark.parametrize("lent_rate,kept", [(15, True), (10, True), (6, False)])
def test_elastic_pair_lent_together_on_trial_kept_while_it_slows_nobody(lent_rate, kept):
    """Two active elastic containers: windows for the arrival hold, then (the GPU has room) lent the GPU together on
    trial; the trial goes on while neither launches slower than on its windows, and a busy GPU does not end it
    (jobs filling each other's gaps are the packing wanted)."""
    d, regions, profiler = node({"a": 50, "b": 50}, policy=C.ELASTIC)
    for r in regions.values():
        r.launching = True
        r.per_tick_lent = lent_rate
    t = [100.0]
    ticks(d, regions, int(C.ARRIVAL_HOLD_S / 0.05) - 2, t)
    sample_util(profiler, t[0], 55.0)
    ticks(d, regions, 1, t)
    assert not any(lent_flags(regions))  # still inside the arrival hold: windows
    ticks(d, regions, 4, t)
    sample_util(profiler, t[0], 55.0)
    ticks(d, regions, 1, t)
    assert all(lent_flags(regions))  # on trial
    ticks(d, regions, int(C.TRIAL_S / 0.05) + 1, t)
    assert all(lent_flags(regions)) == kept and (any(lent_flags(regions)) == kept)
    if kept:
        sample_util(profiler, t[0], 99.0)
        ticks(d, regions, 2, t)
        assert all(lent_flags(regions))
    else:
        assert d.lent == set()


def test_a_region_that_cannot_be_read_leaves_the_others_laid_out():
    d, regions, _ = node({"a": 30, "b": 70})
    regions["a"].broken = True
    ticks(d, regions, 2, [100.0])
    assert "a" not in windows(regions) and windows(regions)["b"][1] == int(0.7 * d.period_ns)
