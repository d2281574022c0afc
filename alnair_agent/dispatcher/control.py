"""The turns of one GPU, free of I/O so they can be tested on their own.

Each capped container of a GPU gets a window of its cap's part of a period common to the GPU; windows never overlap,
and the shim launches only in its container's window (shim/turns.c), so a container's GPU time is its windows' time
for every program shape. What the caps leave goes to the elastic containers in proportion to their caps (else it is
the last window's spare); idle containers keep their windows. An elastic container is lent the whole GPU while
nobody else on it is active, or, on trial, with the other active elastic ones while that slows none of them (the
constants below). A latency container has no window: it launches at once while the others of its GPU hold back
(the shim, through the GPU's board), its GPU time held to its cap over a second; its cap's part of the period
follows the other windows, each its share, so a window held back can run on into it. Why turns, and the lending
rules in full: docs/architecture.md ("Sharing compute", "The latency class")."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

STRICT = "strict"
ELASTIC = "elastic"
LATENCY = "latency"
POLICIES = (STRICT, ELASTIC, LATENCY)

LEASE_TICKS = 3  # a lease outlives this many ticks: a late tick does not end it, a stopped agent soon does
FREE_ENTER = 85.0  # device utilization (%) under which active elastic containers may be lent the GPU together
HOLD_MIN_S, HOLD_MAX_S = 1.0, 32.0  # after a lending that slowed someone: no trial this long (doubling)
HOLD_RESET_S = 60.0  # a GPU that stayed on windows this long starts again from HOLD_MIN_S
SETTLE_S = 0.3  # a utilization sample taken this soon after a change still holds the old mix (NVML's ~1/6 s period)
ARRIVAL_HOLD_S = 5.0  # after a change in who is active, windows at least this long before a trial
BASELINE_S = 0.5  # a container's launch rate on its windows over this long: its baseline for a trial
TRIAL_S = 0.25  # lent together this long, then judged against the baselines
KEEP_FRAC = 0.95  # a trial goes on only while every container launches at least this part of its baseline
RECHECK_S = 20.0  # a lending that went on this long goes back to windows for a new baseline and trial
HISTORY = 64  # (time, launches) samples kept per container: 3.2 s at the default 50 ms tick
# A latency container counts as present for its neighbours' hold (their bound on work in flight) this long after
# its last launch: a service between requests must not lose its protection, one idle for long costs them nothing.
LATENCY_IDLE_S = 2.0
HOLD_FACTOR = 2.0  # neighbours may be held back up to this many times the latency caps (a request's host gaps)
HOLD_MAX_PCT = 90  # ... and never more than this part of their time


@dataclass
class Container:
    """The dispatcher's state of one capped container."""

    key: str  # allocation id
    cap: float  # percent 1..99
    policy: str = STRICT
    launches: int = 0  # region counters (sums over live slots), as last read
    wait: int = 0
    gpu: int = 0
    gpu_rate: float = 0.0  # GPU ns per second (the shim's count) in the last tick
    wait_frac: float = 0.0
    last_active: float = -1e18  # monotonic s of the last launch or wait
    seen: bool = False
    history: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=HISTORY))  # (s, launches)
    board_slot: int | None = None  # a latency container's slot on its GPU's board (None: no slot free)
    held_ns: int = 0  # slot counters, summed, as last read: its launches held back for a latency container
    holds: int = 0
    held_s: float = 0.0  # ... their growth since the dispatcher first saw it (for /metrics)
    held_count: int = 0

    def active(self, now: float, idle_s: float) -> bool:
        return now - self.last_active <= idle_s

    def launch_rate(self, since: float) -> float | None:
        """Launches per second from the last sample at or before `since` to the newest; None when the history does
        not reach back that far."""
        start = next((h for h in reversed(self.history) if h[0] <= since), None)
        if start is None or not self.history or self.history[-1][0] <= start[0]:
            return None
        end = self.history[-1]
        return (end[1] - start[1]) / (end[0] - start[0])


def observe_counters(c: Container, now: float, dt: float, launches: int, wait: int, gpu: int) -> None:
    """New sums of the container's region counters. They are the container's to write: a fall (a slot reused, or a
    lie) counts as no activity and restarts the differences from the new value; a rise counts only as activity."""
    if not c.seen:
        c.launches, c.wait, c.gpu, c.seen = launches, wait, gpu, True
        c.history.append((now, launches))
        return
    if launches < c.launches:
        c.history.clear()  # a new count: rates start again from it
    c.history.append((now, launches))
    grew = launches > c.launches or wait > c.wait or gpu > c.gpu
    d_gpu = max(0, gpu - c.gpu)
    d_wait = max(0, wait - c.wait)
    c.launches, c.wait, c.gpu = launches, wait, gpu
    c.gpu_rate = min(d_gpu / dt, 64e9) if dt > 0 else 0.0  # 64 slots' worth of GPU time at most
    c.wait_frac = min(d_wait / (dt * 1e9), 64.0) if dt > 0 else 0.0
    if grew:
        c.last_active = now


@dataclass
class GpuTurns:
    """The dispatcher's state of one GPU."""

    epoch_ns: int  # period 0 of its turns starts here
    active: frozenset[str] = frozenset()  # containers (capped, and uncapped ones that launched) active last tick
    changed_at: float = -1e18  # monotonic s of the tick that changed `active`
    lending: bool = False  # its active elastic containers are lent the GPU together
    hold_until: float = -1e18  # no lending together before this
    hold_s: float = HOLD_MIN_S
    device_util: float | None = None  # newest NVML device utilization (%) read after the last change
    windows_since: float = -1e18  # monotonic s lending together last ended (for HOLD_RESET_S)
    trial_end: float | None = None  # lent together on trial until then (None: not on trial)
    baseline: dict[str, float] = field(default_factory=dict)  # launch rates on windows when the trial began
    trial_from: dict[str, tuple[float, int]] = field(default_factory=dict)  # (s, launches) when it began
    lent_since: float = -1e18  # monotonic s lending together began (for RECHECK_S)
    slowed: list[str] = field(default_factory=list)  # who the last trial that ended "slowed" slowed (for the log)


def note_active(gpu: GpuTurns, active: frozenset[str], now: float) -> bool:
    """Who is active on the GPU this tick; True when that changed (then every lease ends: a newcomer has its
    window at once, and a utilization read before the change says nothing about the new mix)."""
    if active == gpu.active:
        return False
    gpu.active, gpu.changed_at, gpu.device_util = active, now, None
    if gpu.lending:
        end_lending(gpu, now, hold=False)
    return True


def end_lending(gpu: GpuTurns, now: float, hold: bool) -> None:
    """Back to windows; with `hold`, no new trial for the hold time, which doubles."""
    gpu.lending, gpu.windows_since, gpu.trial_end = False, now, None
    gpu.baseline, gpu.trial_from = {}, {}
    if hold:
        gpu.hold_until = now + gpu.hold_s
        gpu.hold_s = min(gpu.hold_s * 2, HOLD_MAX_S)


def slowed(gpu: GpuTurns, active: list[Container], now: float) -> list[str]:
    """The containers whose launch rate since the trial began is under KEEP_FRAC of their baseline."""
    out = []
    for c in active:
        t0, n0 = gpu.trial_from.get(c.key, (now, c.launches))
        base = gpu.baseline.get(c.key)
        if base is None or now <= t0 or (c.launches - n0) / (now - t0) < KEEP_FRAC * base:
            out.append(c.key)
    return out


def note_device_util(gpu: GpuTurns, util: float, sampled_at: float) -> None:
    """A device utilization sample; ignored when taken within SETTLE_S of the last change."""
    if sampled_at >= gpu.changed_at + SETTLE_S:
        gpu.device_util = util


def update_lending(gpu: GpuTurns, containers: list[Container], uncapped_active: bool, now: float) -> str | None:
    """Whether the GPU's active containers, all elastic, are lent the GPU together (see the module docstring).
    Returns what changed, for the log: "trial", "kept", "slowed", "recheck" (None: nothing)."""
    active = [c for c in containers if c.key in gpu.active]
    together = len(active) >= 2 and not uncapped_active and all(c.policy == ELASTIC for c in active)
    util, gpu.device_util = gpu.device_util, None  # each sample acts once
    if not together:
        if gpu.lending:
            end_lending(gpu, now, hold=False)
        return None
    if gpu.lending:
        if gpu.trial_end is not None:
            if now < gpu.trial_end:
                return None
            late = slowed(gpu, active, now)
            if late:
                end_lending(gpu, now, hold=True)
                gpu.slowed = late
                return "slowed"
            gpu.trial_end, gpu.hold_s = None, HOLD_MIN_S
            return "kept"
        if now - gpu.lent_since >= RECHECK_S:
            end_lending(gpu, now, hold=False)
            return "recheck"
        return None
    if now - gpu.windows_since >= HOLD_RESET_S:
        gpu.hold_s = HOLD_MIN_S
    on_windows = max(gpu.changed_at, gpu.windows_since)
    if now < gpu.changed_at + ARRIVAL_HOLD_S or now < gpu.hold_until or now - on_windows < BASELINE_S:
        return None
    if util is None or util >= FREE_ENTER:
        return None
    baseline = {c.key: c.launch_rate(now - BASELINE_S) for c in active}
    if any(r is None or r <= 0 for r in baseline.values()):
        return None
    gpu.lending, gpu.lent_since, gpu.trial_end = True, now, now + TRIAL_S
    gpu.baseline = {k: float(r) for k, r in baseline.items() if r is not None}
    gpu.trial_from = {c.key: (now, c.launches) for c in active}
    return "trial"


def lent(gpu: GpuTurns, containers: list[Container], uncapped_active: bool) -> set[str]:
    """The containers lent the whole GPU this tick."""
    out = set()
    for c in containers:
        if c.policy != ELASTIC or c.key not in gpu.active:
            continue
        others = gpu.active - {c.key}
        if not others and not uncapped_active:
            out.add(c.key)
        elif gpu.lending:
            out.add(c.key)
    return out


def spares(windows: dict[str, tuple[int, int]], period_ns: int) -> dict[str, int]:
    """How long after each window no other window begins (the time the caps leave unreserved, when some window is
    followed by it): a container's work may run that far past its window's end, and what does is owed back by the
    shim, so a window's tail too short for its next launch is not lost. Windows of no length are no windows."""
    starts = sorted(o for o, n in windows.values() if n > 0)
    out: dict[str, int] = {}
    for key, (offset, length) in windows.items():
        end = offset + length
        nxt = next((s for s in starts if s >= end), starts[0] + period_ns if starts else end)
        out[key] = max(0, min(nxt - end, period_ns - length)) if length > 0 else 0
    return out


def layout(containers: list[Container], period_ns: int) -> dict[str, tuple[int, int]]:
    """Each container's window in the period: {key: (offset_ns, length_ns)}; see the module docstring. Windows
    never overlap and never cross the period's end."""
    order = sorted(containers, key=lambda c: c.key)
    caps = {c.key: min(max(c.cap, 0.0), 100.0) for c in order}
    total = sum(caps.values())
    scale = 100.0 / total if total > 100.0 else 1.0  # caps over 100 (cannot be admitted) still never overlap
    spare = max(0.0, 100.0 - total)
    elastic = sum(caps[c.key] for c in order if c.policy == ELASTIC)
    reserve = sum(caps[c.key] * scale for c in order if c.policy == LATENCY)
    turned = sum(caps[c.key] * scale for c in order if c.policy != LATENCY)
    out: dict[str, tuple[int, int]] = {}
    at = 0
    for c in order:
        if c.policy == LATENCY:
            out[c.key] = (0, 0)
            continue
        share = caps[c.key] * scale + (spare * caps[c.key] / elastic if c.policy == ELASTIC and elastic else 0.0)
        length = min(int(period_ns * share / 100.0), period_ns - at)
        out[c.key] = (min(at, period_ns - 1), max(length, 0))
        at += length
        if reserve and turned:  # its part of the latency containers' time follows it: held back, it runs on there
            at += int(period_ns * reserve * caps[c.key] * scale / turned / 100.0)
    return out


def holds(containers: list[Container]) -> tuple[int, int]:
    """(hold_mask, hold_pct) for the windowed containers of a GPU whose latency containers hold these board slots
    (Container.board_slot) and caps."""
    mask, caps = 0, 0.0
    for c in containers:
        if c.policy == LATENCY and c.board_slot is not None:
            mask |= 1 << c.board_slot
            caps += c.cap
    return mask, (min(HOLD_MAX_PCT, round(HOLD_FACTOR * caps)) if mask else 0)
