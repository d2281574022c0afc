"""The dispatcher service: every ALNAIR_DISPATCH_INTERVAL_S, per GPU, read each capped container's region
counters (tokens taken, time waited, launches), take the profiler's newest per-container GPU share when there is
one, and move each container's grant line (control.py has the law).

The agent is the grant line's only writer: the allocator writes it at admission, the dispatcher afterwards, both on
the event loop. The shim keeps extrapolating the last line when the agent is gone (never a stall, never uncapped),
and a restarted agent picks up from the rate it finds in each region. Everything read from a region is
untrusted: a region that cannot be opened, or whose counters fall or leap, only affects its own container.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import structlog

from alnair_agent.dispatcher import control as C
from alnair_agent.node.region import Region, RegionError

if TYPE_CHECKING:
    from alnair_agent.node.allocator import Allocator
    from alnair_agent.node.reconcile import PodStates
    from alnair_agent.node.workspace import Allocation, Workspace
    from alnair_agent.profiler.service import Profiler

log = structlog.get_logger(__name__)
T = TypeVar("T")

REOPEN_S = 1.0  # a region that could not be opened is tried again after this long
CHANGE = 0.005  # a rate within this fraction of the one written is not written again
HURRY_S = 2.0  # the profiler keeps its short interval this long after the last tick that needed it


def parse_policy(value: str | None, default: str) -> tuple[str, bool]:
    """(policy, ok): the annotation's value if valid, else the default and False."""
    if value is None or value == "":
        return default, True
    v = value.strip().lower()
    return (v, True) if v in C.POLICIES else (default, False)


class Dispatcher:
    def __init__(self, allocator: "Allocator", workspace: "Workspace", profiler: "Profiler | None",
                 pods: "PodStates | None", interval_s: float = 0.05, policy: str = C.STRICT,
                 gains: C.Gains = C.Gains()) -> None:
        self.allocator = allocator
        self.workspace = workspace
        self.profiler = profiler
        self.pods = pods
        self.interval_s = interval_s
        self.policy = policy
        self.gains = gains
        self.state: dict[str, C.Container] = {}  # allocation id -> control state
        self._regions: dict[str, Region] = {}
        self._refused: dict[str, float] = {}  # allocation id -> monotonic s of the last failed open
        self._bad_policy: set[tuple[str, str]] = set()
        self._profiler_samples = 0
        self._profiler_at: float | None = None
        self._util_seen: dict[str, tuple[float, float]] = {}  # allocation -> (gpu_util_integral, sampled_s)
        self.gpus: dict[str, C.Gpu] = {}
        self._uncapped: dict[str, tuple[int, float]] = {}  # uncapped allocation -> (launches, monotonic s they grew)
        self._last = time.monotonic()
        self.ticks = 0

    async def run(self) -> None:
        log.info("dispatcher_started", interval_s=self.interval_s, policy=self.policy, gain=self.gains.gain,
                 fast_gain=self.gains.fast_gain, max_factor=self.gains.max_factor, idle_s=self.gains.idle_s)
        try:
            while True:
                started = time.monotonic()
                try:
                    self.tick(started)
                except Exception:  # noqa: BLE001 - a dispatcher fault must not stop the agent; the shim keeps the line
                    log.exception("dispatcher_tick_failed")
                await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))
        finally:
            self.close()

    # -- one tick ------------------------------------------------------------------------------------------------
    def tick(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        dt, self._last = max(now - self._last, 1e-6), now
        self.ticks += 1
        g = self.gains
        by_gpu: dict[str, list[C.Container]] = {}
        uncapped: dict[str, set[str]] = {}  # GPU -> containers without a cap that launched there lately
        live = set()
        for alloc in list(self.allocator.allocations.values()):
            if not 0 < alloc.compute_limit < 100:  # no cap: the shim stays out of the launch path
                if self._uncapped_active(alloc, now):
                    uncapped.setdefault(alloc.gpu_uuid, set()).add(alloc.id)
                continue
            c = self._observe(alloc, now, dt)
            if c is not None:
                live.add(alloc.id)
                by_gpu.setdefault(alloc.gpu_uuid, []).append(c)
        for alloc_id in [i for i in self.state if i not in live]:
            self._forget(alloc_id)
        for alloc_id in [i for i in self._uncapped if i not in self.allocator.allocations]:
            self._forget(alloc_id)
        actives = {gpu: C.note_active(self.gpus.setdefault(gpu, C.Gpu()), cs, now, g) for gpu, cs in by_gpu.items()}
        if self.profiler is not None and any(self._steers_by_windows(gpu, by_gpu[gpu], a) for gpu, a in actives.items()):
            self.profiler.hurry(now + HURRY_S)  # shares are measured from the profiler's windows: short ones
        # after the changes above: a window that began before a change is not learnt from
        self._take_profile(by_gpu)
        for gpu, containers in by_gpu.items():
            C.targets(containers, now, g)
            state = self.gpus[gpu]
            C.update_scale(state, containers, now, dt, g)
            C.update_boost(state, containers, now, g)
            running = actives[gpu] | uncapped.get(gpu, set())
            for c in containers:
                self._write(c, state.scale, state.boost)
                # Where factors are learnt from exact per-process shares they already correct the inflated charges
                # of a shared GPU; the shim's floor charges are for GPUs whose shares cannot be learnt (see control).
                self._tell_sharers(c, 0 if state.learn else len(running - {c.key}))

    def _steers_by_windows(self, gpu: str, containers: list[C.Container], active: frozenset[str]) -> bool:
        """Whether this GPU's control needs the profiler's short windows now: its active containers' factors are
        learnt from them, or (where they cannot be learnt) every active one is elastic and the boost reads the
        device's utilization per window. A GPU of strict containers whose factors stay 1 needs none, and the
        hurried profiler costs the agent ~1.5 % of a core with 32 containers."""
        if not active:
            return False
        return self.gpus[gpu].learn or all(c.policy == C.ELASTIC for c in containers if c.key in active)

    def _observe(self, alloc: "Allocation", now: float, dt: float) -> C.Container | None:
        first = alloc.id not in self.state
        read = self._read(alloc.id, now, lambda r: (r.slots(), r.grant_line()[2] if first else 0))
        if read is None:
            return None
        slots, line_rate = read
        c = self.state.get(alloc.id)
        if c is None:
            c = self.state[alloc.id] = C.Container(alloc.id, float(alloc.compute_limit))
            if line_rate > 0:  # an agent restart: carry on from the factor the line in force implies
                c.k = min(max(line_rate / c.cap_rate, C.K_MIN), self.gains.max_factor)
                c.rate = line_rate
        c.cap = float(alloc.compute_limit)
        c.policy = self._policy(alloc)
        C.observe_counters(c, now, dt, sum(s.tokens_taken for s in slots), sum(s.wait_ns for s in slots),
                           sum(s.launches for s in slots), self.gains.max_factor)
        return c

    def _uncapped_active(self, alloc: "Allocation", now: float) -> bool:
        """A container without a compute cap still time-slices the GPU with the capped ones: launched lately?"""
        launches = self._read(alloc.id, now, lambda r: sum(s.launches for s in r.slots()))
        if launches is None:
            return False
        before = self._uncapped.get(alloc.id)
        if before is None or launches != before[0]:
            self._uncapped[alloc.id] = (launches, now if before is not None else -1e18)
            return before is not None
        return now - before[1] <= self.gains.idle_s

    def _tell_sharers(self, c: C.Container, n: int) -> None:
        """Tell the container's shim how many others run on its GPU (it then charges kernels their floor)."""
        if n != c.sharers and self._put(c.key, lambda r: r.set_sharers(n)):
            c.sharers = n

    def _take_profile(self, by_gpu: dict[str, list[C.Container]]) -> None:
        """The profiler's newest window, once per profiler sample: each container's measured share."""
        p = self.profiler
        if p is None or p.samples == self._profiler_samples:
            return
        self._profiler_samples = p.samples
        t1, t0 = p.sample_at, self._profiler_at
        self._profiler_at = t1
        seen = {s.uuid: s for s in p.last.gpus}
        for gpu, containers in by_gpu.items():
            state = self.gpus.setdefault(gpu, C.Gpu())
            sample = seen.get(gpu)
            util = sample.gpu_util if sample is not None else None
            state.device_util = util if util is not None and math.isfinite(util) else None
            if sample is not None and sample.process_util_sampled is True and state.learn:
                state.learn = False  # one draw per period: shares only hold over long averages, never per window
                log.info("dispatcher_factors_fixed", gpu=gpu, reason="per-process utilization is sampled by period")
                for c in containers:
                    c.k, c.trim = 1.0, 1.0
            if not state.learn:
                continue
            for c in containers:
                u = p.usage.get(c.key)
                if u is None:
                    continue
                before = self._util_seen.get(c.key)
                self._util_seen[c.key] = (u.gpu_util_integral, p.sampled_s)
                if before is None or t0 is None or p.sampled_s <= before[1]:
                    continue
                share = (u.gpu_util_integral - before[0]) / (p.sampled_s - before[1])
                if math.isfinite(share):
                    C.observe_share(c, t0, t1, min(max(share, 0.0), 100.0), self.gains)

    def _write(self, c: C.Container, scale: float = 1.0, boost: float = 1.0) -> None:
        rate = C.rate_for(c, self.gains, scale, boost)
        if c.rate and abs(rate - c.rate) <= CHANGE * c.rate:
            return
        if self._put(c.key, lambda r: r.set_grant_line(rate)):
            c.rate = rate

    # -- regions and policies ------------------------------------------------------------------------------------
    def _read(self, alloc_id: str, now: float, read: Callable[[Region], T]) -> T | None:
        """`read` of the allocation's region (opened if need be); None when it cannot be opened or read (then it is
        dropped, said once, and tried again after REOPEN_S)."""
        region = self._region(alloc_id, now)
        if region is None:
            return None
        try:
            return read(region)
        except (RegionError, OSError) as e:
            self._drop_region(alloc_id, now, str(e))
            return None

    def _put(self, alloc_id: str, write: Callable[[Region], None]) -> bool:
        """`write` to the allocation's open region; False when it is not open or the write failed (then dropped)."""
        region = self._regions.get(alloc_id)
        if region is None:
            return False
        try:
            write(region)
        except (RegionError, OSError) as e:
            self._drop_region(alloc_id, time.monotonic(), str(e))
            return False
        return True

    def _region(self, alloc_id: str, now: float) -> Region | None:
        region = self._regions.get(alloc_id)
        if region is not None:
            return region
        if now - self._refused.get(alloc_id, -1e18) < REOPEN_S:
            return None
        try:
            region = self._regions[alloc_id] = self.workspace.open_region(alloc_id)
        except (RegionError, OSError):  # a bad region file: the workspace has said so, once
            self._refused[alloc_id] = now
            return None
        self._refused.pop(alloc_id, None)
        return region

    def _drop_region(self, alloc_id: str, now: float, why: str) -> None:
        region = self._regions.pop(alloc_id, None)
        if region is not None:
            region.close()
        if alloc_id not in self._refused:
            log.warning("dispatcher_region_refused", allocation=alloc_id, error=why)
        self._refused[alloc_id] = now
        self.state.pop(alloc_id, None)

    def _forget(self, alloc_id: str) -> None:
        self.state.pop(alloc_id, None)
        self._uncapped.pop(alloc_id, None)
        self._util_seen.pop(alloc_id, None)
        region = self._regions.pop(alloc_id, None)
        if region is not None:
            region.close()

    def _policy(self, alloc: "Allocation") -> str:
        pod = None
        if self.pods is not None and alloc.identified:
            pod = self.pods.get(alloc.pod_uid) if alloc.pod_uid else self.pods.find(alloc.namespace, alloc.pod_name)
        raw = getattr(pod, "compute_policy", "") if pod is not None else ""
        policy, ok = parse_policy(raw, self.policy)
        if not ok and (alloc.id, raw) not in self._bad_policy:
            self._bad_policy.add((alloc.id, raw))
            from alnair_agent.constants import COMPUTE_POLICY_ANNOTATION
            log.warning("compute_policy_invalid", allocation=alloc.id, pod=alloc.ref(), annotation=COMPUTE_POLICY_ANNOTATION,
                        value=raw[:64], allowed=list(C.POLICIES), using=policy)
        return policy

    def close(self) -> None:
        for region in self._regions.values():
            region.close()
        self._regions.clear()
