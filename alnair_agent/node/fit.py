"""THE fit rule: which GPU each container of a pod lands on, by profile. One definition, imported by the scheduler
extender (filter, prioritize and bind all call `place`) and by the agent (which validates a decision against its
own ledger with `Room.fits`, and places pods itself only where the operator allows it).

Units: memory in `alnair/vgpu-memory` units, compute in percent of one GPU. A container's memory and compute come
from ONE GPU. Containers that run at the same time must fit at the same time:
  - sidecars (init containers with restartPolicy Always) and regular containers run together (the "steady" set);
  - each run-once init container runs alone, beside the sidecars declared before it.

kubelet hands a run-once init container's devices to the next containers of the same pod (its device manager
reuses them), so a pod with such an init container gets ALL its Alnair containers on ONE GPU: every group must fit
there by itself. Otherwise each steady container is placed on its own, largest first:
  - PACK (cost-saving, `binpack`): the GPU left fullest after placing it (best fit);
  - SPREAD (high-performance, `spread`): the GPU left emptiest (worst fit).
A container may ask for several GPUs (`Need.count`, from `alnair/vgpu-count`), each holding the same slice
(`Need.memory`, `Need.compute` are per GPU): it gets `count` distinct GPUs of the node, the `count` that PACK leaves
fullest (or SPREAD emptiest), listed in GPU index order (the order the container sees them in); containers asking
for more GPUs are placed first. All or none: a container never gets fewer GPUs than it asked for.
When one policy finds no room for every container the other is tried before giving up, so whether a pod fits
never depends on its profile.
Ties go to the lowest GPU index. Everything is integer or exact-fraction arithmetic: deterministic.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

PACK = "pack"
SPREAD = "spread"
POLICIES = (PACK, SPREAD)

KIND_INIT = "init"  # run-once init container
KIND_SIDECAR = "sidecar"  # init container with restartPolicy Always: runs beside the regular containers
KIND_REGULAR = "regular"

MAX_SCORE = 10  # kube-scheduler's MaxExtenderPriority


MAX_GPUS_PER_CONTAINER = 16  # a bound on alnair/vgpu-count: the shim keeps per-device state for 16 (ALNAIR_MAX_DEVICES)


@dataclass(frozen=True)
class Need:
    """One container's request: `count` distinct GPUs, each giving it `memory` and `compute` units."""

    name: str
    memory: int
    compute: int
    kind: str = KIND_REGULAR
    count: int = 1

    def describe(self) -> str:
        each = f"{self.memory} memory + {self.compute} compute units"
        return each if self.count == 1 else f"{self.count} GPUs of {each} each"


class Room(NamedTuple):
    """One healthy GPU: units free and offered of each resource. (A NamedTuple: `place` makes many of them.)"""

    uuid: str
    index: int  # type: ignore[assignment]  # the GPU's index (as NVML and the node report say), shadowing tuple.index
    memory_free: int
    compute_free: int
    memory_total: int
    compute_total: int

    def fits(self, memory: int, compute: int) -> bool:
        return self.memory_free >= memory and self.compute_free >= compute

    def less(self, memory: int, compute: int) -> Room:
        return Room(self.uuid, self.index, self.memory_free - memory, self.compute_free - compute,
                    self.memory_total, self.compute_total)

    def empty(self) -> Room:
        return Room(self.uuid, self.index, self.memory_total, self.compute_total, self.memory_total,
                    self.compute_total)

    def free_share(self, memory: int = 0, compute: int = 0) -> float:
        """Free fraction once `memory` and `compute` are taken, averaged over both resources (0 = full, 1 = empty).
        A float: it only orders GPUs (deterministically), and filter runs it for thousands of nodes."""
        mt, ct = self.memory_total, self.compute_total
        if mt > 0 and ct > 0:
            return ((self.memory_free - memory) / mt + (self.compute_free - compute) / ct) / 2
        if mt > 0:
            return (self.memory_free - memory) / mt
        if ct > 0:
            return (self.compute_free - compute) / ct
        return 0.0

    def describe(self) -> str:
        return (f"GPU {self.index}: {self.memory_free}/{self.memory_total} memory, "
                f"{self.compute_free}/{self.compute_total} compute free")


@dataclass(frozen=True)
class Placement:
    """Where each container goes: container name -> its GPU UUIDs (one, or `Need.count`), in GPU index order."""

    gpus: Mapping[str, tuple[str, ...]]

    fits = True


@dataclass(frozen=True)
class NoFit:
    """Why the pod does not fit; `resolvable` is False when it would not fit even with every GPU empty."""

    reason: str
    resolvable: bool = True

    fits = False


def groups(needs: Sequence[Need]) -> list[tuple[Need, ...]]:
    """Each set of containers that must fit at the same time: every run-once init container beside the sidecars
    declared before it, then the steady set."""
    out: list[tuple[Need, ...]] = []
    sidecars: list[Need] = []
    for need in needs:
        if need.kind == KIND_SIDECAR:
            sidecars.append(need)
        elif need.kind == KIND_INIT:
            out.append((*sidecars, need))
    steady = tuple(n for n in needs if n.kind != KIND_INIT)
    if steady:
        out.append(steady)
    return out


def _label(need: Need) -> str:
    return {KIND_INIT: "init container", KIND_SIDECAR: "sidecar"}.get(need.kind, "container")


def _choose(rooms: Iterable[Room], need: Need, policy: str) -> Room | None:
    m, c = need.memory, need.compute
    sign = 1 if policy == PACK else -1
    best: Room | None = None
    best_key: tuple[float, int] | None = None
    for r in rooms:
        if r.memory_free >= m and r.compute_free >= c:
            key = (sign * r.free_share(m, c), r.index)
            if best_key is None or key < best_key:
                best, best_key = r, key
    return best


@functools.lru_cache(maxsize=1024)
def _largest_first(needs: tuple[Need, ...], mem_scale: int, comp_scale: int) -> tuple[Need, ...]:
    """Containers asking for more GPUs first, then by dominant share, largest first (ties: more memory, more compute,
    pod order). Exact fractions: this order decides which container goes first, so no rounding may flip it."""
    def key(item: tuple[int, Need]) -> tuple[int, Fraction, int, int, int]:
        pos, n = item
        return (-n.count, -max(Fraction(n.memory, mem_scale), Fraction(n.compute, comp_scale)), -n.memory,
                -n.compute, pos)
    return tuple(n for _, n in sorted(enumerate(needs), key=key))


def _one_by_one(needs: Sequence[Need], rooms: Sequence[Room], policy: str) -> Placement | Need:
    """Greedy, largest dominant share first; returns the first container that found no room on failure. (Written
    out flat: filter runs it on thousands of nodes for a pod that no single GPU holds whole.)"""
    mem_scale = max((r.memory_total for r in rooms), default=0) or 1
    comp_scale = max((r.compute_total for r in rooms), default=0) or 1
    free_m = [r.memory_free for r in rooms]
    free_c = [r.compute_free for r in rooms]
    sign = 1 if policy == PACK else -1
    placed: dict[str, tuple[str, ...]] = {}
    for need in _largest_first(tuple(needs), mem_scale, comp_scale):
        m, c = need.memory, need.compute
        if need.count > 1:
            chosen = _several(need, rooms, free_m, free_c, sign)
            if chosen is None:
                return need
            for i in chosen:
                free_m[i] -= m
                free_c[i] -= c
            placed[need.name] = tuple(rooms[i].uuid for i in sorted(chosen, key=lambda i: rooms[i].index))
            continue
        best, best_key = -1, (0.0, 0)
        for i, r in enumerate(rooms):
            fm, fc = free_m[i], free_c[i]
            if fm >= m and fc >= c:
                mt, ct = r.memory_total, r.compute_total
                share = (((fm - m) / mt + (fc - c) / ct) / 2 if mt > 0 and ct > 0 else (fm - m) / mt if mt > 0
                         else (fc - c) / ct if ct > 0 else 0.0)  # Room.free_share, inline
                key = (sign * share, r.index)
                if best < 0 or key < best_key:
                    best, best_key = i, key
        if best < 0:
            return need
        free_m[best] -= m
        free_c[best] -= c
        placed[need.name] = (rooms[best].uuid,)
    return Placement(placed)


def _several(need: Need, rooms: Sequence[Room], free_m: list[int], free_c: list[int], sign: int) -> list[int] | None:
    """The `need.count` distinct GPUs (positions in `rooms`) a multi-GPU container takes: of those with room for its
    slice, the ones the policy ranks first, each judged as `_one_by_one` judges one GPU; None when too few have room."""
    m, c = need.memory, need.compute
    ranked = []
    for i, r in enumerate(rooms):
        if free_m[i] >= m and free_c[i] >= c:
            share = r._replace(memory_free=free_m[i], compute_free=free_c[i]).free_share(m, c)
            ranked.append((sign * share, r.index, i))
    if len(ranked) < need.count:
        return None
    ranked.sort()
    return [i for _, _, i in ranked[: need.count]]


def _one_gpu(needs: Sequence[Need], rooms: Sequence[Room], policy: str) -> Placement | None:
    """All containers on one GPU where every group fits by itself (pods with run-once init containers)."""
    demand = [(sum(n.memory for n in g), sum(n.compute for n in g)) for g in groups(needs)]
    fitting = [r for r in rooms if all(r.fits(m, c) for m, c in demand)]
    if not fitting:
        return None
    peak_m = max(m for m, _ in demand)
    peak_c = max(c for _, c in demand)
    sign = 1 if policy == PACK else -1
    best = min(fitting, key=lambda r: (sign * r.free_share(peak_m, peak_c), r.index))
    return Placement({n.name: (best.uuid,) for n in needs})


def _place(needs: Sequence[Need], rooms: Sequence[Room], policy: str) -> Placement | NoFit:
    if any(n.kind == KIND_INIT for n in needs):
        several = [n for n in needs if n.count > 1]
        if several:
            return NoFit(f"the pod has init containers asking for Alnair resources, so all its Alnair containers go "
                         f"on one GPU (kubelet reuses an init container's devices), but {_label(several[0])} "
                         f"{several[0].name!r} asks for {several[0].count} GPUs", resolvable=False)
        placed = _one_gpu(needs, rooms, policy)
        if placed is not None:
            return placed
        free = "; ".join(r.describe() for r in rooms)
        return NoFit("the pod has init containers asking for Alnair resources, so all its Alnair containers go on "
                     f"one GPU (kubelet reuses an init container's devices), and no GPU has room for each of its "
                     f"groups: {', '.join(n.name for n in needs)}; {free}")
    steady = [n for n in needs if n.kind != KIND_INIT]
    result = _one_by_one(steady, rooms, policy)
    if isinstance(result, Need):  # the other policy may fit what this one did not
        other = _one_by_one(steady, rooms, SPREAD if policy == PACK else PACK)
        result = other if isinstance(other, Placement) else result
    if isinstance(result, Placement):
        return result
    free = "; ".join(r.describe() for r in rooms)
    if result.count > 1:
        others = " after placing the other containers" if len(steady) > 1 else ""
        return NoFit(f"no {result.count} healthy GPUs of this node have room each for {_label(result)} "
                     f"{result.name!r} ({result.describe()}){others}; {free}")
    if len(steady) == 1:
        return NoFit(f"no healthy GPU has room for {_label(result)} {result.name!r} ({result.describe()} on one "
                     f"GPU); {free}")
    return NoFit(f"containers {', '.join(repr(n.name) for n in steady)} do not fit the GPUs together: no room left "
                 f"for {_label(result)} {result.name!r} ({result.describe()} on one GPU) after placing the others; "
                 f"{free}")


def place(needs: Sequence[Need], rooms: Sequence[Room], policy: str) -> Placement | NoFit:
    """Where each container of a pod goes on a node whose healthy GPUs have `rooms` free, by `policy`."""
    if policy not in POLICIES:
        raise ValueError(f"unknown placement policy {policy!r}")
    needs = [n for n in needs if n.memory or n.compute]
    if not needs:
        return Placement({})
    if not rooms:
        return NoFit("node has no healthy GPU", resolvable=False)
    widest = max(needs, key=lambda n: n.count)
    if widest.count > len(rooms):
        return NoFit(f"{_label(widest)} {widest.name!r} asks for {widest.count} GPUs and this node has "
                     f"{len(rooms)} healthy GPU(s); a container's GPUs all come from one node", resolvable=False)
    if len(needs) == 1 and needs[0].kind != KIND_INIT:
        quick = _one_need_no_fit(needs[0], rooms)
        if quick is not None:
            return quick
    result = _place(needs, rooms, policy)
    if isinstance(result, NoFit) and not isinstance(_place(needs, [r.empty() for r in rooms], policy), Placement):
        if not result.resolvable:
            return result
        if any(n.count > 1 for n in needs):
            return NoFit("the request is larger than this node's GPUs can hold even when empty: " + result.reason,
                         resolvable=False)
        # It would not fit even on empty GPUs: preemption cannot help.
        mem = max(r.memory_total for r in rooms)
        comp = max(r.compute_total for r in rooms)
        return NoFit(f"the request is larger than any single GPU on this node can hold (largest offers {mem} memory "
                     f"+ {comp} compute units; memory and compute of a container come from one GPU): "
                     + result.reason, resolvable=False)
    return result


def _one_need_no_fit(n: Need, rooms: Sequence[Room]) -> NoFit | None:
    """For a pod of one container: whether it fits is whether `n.count` GPUs have room for its slice (the policy
    only decides which). The NoFit `place` would give, without placing twice (filter meets it on thousands of nodes
    for a wide request); None when it fits."""
    m, c = n.memory, n.compute
    if sum(1 for r in rooms if r.memory_free >= m and r.compute_free >= c) >= n.count:
        return None
    free = "; ".join(r.describe() for r in rooms)
    if n.count > 1:
        reason = (f"no {n.count} healthy GPUs of this node have room each for {_label(n)} {n.name!r} "
                  f"({n.describe()}); {free}")
    else:
        reason = f"no healthy GPU has room for {_label(n)} {n.name!r} ({n.describe()} on one GPU); {free}"
    if sum(1 for r in rooms if r.memory_total >= m and r.compute_total >= c) >= n.count:
        return NoFit(reason)
    if n.count > 1:
        return NoFit("the request is larger than this node's GPUs can hold even when empty: " + reason,
                     resolvable=False)
    mem = max(r.memory_total for r in rooms)
    comp = max(r.compute_total for r in rooms)
    return NoFit(f"the request is larger than any single GPU on this node can hold (largest offers {mem} memory "
                 f"+ {comp} compute units; memory and compute of a container come from one GPU): " + reason,
                 resolvable=False)


def usage(needs: Sequence[Need], placement: Mapping[str, tuple[str, ...]]) -> dict[str, tuple[int, int]]:
    """Units a placed pod holds per GPU (memory, compute): per GPU, the largest of its groups' sums there (a
    multi-GPU container's slice on each of its GPUs)."""
    out: dict[str, tuple[int, int]] = {}
    for group in groups([n for n in needs if n.name in placement]):
        per_gpu: dict[str, list[int]] = {}
        for n in group:
            for gpu in placement[n.name]:
                m_c = per_gpu.setdefault(gpu, [0, 0])
                m_c[0] += n.memory
                m_c[1] += n.compute
        for gpu, (m, c) in per_gpu.items():
            old = out.get(gpu, (0, 0))
            out[gpu] = (max(old[0], m), max(old[1], c))
    return out


@dataclass(frozen=True)
class FreeSummary:
    """A node's rooms digested once (per change of the node) for the many questions of filter and prioritize:
    the distinct (memory free, compute free) pairs no other pair dominates, and the sums for utilization."""

    frontier: tuple[tuple[int, int], ...]
    pairs: tuple[tuple[int, int], ...]  # every room's (memory free, compute free), for multi-GPU questions
    memory_total: int
    memory_used: int
    compute_total: int
    compute_used: int

    @classmethod
    def of(cls, rooms: Sequence[Room]) -> FreeSummary:
        pairs = sorted({(r.memory_free, r.compute_free) for r in rooms}, reverse=True)
        frontier: list[tuple[int, int]] = []
        for m, c in pairs:  # memory descending: keep a pair only if it has more compute than every kept one
            if not frontier or c > frontier[-1][1]:
                frontier.append((m, c))
        return cls(tuple(frontier), tuple((r.memory_free, r.compute_free) for r in rooms),
                   sum(r.memory_total for r in rooms),
                   sum(r.memory_total - r.memory_free for r in rooms), sum(r.compute_total for r in rooms),
                   sum(r.compute_total - r.compute_free for r in rooms))

    def holds(self, memory: int, compute: int) -> bool:
        """Whether one room has `memory` and `compute` free at once."""
        for m, c in self.frontier:
            if m < memory:
                return False
            if c >= compute:
                return True
        return False

    def holds_on(self, memory: int, compute: int, count: int) -> bool:
        """Whether `count` distinct rooms each have `memory` and `compute` free at once."""
        return sum(1 for m, c in self.pairs if m >= memory and c >= compute) >= count


@dataclass(frozen=True)
class Shape:
    """A pod's needs with what filter and prioritize ask of them on every node, computed once per request."""

    needs: tuple[Need, ...]
    has_init: bool
    steady_memory: int  # units the steady containers hold on the node, all their GPUs together
    steady_compute: int
    key: int  # hash of the needs, computed once: verdicts are memoized per node state under it
    gpus: int = 1  # the most GPUs one container asks for
    gpu_memory: int = 0  # the steady containers' slices summed as if on one GPU (multi-GPU fast check)
    gpu_compute: int = 0

    @classmethod
    def of(cls, needs: Sequence[Need]) -> Shape:
        live = tuple(n for n in needs if n.memory or n.compute)
        steady = [n for n in live if n.kind != KIND_INIT]
        return cls(live, any(n.kind == KIND_INIT for n in live), sum(n.memory * n.count for n in steady),
                   sum(n.compute * n.count for n in steady), hash(live), max((n.count for n in live), default=1),
                   sum(n.memory for n in steady), sum(n.compute for n in steady))


def verdict(shape: Shape, rooms: Sequence[Room], free: FreeSummary, policy: str) -> Placement | NoFit | None:
    """Whether the pod fits, as `place` decides: None (fits, where it goes not worked out), a Placement, or
    NoFit. Answered without placing when one GPU can hold all its steady containers together: then `place` always
    succeeds (whatever it puts elsewhere only leaves that GPU more room for the rest). With multi-GPU containers
    the same holds when `shape.gpus` GPUs can each hold every steady container's slice together: each container's
    GPUs are distinct, so the others take at most their own slice from each of those GPUs, and `count` of them are
    left with room for it. Filter asks this for thousands of nodes per pod."""
    if not shape.needs:
        return None
    if not shape.has_init:
        if shape.gpus == 1 and free.holds(shape.steady_memory, shape.steady_compute):
            return None
        if shape.gpus > 1 and free.holds_on(shape.gpu_memory, shape.gpu_compute, shape.gpus):
            return None
    return place(shape.needs, rooms, policy)


def score_added(added: tuple[int, int], free: FreeSummary, policy: str) -> int:
    """0..MAX_SCORE for a node the pod fits, once `added` (memory, compute) more units are in use there (its
    sidecars and regular containers): PACK favours the most used node, SPREAD the least used. Utilization is the
    mean over memory and compute of min(1, used / offered), rounded half up, in integers (exact, and cheap enough for
    thousands of nodes per request)."""
    b, d = free.memory_total, free.compute_total
    a = min(free.memory_used + added[0], b)
    c = min(free.compute_used + added[1], d)
    if b > 0 and d > 0:  # floor(10 * (a/b + c/d) / 2 + 1/2): the mean of the two shares, rounded half up
        packed = (MAX_SCORE * (a * d + c * b) + b * d) // (2 * b * d)
    elif b > 0:
        packed = (2 * MAX_SCORE * a + b) // (2 * b)
    elif d > 0:
        packed = (2 * MAX_SCORE * c + d) // (2 * d)
    else:
        packed = 0
    packed = max(0, min(MAX_SCORE, packed))
    return packed if policy == PACK else MAX_SCORE - packed
