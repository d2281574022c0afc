"""The control law of one GPU, free of I/O so it can be tested on its own.

Units: shares are percent of one GPU; a grant rate is tokens (GPU ns, as the shim charges them) per wall second.

Why a factor and not a plain cap: the shim charges each launch its *estimated* GPU time, sampled with event pairs.
Under contention an estimate also holds time the kernel spent queued or time-sliced behind other processes, so a
container is charged more tokens per GPU ns it really got (measured: 1.2x to 1.9x on the simulated timeline with
two or three tenants; the issue's H200 figures show the same bias). The dispatcher learns, per container, its
charge factor

    k = tokens taken / GPU ns the profiler saw it use            (over one profiler window)

and grants `rate = target share x 1e9 / 100 x k`. With the container held by its tokens (taken = rate), the
update `ln k += g (ln k_obs - ln k)` is exactly integral action on the log of the share error
(`k_obs / k = target / measured`), with a gain free of GPU size (a ratio, not SM counts). Anti-windup: k is
clamped to [K_MIN, max_factor], and a container that is *not* held by its tokens (it takes fewer than granted)
yields k_obs = taken / used, a plant figure rather than an error, so a demand-limited container never winds up.
A stale measurement only repeats the same estimate: no overshoot from the profiler's delay.

Fast ramp: a new container starts at its cap (k = 1, or the factor its region's rate implies after an agent
restart); after any change in who is active on the GPU the next two windows use `fast_gain`.

A GPU shared by several contexts loses time to switching between them (the H200 time-slices contexts: three tenants
together do ~13 % less kernel work than one alone). When the caps of the active containers add up to more than the
GPU then delivers, the container with the most tokens finds the GPU, not its tokens, holding it back (it waits, yet
takes less than it is granted) and alone bears the whole loss. So each GPU keeps an estimate of its capacity while
shared: when some active container has been held by the GPU for a while, the capacity is what they all took
together (in real GPU time: taken / factor); while none is, the estimate creeps up (CAPACITY_PROBE), so a GPU that
delivers more is found again. Strict targets are scaled to fit the capacity less CAP_MARGIN points: every strict
container loses the same fraction of its cap, and the split stays that of the caps. Elastic containers are not
scaled: sharing what the others leave is their policy. This applies where factors are not learnt (below): where
they are, each share is already steered to its measured cap and a capacity from learnt factors is no better.

Charge factors are learnt only from a GPU whose per-process utilization is a share per process. Where the driver
instead gives each sampling period to one process (GpuSample.process_util_sampled), a short window says nothing
about shares; there the factor stays 1, and the shim's own charges hold: the dispatcher tells each container's shim
how many others run on its GPU (region agent.sharers), and the shim then charges kernels their floor (their
uncontended time) instead of a mean that holds the other contexts' time slices. Where factors are learnt, sharers
stays 0: the learnt factor already corrects the inflated charges, and the two corrections would fight.

Work conservation among elastic containers: when every active container on a GPU is elastic, no strict cap needs
protecting, yet their tokens may still hold them while the GPU idles (a charge the factor does not correct, e.g.
where factors are not learnt: the shim's estimate of a tiny kernel on an idle GPU also holds its launch latency, so
a launch-bound job is charged up to twice the GPU time it gets). Then, at each profiler window whose device
utilization (NVML's device figure, which is exact) is under BOOST_IDLE while one of them is held by its tokens, all
their grants are multiplied by a GPU-wide boost that grows by BOOST_UP; a window at or over BOOST_BUSY cuts it by
BOOST_DOWN (the GPU is full: the caps' split rules again). A boosted grant hides a container's own hunger, so the
boost is 1 again on the tick who is active changes (a newcomer gets its cap at once) or a strict container is
active; a container already active that starts to want its full cap gets it back as the busy GPU cuts the boost
(a halving per window).

Elastic policy: a container that wants more than its cap (it waits for tokens, or uses a loan) borrows what the
other active containers leave: all of the GPU when it is alone (`LEND_ALL`), else the spare left by the others'
measured use (a container without a measurement since it became active is reserved its full cap) split in
proportion to the caps of the borrowers. A container that becomes active takes its cap back on the next tick:
every target is recomputed at once, without waiting for the profiler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

STRICT = "strict"
ELASTIC = "elastic"
POLICIES = (STRICT, ELASTIC)

NS_PER_PERCENT = 10_000_000  # token rate of 1 % of one GPU (= region_layout.NS_PER_PERCENT)
K_MIN = 0.5  # a container is never granted less than half its cap's worth of tokens
LEND_ALL = 125.0  # target (%) of a lone borrower: more than the GPU can run, so it is never the token that binds
SPARE_MARGIN = 5.0  # points of the GPU kept out of loans when others are active
HUNGRY_WAIT = 0.02  # a container waiting for tokens this fraction of a tick wants more than it has
MIN_SHARE = 0.5  # below this measured share (%) a window says nothing about the charge factor
FAST_WINDOWS = 2
SETTLE_S = 0.1  # after a change in who is active, the GPU's queues settle this long before a window counts
SETTLE_NEW_S = 0.5  # ... and a container that became active alone this long (NVML's ~200 ms periods lag its start;
# beside others, fast learning matters more and a GPU with NVML's lag learns nothing there anyway)
TRIM_GAIN, TRIM_MIN, TRIM_MAX = 0.1, 0.8, 1.25
# The factor moves by at most x1.2 up and /1.5 down per window: a grant that grows too fast overshoots a strict
# ceiling while the shim's own estimates still settle after a change (they are re-sampled over ~1 s); one that
# falls fast only gives time back.
MAX_UP, MAX_DOWN = math.log(1.2), math.log(1.5)
# Sharing: a container that waits most of a tick (SAT_WAIT) yet takes under SAT_TAKE of its grant is held by the GPU.
SAT_WAIT, SAT_TAKE = 0.5, 0.95
CAP_MARGIN = 2.0  # points of the measured capacity left free, so the tokens (not the GPU) hold every container
SCALE_MIN = 0.5
CAPACITY_GAIN = 0.3  # per tick, towards a capacity measured lower than the estimate
CAPACITY_PROBE = 1.0  # points per second the estimate rises while no container is held by the GPU
TAKEN_AVG_S = 0.5  # taken rates for the capacity are averaged over this long
BOOST_IDLE, BOOST_BUSY = 90.0, 97.0  # device utilization (%) under which elastic borrowers are boosted / over which
BOOST_UP, BOOST_DOWN = 1.25, 0.5  # the boost is cut back, per profiler window
HELD_TAKE = 0.9  # taking this fraction of its grant or more, a container is held by its tokens
STEADY_S = 1.0  # the capacity is measured only when every active container has been active this long


@dataclass(frozen=True)
class Gains:
    gain: float = 0.5
    fast_gain: float = 0.9
    max_factor: float = 8.0
    idle_s: float = 0.15
    avg_s: float = 1.0  # the factor is estimated over the profiler windows of this many seconds


@dataclass
class Container:
    """The dispatcher's state of one capped container."""

    key: str
    cap: float  # percent 1..99
    policy: str = STRICT
    k: float = 1.0  # charge factor: tokens per GPU ns it really got
    rate: int = 0  # grant rate last written (0: none yet)
    target: float = 0.0
    # region counters (sums over live slots) and what grew in the last tick
    taken: int = 0
    wait: int = 0
    launches: int = 0
    taken_rate: float = 0.0  # tokens per second in the last tick
    wait_frac: float = 0.0
    last_active: float = -1e18  # monotonic s of the last launch or wait
    last_hungry: float = -1e18
    active_since: float | None = None
    measured: float | None = None  # share (%) in the last profiler window
    measured_at: float = -1e18  # monotonic s that window ended
    fast_left: int = FAST_WINDOWS
    skip_until: float = -1e18  # profiler windows starting before this are transients: not learnt from
    trim: float = 1.0  # slow integral of the remaining share error, while its tokens are what holds it back
    seen: bool = False  # counters read at least once
    sharers: int = -1  # other active containers on its GPU, as last written to its region (-1: not yet)
    history: list[tuple[float, int]] = field(default_factory=list)  # (t, taken) of recent ticks
    windows: list[tuple[float, float, float]] = field(default_factory=list)  # recent profiler (t0, t1, share)

    @property
    def cap_rate(self) -> float:
        return self.cap * NS_PER_PERCENT

    def active(self, now: float, idle_s: float) -> bool:
        return now - self.last_active <= idle_s

    def taken_at(self, t: float) -> int | None:
        """Tokens taken by time t, interpolated from recent ticks (None: no history around t)."""
        h = self.history
        if not h or t < h[0][0]:
            return None
        for (t0, v0), (t1, v1) in zip(h, h[1:]):
            if t0 <= t <= t1:
                return v0 if t1 == t0 else int(v0 + (v1 - v0) * (t - t0) / (t1 - t0))
        return h[-1][1]


def observe_counters(c: Container, now: float, dt: float, taken: int, wait: int, launches: int,
                     max_factor: float) -> None:
    """New sums of the container's region counters (untrusted: a fall or an absurd rise counts as nothing)."""
    if not c.seen:
        c.taken, c.wait, c.launches, c.seen = taken, wait, launches, True
        c.history = [(now, taken)]
        return
    bound = int(max(dt, 1e-3) * 1e9 * 64 * max(max_factor, 1.0))  # 64 slots' worth of GPU time at most
    d_taken = min(max(0, taken - c.taken), bound)
    d_wait = min(max(0, wait - c.wait), bound)
    d_launch = max(0, launches - c.launches)
    c.taken, c.wait, c.launches = taken, wait, launches
    c.taken_rate = d_taken / dt if dt > 0 else 0.0
    c.wait_frac = d_wait / (dt * 1e9) if dt > 0 else 0.0
    if d_launch or d_wait or d_taken:
        c.last_active = now
    if c.wait_frac > HUNGRY_WAIT:
        c.last_hungry = now
    last = c.history[-1][1] if c.history else 0
    c.history.append((now, last + d_taken))  # a cumulative series of the clamped growth
    while len(c.history) > 2 and c.history[1][0] < now - 5.0:
        c.history.pop(0)


def observe_share(c: Container, t0: float, t1: float, share: float, g: Gains) -> None:
    """The profiler saw the container use `share` % of the GPU over [t0, t1] (monotonic s). The factor is
    estimated over the windows of the last `g.avg_s` (one window is noisy: a few 10 ms buckets of queue dynamics)."""
    c.measured, c.measured_at = share, t1
    if t1 - t0 <= 0:
        return
    if t0 < c.skip_until:
        return
    c.windows.append((t0, t1, share))
    c.windows = [w for w in c.windows if w[1] > t1 - g.avg_s]
    if not c.windows:
        return
    a, b = c.taken_at(c.windows[0][0]), c.taken_at(t1)
    used_ns = sum(s / 100.0 * (w1 - w0) * 1e9 for w0, w1, s in c.windows)
    span = t1 - c.windows[0][0]
    if a is None or b is None or used_ns < MIN_SHARE / 100.0 * span * 1e9 or b - a <= 0:
        return
    k_obs = min(max((b - a) / used_ns, K_MIN), g.max_factor)
    gain = g.fast_gain if c.fast_left > 0 else g.gain
    c.fast_left = max(0, c.fast_left - 1)
    step = min(max(gain * (math.log(k_obs) - math.log(c.k)), -MAX_DOWN), MAX_UP)
    c.k = min(max(math.exp(math.log(c.k) + step), K_MIN), g.max_factor)
    # What the factor leaves (the windows' taken/used alignment, a GPU near saturation): a slow integral on the
    # share error itself, integrated only while the container waits for tokens (they are what holds it back)
    # and only on strict targets; bounded, so it can never wind up.
    mean = used_ns / (span * 1e9) * 100.0
    if c.fast_left == 0 and span >= 0.9 * g.avg_s and c.target <= c.cap and t1 - c.last_hungry <= g.idle_s \
            and mean > MIN_SHARE:
        c.trim = min(max(c.trim * (c.cap / mean) ** TRIM_GAIN, TRIM_MIN), TRIM_MAX)


@dataclass
class Gpu:
    """The dispatcher's state of one GPU."""

    scale: float = 1.0  # on strict targets while several containers share it
    capacity: float = 100.0 + CAP_MARGIN  # percent of the GPU its sharers get together, estimated (+ the margin:
    # a GPU that never showed a loss scales nothing)
    learn: bool = True  # charge factors may be learnt from its per-process utilization
    boost: float = 1.0  # on elastic grants while every active container is elastic
    active: frozenset[str] = frozenset()  # the containers active on it at the last tick
    changed_at: float = -1e18  # monotonic s of the tick that set changed
    device_util: float | None = None  # the profiler's newest device utilization (%), not yet acted on


def note_active(gpu: Gpu, containers: list[Container], now: float, g: Gains) -> frozenset[str]:
    """Who is active on the GPU this tick. When that changed, every factor moves: each container learns afresh and
    fast, after the queues settle (a newcomer that is alone waits out NVML's lag at its start), and the boost ends
    (a newcomer may want its cap back, and a boosted grant would hide that)."""
    active = frozenset(c.key for c in containers if c.active(now, g.idle_s))
    if active == gpu.active:
        return active
    for c in containers:
        c.fast_left = FAST_WINDOWS
        c.windows = []
        c.skip_until = now + SETTLE_S
        if c.key in active and c.key not in gpu.active:
            c.active_since = now
            if len(active) == 1:
                c.skip_until = now + SETTLE_NEW_S
    gpu.active, gpu.changed_at, gpu.boost, gpu.device_util = active, now, 1.0, None
    return active


def taken_avg(c: Container, now: float) -> float:
    """Tokens per second over the last TAKEN_AVG_S (the last tick's rate while the history is shorter)."""
    a, b = c.taken_at(now - TAKEN_AVG_S), c.taken_at(now)  # None: no history that far back
    return (b - a) / TAKEN_AVG_S if a is not None and b is not None else c.taken_rate


def gpu_bound(c: Container, now: float) -> bool:
    """It waits most of the time yet takes clearly less than its grant: the GPU, not its tokens, holds it back."""
    return c.rate > 0 and c.wait_frac > SAT_WAIT and taken_avg(c, now) < SAT_TAKE * c.rate


def update_scale(gpu: Gpu, containers: list[Container], now: float, dt: float, g: Gains) -> None:
    """Fit the active containers' caps into what the shared GPU delivers (see the module's docstring)."""
    active = [c for c in containers if c.active(now, g.idle_s)]
    strict = [c for c in active if c.policy == STRICT]
    if len(active) < 2 or not strict or gpu.learn:  # learnt factors already steer each share to its cap
        gpu.scale = 1.0
        return
    steady = all(c.active_since is not None and now - c.active_since >= STEADY_S for c in active)
    if steady and any(gpu_bound(c, now) for c in active):
        measured = sum(taken_avg(c, now) / (c.k * c.trim) for c in active) / NS_PER_PERCENT
        if measured < gpu.capacity:
            gpu.capacity += CAPACITY_GAIN * (measured - gpu.capacity)
    else:
        gpu.capacity = min(100.0 + CAP_MARGIN, gpu.capacity + CAPACITY_PROBE * dt)
    others = sum(min(c.target, c.cap) for c in active if c.policy != STRICT)  # their caps: loans give way anyway
    want = (gpu.capacity - CAP_MARGIN - others) / sum(c.cap for c in strict)
    gpu.scale = min(max(want, SCALE_MIN), 1.0)


def held(c: Container, now: float, idle_s: float) -> bool:
    """Its tokens hold it back: it waited for them lately, or it takes (nearly) all it is granted."""
    return now - c.last_hungry <= idle_s or (c.rate > 0 and taken_avg(c, now) >= HELD_TAKE * c.rate)


def update_boost(gpu: Gpu, containers: list[Container], now: float, g: Gains) -> None:
    """Lend an idle GPU to elastic containers whose tokens hold them (see the module's docstring); a change in who
    is active has already ended the boost (note_active)."""
    active = [c for c in containers if c.key in gpu.active]
    if not active or any(c.policy != ELASTIC for c in active):  # a strict container must have its cap
        gpu.boost, gpu.device_util = 1.0, None
        return
    util, gpu.device_util = gpu.device_util, None
    if util is None or gpu.changed_at == now:  # a window read on the tick of a change began before it
        return
    if util >= BOOST_BUSY:
        gpu.boost = max(gpu.boost * BOOST_DOWN, 1.0)
    elif util < BOOST_IDLE and any(held(c, now, g.idle_s) for c in active):
        gpu.boost = min(gpu.boost * BOOST_UP, g.max_factor)


def wants_more(c: Container, now: float, idle_s: float) -> bool:
    """Waiting for tokens recently, or using more than its cap (a loan it still uses)."""
    return now - c.last_hungry <= idle_s or c.taken_rate > 1.05 * c.cap_rate * c.k


def targets(containers: list[Container], now: float, g: Gains) -> None:
    """Each container's target share (%) for this tick."""
    active = [c for c in containers if c.active(now, g.idle_s)]
    for c in containers:
        c.target = c.cap
    borrowers = [c for c in active if c.policy == ELASTIC and wants_more(c, now, g.idle_s)]
    if not borrowers:
        return
    others = [c for c in active if c not in borrowers]
    if not others:
        if len(borrowers) == 1:
            borrowers[0].target = LEND_ALL
            return
        spare = 100.0 - sum(c.cap for c in borrowers)
    else:
        used = 0.0
        for c in others:
            known = c.measured is not None and c.active_since is not None and c.measured_at > c.active_since
            wanting = now - c.last_hungry <= g.idle_s
            used += c.cap if (wanting or not known) else max(c.measured or 0.0, 0.0)
        spare = 100.0 - SPARE_MARGIN - used - sum(c.cap for c in borrowers)
    if spare <= 0:
        return
    weight = sum(c.cap for c in borrowers)
    for c in borrowers:
        c.target = c.cap + spare * c.cap / weight


def rate_for(c: Container, g: Gains, scale: float = 1.0, boost: float = 1.0) -> int:
    lo = c.cap_rate * K_MIN
    hi = LEND_ALL * NS_PER_PERCENT * g.max_factor
    trim = c.trim if c.target <= c.cap else 1.0  # not on a loan
    scaled = scale if c.policy == STRICT else boost
    return int(min(max(c.target * scaled * NS_PER_PERCENT * c.k * trim, lo), hi))
