"""The turns of one GPU (alnair_agent/dispatcher/control.py), without I/O: the layout of the windows, what the
containers' counters say, and when elastic containers are lent the GPU."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from alnair_agent.dispatcher import control as C
from alnair_agent.dispatcher.service import parse_policy

P = 50_000_000


def c(key: str, cap: float, policy: str = C.STRICT) -> C.Container:
    return C.Container(key, cap, policy)


@given(st.lists(st.tuples(st.integers(1, 99), st.sampled_from(C.POLICIES)), min_size=1, max_size=12),
       st.integers(5_000_000, 1_000_000_000))
def test_windows_never_overlap_and_stay_inside_the_period(caps, period):
    containers = [c(f"a{i:02}", cap, pol) for i, (cap, pol) in enumerate(caps)]
    w = C.layout(containers, period)
    spans = sorted((off, off + length) for off, length in w.values() if length)
    for (_a0, a1), (b0, _b1) in zip(spans, spans[1:], strict=False):
        assert a1 <= b0, spans
    assert all(0 <= off < period and off + length <= period for off, length in w.values())
    total = sum(cap for cap, _ in caps)
    if total <= 100:  # what can be admitted on one GPU: every cap gets its part, at least (latency: no window)
        for x in containers:
            assert w[x.key][1] >= (0 if x.policy == C.LATENCY else int(period * x.cap / 100) - 1)
    for x in containers:
        if x.policy == C.LATENCY:
            assert w[x.key] == (0, 0)


@given(st.lists(st.tuples(st.integers(1, 40), st.sampled_from((C.STRICT, C.ELASTIC))), min_size=1, max_size=5),
       st.lists(st.integers(1, 30), min_size=1, max_size=3), st.integers(5_000_000, 1_000_000_000))
def test_each_window_is_followed_by_its_part_of_the_latency_caps(caps, latency, period):
    """A neighbour held back for a latency container may run on after its window: the latency caps' time follows
    each window, in proportion to its cap, as spare nobody else's window takes."""
    if sum(x for x, _ in caps) + sum(latency) > 100:
        return
    containers = [c(f"a{i:02}", cap, pol) for i, (cap, pol) in enumerate(caps)]
    containers += [c(f"z{i:02}", cap, C.LATENCY) for i, cap in enumerate(latency)]
    w = C.layout(containers, period)
    sp = C.spares(w, period)
    turned = sum(x for x, _ in caps)
    for x in containers[:len(caps)]:
        assert sp[x.key] >= int(period * sum(latency) * x.cap / turned / 100) - 1, (x, w, sp)


@pytest.mark.parametrize("containers,want", [
    ([c("a", 30)], (0, 0)),
    ([c("a", 30), c("z", 20, C.LATENCY)], (0, 0)),  # no board slot yet: nobody to hold back for
])
def test_holds_name_only_latency_containers_with_a_slot(containers, want):
    assert C.holds(containers) == want


def test_holds_mask_and_percent():
    z1, z2 = c("z1", 20, C.LATENCY), c("z2", 10, C.LATENCY)
    z1.board_slot, z2.board_slot = 0, 3
    assert C.holds([c("a", 50), z1, z2]) == (0b1001, 60)
    z1.cap = 60
    assert C.holds([z1, z2]) == (0b1001, C.HOLD_MAX_PCT)


@pytest.mark.parametrize("containers,want", [
    ([c("a", 30)], {"a": 30}),                                    # strict: a ceiling, alone or not
    ([c("a", 30, C.ELASTIC)], {"a": 100}),                        # a lone elastic one: the whole period
    ([c("a", 30), c("b", 70)], {"a": 30, "b": 70}),
    ([c("a", 20), c("b", 30), c("c", 50)], {"a": 20, "b": 30, "c": 50}),
    ([c("a", 30), c("b", 50, C.ELASTIC)], {"a": 30, "b": 70}),    # the spare goes to the elastic one
    ([c("a", 10, C.ELASTIC), c("b", 30, C.ELASTIC)], {"a": 25, "b": 75}),  # ... in proportion to the caps
    ([c("a", 30), c("b", 30)], {"a": 30, "b": 30}),               # strict ones leave the spare idle
    ([c("a", 70), c("z", 30, C.LATENCY)], {"a": 70, "z": 0}),     # a latency container takes no turns
    ([c("a", 50, C.ELASTIC), c("z", 30, C.LATENCY)], {"a": 70, "z": 0}),  # its cap is not the elastic one's
])
def test_layout_table(containers, want):
    w = C.layout(containers, P)
    assert {k: round(100 * length / P) for k, (_, length) in w.items()} == want


@given(st.lists(st.tuples(st.integers(1, 99), st.sampled_from(C.POLICIES)), min_size=1, max_size=12),
       st.integers(5_000_000, 1_000_000_000))
def test_spare_time_after_a_window_never_reaches_another_window(caps, period):
    """Work may run a window's spare past its end: that time must be nobody's window, in this period or the next."""
    containers = [c(f"a{i:02}", cap, pol) for i, (cap, pol) in enumerate(caps)]
    w = C.layout(containers, period)
    sp = C.spares(w, period)
    spans = [(off + k * period, off + length + k * period) for off, length in w.values() if length for k in (0, 1)]
    for key, (off, length) in w.items():
        end = off + length
        assert 0 <= sp[key] <= period - length
        assert not any(s0 < end + sp[key] and s1 > end for s0, s1 in spans if (s0, s1) != (off, end)), (key, w, sp)
    if sum(cap for cap, _ in caps) < 100 and all(pol == C.STRICT for _, pol in caps):
        assert max(sp.values()) > 0  # the unreserved time is someone's spare


@pytest.mark.parametrize("containers,want", [
    ([c("a", 30)], {"a": 70}),                                    # alone: the rest of the period is nobody's
    ([c("a", 30), c("b", 70)], {"a": 0, "b": 0}),
    ([c("a", 20), c("b", 30)], {"a": 0, "b": 50}),                # only the last window is followed by it
    ([c("a", 30), c("b", 50, C.ELASTIC)], {"a": 0, "b": 0}),      # the elastic one has it: nothing spare
    ([c("a", 30, C.ELASTIC)], {"a": 0}),
])
def test_spare_table(containers, want):
    w = C.layout(containers, P)
    assert {k: round(100 * v / P) for k, v in C.spares(w, P).items()} == want


def test_the_layout_is_stable_whatever_the_order():
    a, b, d = c("a", 20), c("b", 30), c("d", 50)
    assert C.layout([d, a, b], P) == C.layout([a, b, d], P)


def test_forged_counters_count_only_as_activity():
    x = c("a", 30)
    C.observe_counters(x, 0.0, 0.05, 10, 0, 0)
    C.observe_counters(x, 0.05, 0.05, 5, 0, 0)  # fell: a reused slot, or a lie
    assert x.last_active < 0 and x.launches == 5
    C.observe_counters(x, 0.1, 0.05, 2**63, 2**63, 2**63)  # leapt
    assert x.last_active == 0.1 and x.gpu_rate <= 64e9 and x.wait_frac <= 64


def gpu_with(active: set[str], util: float | None = None, now: float = 10.0) -> C.GpuTurns:
    g = C.GpuTurns(epoch_ns=0)
    C.note_active(g, frozenset(active), now - C.ARRIVAL_HOLD_S - 1.0)
    if util is not None:
        C.note_device_util(g, util, now - 0.5)
    return g


def ran(cs: list[C.Container], rates: dict[str, float], t0: float, t1: float, dt: float = 0.05) -> float:
    """The containers' counters, ticked from t0 to t1 with these launch rates (per s); returns t1."""
    t = t0
    while t < t1 - 1e-9:
        t = round(t + dt, 6)
        for x in cs:
            C.observe_counters(x, t, dt, x.launches + round(rates.get(x.key, 0) * dt), 0, 0)
    return t


def elastic_pair() -> list[C.Container]:
    cs = [c("a", 50, C.ELASTIC), c("b", 50, C.ELASTIC)]
    for x in cs:
        C.observe_counters(x, 0.0, 0.05, 0, 0, 0)
    return cs


@pytest.mark.parametrize("containers,active,util,uncapped,want", [
    ([c("a", 30, C.ELASTIC), c("b", 70)], {"a"}, None, False, {"a"}),            # alone: lent the GPU
    ([c("a", 30, C.ELASTIC), c("b", 70)], {"a", "b"}, 10.0, False, set()),       # a strict one is active
    ([c("a", 30), c("b", 70)], {"a"}, None, False, set()),                       # strict: never lent
    ([c("a", 50, C.ELASTIC), c("b", 50, C.ELASTIC)], {"a", "b"}, 60.0, False, {"a", "b"}),  # GPU not full: a trial
    ([c("a", 50, C.ELASTIC), c("b", 50, C.ELASTIC)], {"a", "b"}, 99.0, False, set()),  # full: their windows
    ([c("a", 50, C.ELASTIC), c("b", 50, C.ELASTIC)], {"a", "b"}, None, False, set()),  # not known yet: windows
    ([c("a", 30, C.ELASTIC)], {"a"}, None, True, set()),                         # an uncapped one runs beside it
])
def test_lending_table(containers, active, util, uncapped, want):
    ran(containers, {x.key: 1000.0 for x in containers}, 0.0, 10.0)
    g = gpu_with(active, util)
    C.update_lending(g, containers, uncapped, 10.0)
    assert C.lent(g, containers, uncapped) == want


def test_a_change_in_who_is_active_ends_every_lease_at_once():
    cs = elastic_pair()
    t = ran(cs, {"a": 1000, "b": 1000}, 0.0, 10.0)
    g = gpu_with({"a", "b"}, 60.0, t)
    assert C.update_lending(g, cs, False, t) == "trial"
    assert C.lent(g, cs, False) == {"a", "b"}
    assert C.note_active(g, frozenset({"a"}), t + 0.05)
    C.update_lending(g, cs, False, t + 0.05)
    assert C.lent(g, cs, False) == {"a"}  # alone now
    assert C.note_active(g, frozenset({"a", "b"}), t + 0.1)
    C.update_lending(g, cs, False, t + 0.1)
    assert C.lent(g, cs, False) == set()  # the newcomer is back: its windows


def test_no_trial_until_the_newcomer_has_held_its_windows_for_the_arrival_hold():
    cs = elastic_pair()
    t = ran(cs, {"a": 1000, "b": 1000}, 0.0, 10.0)
    g = C.GpuTurns(epoch_ns=0)
    C.note_active(g, frozenset({"a", "b"}), t)
    while t < 10.0 + C.ARRIVAL_HOLD_S - 0.05:
        t = ran(cs, {"a": 1000, "b": 1000}, t, t + 0.05)
        C.note_device_util(g, 40.0, t)
        assert C.update_lending(g, cs, False, t) is None and not g.lending, t
    t = ran(cs, {"a": 1000, "b": 1000}, t, t + 0.1)
    C.note_device_util(g, 40.0, t)
    assert C.update_lending(g, cs, False, t) == "trial"


def trial(cs: list[C.Container], g: C.GpuTurns, t: float, lent_rates: dict[str, float]) -> tuple[str | None, float]:
    """Tick through one trial with these launch rates while lent; what ended it and when."""
    assert g.lending and g.trial_end is not None
    while True:
        t = ran(cs, lent_rates, t, t + 0.05)
        change = C.update_lending(g, cs, False, t)
        if change is not None:
            return change, t


@pytest.mark.parametrize("lent_rates,want,late", [
    ({"a": 1500, "b": 1400}, "kept", []),        # gap-y jobs filling each other's gaps: both faster lent together
    ({"a": 1500, "b": 900}, "slowed", ["b"]),    # one of them slower than on its windows: its cap is its guarantee
    ({"a": 600, "b": 600}, "slowed", ["a", "b"]),  # two busy jobs only slow each other
    ({"a": 960, "b": 1000}, "kept", []),         # within KEEP_FRAC
])
def test_a_trial_goes_on_only_while_it_slows_nobody(lent_rates, want, late):
    cs = elastic_pair()
    t = ran(cs, {"a": 1000, "b": 1000}, 0.0, 10.0)
    g = gpu_with({"a", "b"}, 50.0, t)
    assert C.update_lending(g, cs, False, t) == "trial"
    change, ended = trial(cs, g, t, lent_rates)
    assert change == want
    assert ended - t <= C.TRIAL_S + 0.051  # judged within a tick of TRIAL_S
    assert g.lending == (want == "kept")
    assert sorted(g.slowed) == late  # named in the dispatcher's lending_together log


def test_trials_that_slow_someone_back_off_doubling():
    cs = elastic_pair()
    t = ran(cs, {"a": 1000, "b": 1000}, 0.0, 10.0)
    g = gpu_with({"a", "b"}, None, t)
    starts = []
    while len(starts) < 5:
        t = ran(cs, {"a": 1000, "b": 1000}, t, t + 0.05)
        C.note_device_util(g, 50.0, t - C.SETTLE_S)
        if C.update_lending(g, cs, False, t) == "trial":
            starts.append(t)
            _, t = trial(cs, g, t, {"a": 500, "b": 500})
    gaps = [round(b - a, 2) for a, b in zip(starts, starts[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] >= 6 * gaps[0], gaps


def test_a_busy_gpu_does_not_end_lending_and_a_long_one_is_checked_again():
    """Two jobs lent the GPU together that slow neither drive the device to 95-100 % (they fill each other's gaps):
    that is the packing wanted, so lending goes on until the recheck."""
    cs = elastic_pair()
    t = ran(cs, {"a": 1000, "b": 1000}, 0.0, 10.0)
    g = gpu_with({"a", "b"}, 50.0, t)
    C.update_lending(g, cs, False, t)
    t0 = t  # the trial began: RECHECK_S counts from here
    change, t = trial(cs, g, t, {"a": 1500, "b": 1500})
    assert change == "kept"
    while (change := C.update_lending(g, cs, False, t)) is None:
        C.note_device_util(g, 99.0, t)
        t = ran(cs, {"a": 1500, "b": 1500}, t, t + 0.05)
    assert change == "recheck" and C.RECHECK_S <= t - t0 + 1e-6 <= C.RECHECK_S + 0.06 and not g.lending
    hold_before = g.hold_s
    t = ran(cs, {"a": 1000, "b": 1000}, t, t + 1.0)
    C.note_device_util(g, 50.0, t)
    assert C.update_lending(g, cs, False, t) == "trial" and g.hold_s == hold_before  # a recheck holds nothing off


def test_a_sample_taken_right_after_a_change_is_not_used():
    g = gpu_with({"a"})
    C.note_active(g, frozenset({"a", "b"}), 20.0)
    C.note_device_util(g, 10.0, 20.1)  # still the old mix
    assert g.device_util is None
    C.note_device_util(g, 10.0, 20.0 + C.SETTLE_S)
    assert g.device_util == 10.0


@pytest.mark.parametrize("raw,want", [
    (None, ("strict", True)), ("", ("strict", True)), ("elastic", ("elastic", True)), (" Elastic ", ("elastic", True)),
    ("greedy", ("strict", False)), ("strict\x00", ("strict", False)),
])
def test_parse_policy(raw, want):
    assert parse_policy(raw, "strict") == want
