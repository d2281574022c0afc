"""The dispatcher's control law on its own (no processes): factor estimation, anti-windup, elastic targets, and
counters a container could forge."""

from __future__ import annotations

import pytest

from alnair_agent.dispatcher import control as C
from alnair_agent.dispatcher.service import parse_policy

G = C.Gains()


def fed(c: C.Container, t: float, taken: int) -> None:
    C.observe_counters(c, t, 0.05, taken, 0, int(t * 1000), G.max_factor)


def test_factor_converges_to_taken_over_used_and_is_bounded():
    c = C.Container("a", 30)
    taken = 0
    for i in range(200):  # charged 2 tokens per GPU ns it really got: 60 % worth of tokens buys 30 %
        t = i * 0.05
        taken += int(0.6e9 * 0.05)
        fed(c, t, taken)
        if i and i % 5 == 0:
            C.observe_share(c, t - 0.25, t, 30.0, G)
    assert c.k == pytest.approx(2.0, rel=0.05)
    C.targets([c], 10.0, G)
    assert C.rate_for(c, G) == pytest.approx(0.6e9, rel=0.05)
    for i in range(200, 400):  # absurd: tokens taken with nothing on the GPU -> no update below MIN_SHARE
        t = i * 0.05
        taken += int(9e9 * 0.05)
        fed(c, t, taken)
        if i % 5 == 0:
            C.observe_share(c, t - 0.25, t, 1.0, G)
    assert c.k <= G.max_factor  # anti-windup bound


def test_forged_counters_count_as_nothing():
    c = C.Container("a", 30)
    C.observe_counters(c, 0.0, 0.05, 10**15, 0, 0, G.max_factor)
    C.observe_counters(c, 0.05, 0.05, 5, 0, 0, G.max_factor)  # fell
    assert c.taken_rate == 0
    C.observe_counters(c, 0.1, 0.05, 2**63, 2**63, 0, G.max_factor)  # leapt
    assert c.taken_rate <= 64 * G.max_factor * 1e9
    assert C.K_MIN * c.cap_rate <= C.rate_for(c, G) <= C.LEND_ALL * C.NS_PER_PERCENT * G.max_factor


def test_elastic_targets():
    lender = C.Container("l", 30, C.ELASTIC)
    lender.last_active = lender.last_hungry = 1.0
    C.targets([lender], 1.0, G)
    assert lender.target == C.LEND_ALL  # alone and wanting: the whole GPU
    other = C.Container("o", 70, C.STRICT)
    other.last_active, other.active_since = 1.0, 1.0  # just started, nothing measured yet: its cap is reserved
    C.targets([lender, other], 1.0, G)
    assert lender.target == 30 and other.target == 70
    strict = C.Container("s", 30, C.STRICT)
    strict.last_active = strict.last_hungry = 1.0
    C.targets([strict], 1.0, G)
    assert strict.target == 30  # strict: a ceiling
    small = C.Container("x", 20, C.STRICT)  # active, measured using 10 %, not waiting: the rest can be lent
    small.last_active, small.active_since, small.measured, small.measured_at = 1.0, 0.0, 10.0, 0.5
    C.targets([lender, small], 1.0, G)
    assert lender.target == pytest.approx(100 - C.SPARE_MARGIN - 10)


@pytest.mark.parametrize(("raw", "want"), [("", ("strict", True)), ("elastic", ("elastic", True)),
                                           (" Strict ", ("strict", True)), ("greedy", ("strict", False))])
def test_parse_policy(raw, want):
    assert parse_policy(raw, "strict") == want


def _sharing(caps_rates_taken: list[tuple[float, float, float]], seconds: float, gpu: C.Gpu) -> list[C.Container]:
    """Containers (cap, grant in % of the GPU, taken in %) that all wait most of each tick, fed for `seconds`."""
    cs = [C.Container(str(i), cap) for i, (cap, _, _) in enumerate(caps_rates_taken)]
    for c, (_, rate, _) in zip(cs, caps_rates_taken):
        c.rate = int(rate * C.NS_PER_PERCENT)
        c.active_since = 0.0
    t, taken = 0.0, [0] * len(cs)
    while t < seconds:
        t += 0.05
        for i, (c, (_, _, took)) in enumerate(zip(cs, caps_rates_taken)):
            taken[i] += int(took * C.NS_PER_PERCENT * 0.05)
            C.observe_counters(c, t, 0.05, taken[i], int(0.9 * 0.05e9) * int(t / 0.05), int(t * 1000), G.max_factor)
        C.targets(cs, t, G)
        C.update_scale(gpu, cs, t, 0.05, G)
    return cs


def test_scale_fits_the_caps_into_what_a_shared_gpu_delivers():
    # 30 and 70 granted; the 70 is held by the GPU at 57 (time-slicing lost 13 points): capacity 87
    gpu = C.Gpu(learn=False)
    cs = _sharing([(30, 30, 30), (70, 70, 57)], 3.0, gpu)
    assert gpu.scale == pytest.approx((87 - C.CAP_MARGIN) / 100, abs=0.01)
    rates = [C.rate_for(c, G, gpu.scale) for c in cs]
    assert rates[0] / rates[1] == pytest.approx(3 / 7)  # the split stays that of the caps


@pytest.mark.parametrize("load, want", [
    ([(30, 30, 30), (70, 70, 70)], 1.0),      # both take their grants: the tokens hold them, nothing to fit
    ([(30, 30, 30)], 1.0),                    # alone: never scaled
    ([(30, 30, 10), (50, 50, 20)], 0.5),      # absurdly little delivered: the scale stops at SCALE_MIN
])
def test_scale_table(load, want):
    gpu = C.Gpu(capacity=95.0 if want == 1.0 else 100.0, learn=False)  # a low estimate is probed back up
    _sharing(load, 10.0, gpu)
    assert gpu.scale == pytest.approx(want, abs=0.02)


def test_no_capacity_is_measured_while_a_sharer_is_starting():
    gpu = C.Gpu(learn=False)
    cs = _sharing([(30, 30, 30), (70, 70, 40)], 0.5, gpu)  # the 70 still starting (under STEADY_S): not a measure
    assert gpu.capacity == 100.0 + C.CAP_MARGIN and gpu.scale == 1.0
    assert all(c.active_since == 0.0 for c in cs)


def test_no_scale_where_factors_are_learnt():
    gpu = C.Gpu()  # learn=True: each share is steered by its own factor
    _sharing([(30, 30, 30), (70, 70, 57)], 3.0, gpu)
    assert gpu.scale == 1.0


def _borrowers(n: int, policy: str = C.ELASTIC, hungry: bool = True) -> list[C.Container]:
    cs = [C.Container(str(i) + policy, 50, policy) for i in range(n)]
    for c in cs:
        c.last_active = 1.0
        c.last_hungry = 1.0 if hungry else -1e18
    return cs


def _tick(gpu: C.Gpu, cs: list[C.Container], now: float) -> None:
    """What the service does for the boost each tick: who is active, then the boost."""
    C.note_active(gpu, cs, now, G)
    C.update_boost(gpu, cs, now, G)


def _boosted(gpu: C.Gpu, cs: list[C.Container], utils: list[float | None], t: float = 1.0) -> float:
    """Each util is one profiler window's device figure, acted on at the next tick, 1 ms apart from `t` (the first
    tick only learns who is active, as the service's first tick does)."""
    _tick(gpu, cs, t)
    for i, u in enumerate(utils):
        gpu.device_util = u
        _tick(gpu, cs, t + 0.001 * (i + 1))
    return gpu.boost


@pytest.mark.parametrize("utils, want", [
    ([50.0] * 4, C.BOOST_UP ** 4),                  # elastic borrowers held by tokens, GPU idle: lend it
    ([50.0] * 40, G.max_factor),                    # bounded
    ([50.0] * 4 + [99.0], C.BOOST_UP ** 4 * C.BOOST_DOWN),  # the GPU is full: cut back
    ([50.0] * 4 + [99.0] * 4, 1.0),                 # ... never below 1
    ([93.0] * 4, 1.0),                              # between the thresholds: unchanged
    ([50.0] * 2 + [93.0] * 4, C.BOOST_UP ** 2),     # ... whatever it was
    ([None] * 4, 1.0),                              # no device figure: unchanged
])
def test_boost_table(utils, want):
    gpu, cs = C.Gpu(), _borrowers(2)
    C.targets(cs, 1.0, G)  # two borrowers of 50: nothing spare by caps, each at its cap
    assert _boosted(gpu, cs, utils) == pytest.approx(want)
    assert C.rate_for(cs[0], G, 1.0, gpu.boost) == pytest.approx(50 * C.NS_PER_PERCENT * gpu.boost, rel=1e-6)


def test_boost_grows_only_while_a_container_is_held_by_its_tokens():
    gpu, cs = C.Gpu(), _borrowers(2, hungry=False)
    for c in cs:  # each takes a tenth of its grant: the GPU's idle time is theirs to leave
        c.rate, c.history = 50 * C.NS_PER_PERCENT, [(0.0, 0), (1.0, 5 * C.NS_PER_PERCENT)]
    assert _boosted(gpu, cs, [50.0] * 4) == 1.0
    cs[0].history = [(0.0, 0), (1.0, 50 * C.NS_PER_PERCENT)]  # one takes all of its grant, without waiting
    assert _boosted(gpu, cs, [50.0] * 4, 1.01) == pytest.approx(C.BOOST_UP ** 4)
    gpu.active, cs[0].history = frozenset(), [(0.0, 0), (1.0, 5 * C.NS_PER_PERCENT)]
    assert _boosted(gpu, cs, [50.0] * 2, 1.02) == 1.0


@pytest.mark.parametrize("change", ["newcomer", "strict sharer", "one leaves"])
def test_boost_ends_on_the_tick_who_is_active_changes(change):
    gpu, cs = C.Gpu(), _borrowers(2)
    assert _boosted(gpu, cs, [50.0] * 6) > 3.0
    if change == "newcomer":  # it may want its cap back, and its hunger would not show under a boosted grant
        cs += _borrowers(1, hungry=False)[:1]
        cs[-1].key = "new"
    elif change == "strict sharer":
        cs += _borrowers(1, C.STRICT)
    else:
        cs[1].last_active = -1e18
    _tick(gpu, cs, 1.01)
    assert gpu.boost == 1.0
    gpu.device_util = 50.0
    _tick(gpu, cs, 1.011)
    assert gpu.boost == (1.0 if change == "strict sharer" else C.BOOST_UP)
