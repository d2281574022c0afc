"""The dispatcher service: every ALNAIR_DISPATCH_INTERVAL_S, per GPU, read each capped container's region counters
(launches, time waited for its turn, GPU time), lay out the GPU's turns and write each container's window and lease
(control.py has the rules).

The agent is the only writer of the turns. They run on the clock, so when the agent stops the last windows stay in
force (never a stall, never uncapped) and leases run out within LEASE_TICKS ticks. Everything read from a region is
untrusted: a region that cannot be opened, or whose counters fall or leap, only affects its own container.
"""

from __future__ import annotations

import asyncio
import math
import operator
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

import structlog

from alnair_agent.dispatcher import control as C
from alnair_agent.node import region_layout as L
from alnair_agent.node.region import Region, RegionError, Turn, monotonic_ns

if TYPE_CHECKING:
    from alnair_agent.kube.pod_source import PodSource
    from alnair_agent.node.ledger import Ledger
    from alnair_agent.node.workspace import Allocation, Workspace
    from alnair_agent.profiler.service import Profiler

log = structlog.get_logger(__name__)
T = TypeVar("T")

REOPEN_S = 1.0  # a region that could not be opened is tried again after this long
# A tick gives the event loop back after reading this many containers' regions, and after each GPU's turns: with
# a hundred slices a tick is milliseconds of file calls, which a kubelet call arriving meanwhile must not wait out.
READS_PER_STEP = 4


def parse_policy(value: str | None, default: str) -> tuple[str, bool]:
    """(policy, ok): the annotation's value if valid, else the default and False."""
    if value is None or value == "":
        return default, True
    v = value.strip().lower()
    return (v, True) if v in C.POLICIES else (default, False)


class Dispatcher:
    def __init__(self, ledger: "Ledger", workspace: "Workspace", profiler: "Profiler | None",
                 pods: "PodSource | None", interval_s: float = 0.05, policy: str = C.STRICT,
                 period_s: float = 0.05, idle_s: float = 0.15) -> None:
        self.ledger = ledger
        self.workspace = workspace
        self.profiler = profiler
        self.pods = pods
        self.interval_s = interval_s
        self.policy = policy
        self.period_ns = int(period_s * 1e9)
        self.idle_s = idle_s
        self.state: dict[str, C.Container] = {}  # allocation id -> control state
        self.gpus: dict[str, C.GpuTurns] = {}
        self.lent: set[str] = set()  # allocations lent their GPU at the last tick
        self.turns: dict[str, float] = {}  # allocation -> its window as a part of the period, at the last tick
        self._regions: dict[str, Region] = {}
        self._refused: dict[str, float] = {}  # allocation id -> monotonic s of the last failed open
        self._bad_policy: set[tuple[str, str]] = set()
        self._profiler_samples = 0
        self._uncapped: dict[str, tuple[int, float]] = {}  # uncapped allocation -> (launches, monotonic s they grew)
        self._last = time.monotonic()
        self.ticks = 0
        self._policies: dict[str, str] = {}  # allocation -> policy set by its embedder (set_policy)
        self.board_slots: dict[str, dict[str, int]] = {}  # GPU -> {latency allocation: its board slot}
        self._linked: set[str] = set()  # allocations whose run folder has their GPU's board
        self._board_refused: set[str] = set()  # GPUs whose board could not be made (said once)

    async def run(self) -> None:
        log.info("dispatcher_started", interval_s=self.interval_s, policy=self.policy,
                 period_s=self.period_ns / 1e9, idle_s=self.idle_s)
        try:
            while True:
                started = time.monotonic()
                try:
                    for _ in self._steps(started):
                        await asyncio.sleep(0)
                except Exception:  # a dispatcher fault must not stop the agent; turns stay in force
                    log.exception("dispatcher_tick_failed")
                await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))
        finally:
            self.close()

    # -- one tick ------------------------------------------------------------------------------------------------
    def tick(self, now: float | None = None) -> None:
        for _ in self._steps(time.monotonic() if now is None else now):
            pass

    def _steps(self, now: float) -> Iterator[None]:
        """One tick, yielding where the service may give the loop back (between batches of region reads, between
        GPUs); `tick` runs it through at once. What a step reads is as of `now`: a read a millisecond later only
        moves counters into the next tick's window."""
        dt, self._last = max(now - self._last, 1e-6), now
        self.ticks += 1
        by_gpu: dict[str, list[C.Container]] = {}
        uncapped: dict[str, set[str]] = {}  # GPU -> containers without a cap that launched there lately
        live = set()
        for n, alloc in enumerate(list(self.ledger.allocations.values())):
            if n and n % READS_PER_STEP == 0:
                yield
            if alloc.id not in self.ledger.allocations:
                continue  # retired during a step: its folder is gone
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
        for alloc_id in [i for i in self._uncapped if i not in self.ledger.allocations]:
            self._forget(alloc_id)
        for alloc_id in [i for i in self._policies if i not in self.ledger.allocations]:
            del self._policies[alloc_id]
        utils = self._device_utils()
        now_ns = monotonic_ns()
        all_lent: set[str] = set()
        turns: dict[str, float] = {}
        for i, (gpu_uuid, containers) in enumerate(by_gpu.items()):
            if i:
                yield
            gpu = self.gpus.get(gpu_uuid)
            if gpu is None:
                gpu = self.gpus[gpu_uuid] = C.GpuTurns(epoch_ns=now_ns)
            others = uncapped.get(gpu_uuid, set())
            # Latency containers take no turns: they neither end a lease nor count for lending (their neighbours
            # hold back for them through the board instead).
            active = frozenset(c.key for c in containers
                               if c.policy != C.LATENCY and c.active(now, self.idle_s)) | others
            C.note_active(gpu, active, now)
            if gpu_uuid in utils:
                C.note_device_util(gpu, *utils[gpu_uuid])
            change = C.update_lending(gpu, containers, bool(others), now)
            if change is not None:
                log.info("lending_together", gpu=gpu_uuid, change=change, containers=sorted(gpu.active),
                         hold_s=gpu.hold_s if change == "slowed" else None,
                         slowed=gpu.slowed if change == "slowed" else None)
            lent = C.lent(gpu, containers, bool(others))
            all_lent |= lent
            lease_end = now_ns + int(C.LEASE_TICKS * self.interval_s * 1e9)
            windows = C.layout(containers, self.period_ns)
            spare = C.spares(windows, self.period_ns)
            mask, hold_pct = self._latency(gpu_uuid, containers, now)
            for c in containers:
                offset, length = windows[c.key]
                turns[c.key] = length / self.period_ns
                turn = Turn(gpu.epoch_ns, self.period_ns, offset, length, lease_end if c.key in lent else 0,
                            spare[c.key])
                self._put(c.key, operator.methodcaller("set_turn", turn))
                if c.policy == C.LATENCY and c.board_slot is not None:
                    self._put(c.key, operator.methodcaller("set_class", L.CLASS_LATENCY, c.board_slot))
                else:
                    self._put(c.key, operator.methodcaller("set_class", L.CLASS_TURNS, 0, mask, hold_pct))
        self.lent, self.turns = all_lent, turns
        for gpu_uuid in [g for g in self.gpus if g not in by_gpu]:
            del self.gpus[gpu_uuid]

    def _latency(self, gpu_uuid: str, containers: list[C.Container], now: float) -> tuple[int, int]:
        """The GPU's board: linked into every capped container's folder, a slot for each latency container (held
        while it lives), made whole again if anyone cut it; (hold_mask, hold_pct) for the others, naming the latency
        containers that launched in the last LATENCY_IDLE_S."""
        slots = self.board_slots.setdefault(gpu_uuid, {})
        for key in [k for k in slots if not any(c.key == k and c.policy == C.LATENCY for c in containers)]:
            del slots[key]
        latency = [c for c in containers if c.policy == C.LATENCY]
        if not latency and not slots:
            for c in containers:
                c.board_slot = None
            return 0, 0
        try:
            board = self.workspace.board(gpu_uuid)
            if board.repair():
                log.warning("board_repaired", gpu=gpu_uuid)
            for c in containers:
                if c.key not in self._linked:
                    self.workspace.link_board(c.key, gpu_uuid)
                    self._linked.add(c.key)
        except (OSError, RegionError, ValueError) as e:
            if gpu_uuid not in self._board_refused:
                self._board_refused.add(gpu_uuid)
                log.warning("board_unavailable", gpu=gpu_uuid, error=str(e))  # latency containers take turns
            for c in containers:
                c.board_slot = None
            return 0, 0
        for c in latency:
            if c.key not in slots:
                free = next((k for k in range(L.BOARD_SLOTS) if k not in slots.values()), None)
                if free is None:
                    log.warning("latency_slots_full", gpu=gpu_uuid, allocation=c.key, slots=L.BOARD_SLOTS)
                    c.board_slot = None
                    continue
                board.clear(free)
                slots[c.key] = free
            c.board_slot = slots[c.key]
        present = [c for c in latency if c.board_slot is not None and c.active(now, C.LATENCY_IDLE_S)]
        return C.holds(present)

    def set_policy(self, alloc_id: str, policy: str) -> None:
        """The allocation's compute policy, for an embedder with no pod watch (benchmarks, the demo): over the pod's
        annotation and the node's default."""
        if policy not in C.POLICIES:
            raise ValueError(f"compute policy {policy!r}: expected one of {', '.join(C.POLICIES)}")
        self._policies[alloc_id] = policy

    def _observe(self, alloc: "Allocation", now: float, dt: float) -> C.Container | None:
        slots = self._read(alloc.id, now, lambda r: r.slots())
        if slots is None:
            return None
        c = self.state.get(alloc.id)
        if c is None:
            c = self.state[alloc.id] = C.Container(alloc.id, float(alloc.compute_limit))
        c.cap = float(alloc.compute_limit)
        c.policy = self._policy(alloc)
        C.observe_counters(c, now, dt, sum(s.launches for s in slots), sum(s.wait_ns for s in slots),
                           sum(s.gpu_ns for s in slots))
        # counted only as they grow (a process's slot goes with it): totals for /metrics that never fall
        held_ns, holds = sum(s.held_ns for s in slots), sum(s.holds for s in slots)
        c.held_s += max(0, held_ns - c.held_ns) / 1e9
        c.held_count += max(0, holds - c.holds)
        c.held_ns, c.holds = held_ns, holds
        return c

    def _uncapped_active(self, alloc: "Allocation", now: float) -> bool:
        """A container without a compute cap runs outside the turns (the driver time-slices it with the capped
        ones): launched lately?"""
        launches = self._read(alloc.id, now, lambda r: sum(s.launches for s in r.slots()))
        if launches is None:
            return False
        before = self._uncapped.get(alloc.id)
        if before is None or launches != before[0]:
            self._uncapped[alloc.id] = (launches, now if before is not None else -1e18)
            return before is not None
        return now - before[1] <= self.idle_s

    def _device_utils(self) -> dict[str, tuple[float, float]]:
        """The profiler's newest device utilization per GPU, once per profiler sample: {uuid: (percent, at)}."""
        p = self.profiler
        if p is None or p.samples == self._profiler_samples:
            return {}
        self._profiler_samples = p.samples
        return {g.uuid: (g.gpu_util, p.sample_at) for g in p.last.gpus
                if g.gpu_util is not None and math.isfinite(g.gpu_util)}

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

    def _put(self, alloc_id: str, write: Callable[[Region], object]) -> bool:
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
        self._linked.discard(alloc_id)
        self._uncapped.pop(alloc_id, None)
        region = self._regions.pop(alloc_id, None)
        if region is not None:
            region.close()

    def _policy(self, alloc: "Allocation") -> str:
        if alloc.id in self._policies:
            return self._policies[alloc.id]
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
        self.workspace.close_boards()
