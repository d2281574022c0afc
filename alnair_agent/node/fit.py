"""THE fit rule: which GPU each container of a pod lands on, by profile. One definition, imported by the scheduler
extender (bind calls `place`; filter and prioritize ask `judge_all`, which answers as `place` would by counting,
and `place` where counting cannot tell) and by the agent (which validates a decision against its own ledger with
`Room.fits`, and places pods itself only where the operator allows it).

Units: memory in `alnair/vgpu-memory` units, compute in percent of one GPU; memory asked as a percent of the GPU
(`Need.memory_percent`, from `alnair/vgpu-memory-percent`) is converted on each GPU considered (`Need.memory_on`).
A container's memory and compute come from ONE GPU. Containers that run at the same time must fit at the same time:
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

import bisect
import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
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


def percent_units(percent: int, total: int) -> int:
    """Memory units that `percent` % of a GPU offering `total` units is: rounded down, at least one (a GPU offering
    none gives none)."""
    return max(1, percent * total // 100) if total > 0 else 0


@dataclass(frozen=True)
class Need:
    """One container's request: `count` distinct GPUs, each giving it `memory` and `compute` units. With
    `memory_percent` (alnair/vgpu-memory-percent) its memory on a GPU is that share of the GPU's memory units
    (`memory_on`): `memory` is then 0, or the units on the GPUs of one size it was resolved for (`on`)."""

    name: str
    memory: int
    compute: int
    kind: str = KIND_REGULAR
    count: int = 1
    memory_percent: int = 0

    def memory_on(self, total: int) -> int:
        """Memory units this container takes on a GPU offering `total` memory units."""
        return percent_units(self.memory_percent, total) if self.memory_percent else self.memory

    def on(self, total: int) -> Need:
        """This need on GPUs offering `total` memory units each: its memory in units."""
        return replace(self, memory=percent_units(self.memory_percent, total)) if self.memory_percent else self

    @property
    def asks(self) -> bool:
        return bool(self.memory or self.compute or self.memory_percent)

    def describe(self) -> str:
        # a share in the same words whatever the GPU's size (filter's reason is the same on every node failing alike)
        memory = f"{self.memory_percent} % memory" if self.memory_percent else f"{self.memory} memory"
        each = f"{memory} + {self.compute} compute units"
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


class NoFit(NamedTuple):
    """Why the pod does not fit; `resolvable` is False when it would not fit even with every GPU empty.

    `why` says what does not fit in words that do not depend on the node's state, so every node failing the same
    way gives filter the same text and kube-scheduler's FailedScheduling event counts them ("1758 no 2 healthy
    GPUs ..."); `reason` adds each GPU's free units (`free`), for answers about one node (bind, the agent). (A
    NamedTuple: filter makes one for each node a pod does not fit, thousands of them.)"""

    why: str
    resolvable: bool = True
    free: tuple[Room, ...] = ()

    @property
    def fits(self) -> bool:
        return False

    @property
    def reason(self) -> str:
        return f"{self.why}; {_free_text(self.free)}" if self.free else self.why


def _free_text(rooms: Iterable[Room]) -> str:
    return "; ".join(r.describe() for r in rooms)


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


@functools.lru_cache(maxsize=1024)
def _largest_first(needs: tuple[Need, ...], mem_scale: int, comp_scale: int) -> tuple[Need, ...]:
    """Containers asking for more GPUs first, then by dominant share, largest first (ties: more memory, more compute,
    pod order). Exact fractions: this order decides which container goes first, so no rounding may flip it."""
    def key(item: tuple[int, Need]) -> tuple[int, Fraction, int, int, int]:
        pos, n = item
        memory = n.memory_on(mem_scale)
        return (-n.count, -max(Fraction(memory, mem_scale), Fraction(n.compute, comp_scale)), -memory,
                -n.compute, pos)
    return tuple(n for _, n in sorted(enumerate(needs), key=key))


def _share(fm: int, fc: int, mt: int, ct: int) -> float:
    """Room.free_share of a room with `fm`, `fc` free of `mt`, `ct` (written out: the loops below run it often)."""
    if mt > 0 and ct > 0:
        return (fm / mt + fc / ct) / 2
    if mt > 0:
        return fm / mt
    if ct > 0:
        return fc / ct
    return 0.0


def _one_by_one(needs: Sequence[Need], rooms: Sequence[Room], policy: str) -> Placement | Need:
    """Greedy, largest dominant share first; returns the first container that found no room on failure. (Written
    out flat: bind and the agent run it, and filter for pods its quick checks cannot settle.)"""
    mem_scale = max((r.memory_total for r in rooms), default=0) or 1
    comp_scale = max((r.compute_total for r in rooms), default=0) or 1
    free_m = [r.memory_free for r in rooms]
    free_c = [r.compute_free for r in rooms]
    sign = 1 if policy == PACK else -1
    placed: dict[str, tuple[str, ...]] = {}
    for need in _largest_first(tuple(needs), mem_scale, comp_scale):
        m, c, percent = need.memory, need.compute, need.memory_percent
        if need.count > 1:
            chosen = _several(need, rooms, free_m, free_c, sign)
            if chosen is None:
                return need
            for i in chosen:
                free_m[i] -= need.memory_on(rooms[i].memory_total)
                free_c[i] -= c
            placed[need.name] = tuple(rooms[i].uuid for i in sorted(chosen, key=lambda i: rooms[i].index))
            continue
        best, best_key = -1, (0.0, 0)
        for i, r in enumerate(rooms):
            fm, fc = free_m[i], free_c[i]
            if percent:
                m = percent_units(percent, r.memory_total)
            if fm >= m and fc >= c:
                key = (sign * _share(fm - m, fc - c, r.memory_total, r.compute_total), r.index)
                if best < 0 or key < best_key:
                    best, best_key = i, key
        if best < 0:
            return need
        free_m[best] -= need.memory_on(rooms[best].memory_total)
        free_c[best] -= c
        placed[need.name] = (rooms[best].uuid,)
    return Placement(placed)


def _several(need: Need, rooms: Sequence[Room], free_m: list[int], free_c: list[int], sign: int) -> list[int] | None:
    """The `need.count` distinct GPUs (positions in `rooms`) a multi-GPU container takes: of those with room for its
    slice, the ones the policy ranks first, each judged as `_one_by_one` judges one GPU; None when too few have room."""
    m, c, percent = need.memory, need.compute, need.memory_percent
    ranked = []
    for i, r in enumerate(rooms):
        fm, fc = free_m[i], free_c[i]
        if percent:
            m = percent_units(percent, r.memory_total)
        if fm >= m and fc >= c:
            ranked.append((sign * _share(fm - m, fc - c, r.memory_total, r.compute_total), r.index, i))
    if len(ranked) < need.count:
        return None
    ranked.sort()
    return [i for _, _, i in ranked[: need.count]]


def _one_gpu(needs: Sequence[Need], rooms: Sequence[Room], policy: str) -> Placement | None:
    """All containers on one GPU where every group fits by itself (pods with run-once init containers)."""
    sign = 1 if policy == PACK else -1
    best: Room | None = None
    best_key: tuple[float, int] = (0.0, 0)
    for r in rooms:
        demand = [(sum(n.memory_on(r.memory_total) for n in g), sum(n.compute for n in g)) for g in groups(needs)]
        if all(r.fits(m, c) for m, c in demand):
            key = (sign * r.free_share(max(m for m, _ in demand), max(c for _, c in demand)), r.index)
            if best is None or key < best_key:
                best, best_key = r, key
    return None if best is None else Placement({n.name: (best.uuid,) for n in needs})


def _place(needs: Sequence[Need], rooms: Sequence[Room], policy: str) -> Placement | NoFit:
    """The rule itself: a Placement, or a NoFit whose `why` names what found no room (`free` left empty)."""
    if any(n.kind == KIND_INIT for n in needs):
        several = [n for n in needs if n.count > 1]
        if several:
            return NoFit(f"the pod has init containers asking for Alnair resources, so all its Alnair containers go "
                         f"on one GPU (kubelet reuses an init container's devices), but {_label(several[0])} "
                         f"{several[0].name!r} asks for {several[0].count} GPUs", resolvable=False)
        placed = _one_gpu(needs, rooms, policy)
        if placed is not None:
            return placed
        return NoFit("the pod has init containers asking for Alnair resources, so all its Alnair containers go on "
                     f"one GPU (kubelet reuses an init container's devices), and no GPU has room for each of its "
                     f"groups: {', '.join(n.name for n in needs)}")
    steady = [n for n in needs if n.kind != KIND_INIT]
    result = _one_by_one(steady, rooms, policy)
    if isinstance(result, Need):  # the other policy may fit what this one did not
        other = _one_by_one(steady, rooms, SPREAD if policy == PACK else PACK)
        result = other if isinstance(other, Placement) else result
    if isinstance(result, Placement):
        return result
    if len(steady) == 1:
        return NoFit(_why_one(result))
    if result.count > 1:
        return NoFit(f"no {result.count} healthy GPUs of this node have room each for {_label(result)} "
                     f"{result.name!r} ({result.describe()}) after placing the other containers")
    return NoFit(f"containers {', '.join(repr(n.name) for n in steady)} do not fit the GPUs together: no room left "
                 f"for {_label(result)} {result.name!r} ({result.describe()} on one GPU) after placing the others")


@functools.lru_cache(maxsize=1024)
def _why_one(n: Need) -> str:
    """Why one container alone finds no room (the same words on every node)."""
    if n.count > 1:
        return f"no {n.count} healthy GPUs of this node have room each for {_label(n)} {n.name!r} ({n.describe()})"
    return f"no healthy GPU has room for {_label(n)} {n.name!r} ({n.describe()} on one GPU)"


@functools.lru_cache(maxsize=1024)
def _never(needs: tuple[Need, ...], totals: tuple[tuple[int, int], ...], policy: str) -> NoFit | None:
    """The NoFit for a pod that would not fit these GPUs (their (memory, compute) offered, in index order) even all
    empty, else None: preemption cannot help it. It depends only on the GPUs' sizes, which thousands of nodes share,
    so it is worked out once per pod shape and GPU set."""
    empty = [Room("", i, m, c, m, c) for i, (m, c) in enumerate(totals)]
    result = _place(needs, empty, policy)
    if not isinstance(result, NoFit):
        return None
    if not result.resolvable:
        return result
    if any(n.count > 1 for n in needs):
        return NoFit("the request is larger than this node's GPUs can hold even when empty: " + result.why, False)
    mem = max(m for m, _ in totals)
    comp = max(c for _, c in totals)
    return NoFit(f"the request is larger than any single GPU on this node can hold (largest offers {mem} memory "
                 f"+ {comp} compute units; memory and compute of a container come from one GPU): " + result.why,
                 False)


def place(needs: Sequence[Need], rooms: Sequence[Room], policy: str) -> Placement | NoFit:
    """Where each container of a pod goes on a node whose healthy GPUs have `rooms` free, by `policy`."""
    if policy not in POLICIES:
        raise ValueError(f"unknown placement policy {policy!r}")
    needs = [n for n in needs if n.asks]
    if not needs:
        return Placement({})
    if not rooms:
        return NoFit("node has no healthy GPU", resolvable=False)
    widest = max(needs, key=lambda n: n.count)
    if widest.count > len(rooms):
        return NoFit(f"{_label(widest)} {widest.name!r} asks for {widest.count} GPUs and this node has "
                     f"{len(rooms)} healthy GPU(s); a container's GPUs all come from one node", resolvable=False)
    if len(needs) == 1 and needs[0].kind != KIND_INIT:
        n = needs[0]
        if sum(1 for r in rooms if r.memory_free >= n.memory_on(r.memory_total) and r.compute_free >= n.compute
               ) < n.count:
            return _one_no_fit(n, rooms)
    result = _place(needs, rooms, policy)
    if isinstance(result, NoFit):
        never = _never(tuple(needs), tuple((r.memory_total, r.compute_total) for r in rooms), policy)
        return NoFit((never or result).why, never is None and result.resolvable, tuple(rooms))
    return result


def _one_no_fit(n: Need, rooms: Sequence[Room]) -> NoFit:
    """For a pod of one container that `n.count` GPUs cannot hold now: the NoFit `place` gives, without placing (the
    policy only decides which GPUs; whether it fits is whether `n.count` of them have room for its slice)."""
    c = n.compute
    if sum(1 for r in rooms if r.memory_total >= n.memory_on(r.memory_total) and r.compute_total >= c) >= n.count:
        return NoFit(_why_one(n), True, tuple(rooms))
    return NoFit(_why_too_big(n, max(r.memory_total for r in rooms), max(r.compute_total for r in rooms)), False,
                 tuple(rooms))


@functools.lru_cache(maxsize=1024)
def _why_too_big(n: Need, largest_memory: int, largest_compute: int) -> str:
    if n.count > 1:
        return "the request is larger than this node's GPUs can hold even when empty: " + _why_one(n)
    return (f"the request is larger than any single GPU on this node can hold (largest offers {largest_memory} "
            f"memory + {largest_compute} compute units; memory and compute of a container come from one GPU): "
            + _why_one(n))


def usage(needs: Sequence[Need], placement: Mapping[str, tuple[str, ...]],
          memory_units: Mapping[str, int] | None = None) -> dict[str, tuple[int, int]]:
    """Units a placed pod holds per GPU (memory, compute): per GPU, the largest of its groups' sums there (a
    multi-GPU container's slice on each of its GPUs). `memory_units`: the memory units each GPU offers, for
    memory asked as a percent (a GPU not in it: none)."""
    out: dict[str, tuple[int, int]] = {}
    totals = memory_units or {}
    for group in groups([n for n in needs if n.name in placement]):
        per_gpu: dict[str, list[int]] = {}
        for n in group:
            for gpu in placement[n.name]:
                m_c = per_gpu.setdefault(gpu, [0, 0])
                m_c[0] += n.memory_on(totals.get(gpu, 0)) if n.memory_percent else n.memory
                m_c[1] += n.compute
        for gpu, (m, c) in per_gpu.items():
            old = out.get(gpu, (0, 0))
            out[gpu] = (max(old[0], m), max(old[1], c))
    return out


class FreeSummary(tuple):  # a flat tuple of ints (and two parts), laid out below
    """A node's rooms digested once (per change of the node) for the many questions of filter and prioritize.

    `fitting(m, c)`, how many rooms have at least `m` memory and `c` compute free at once, takes a binary search
    and an index. One flat tuple, so that the extender's loops over thousands of nodes touch one object per node:
      [0] n rooms, [1] memory offered, [2] memory used, [3] compute offered, [4] compute used (all rooms),
      [5] `totals`, [6] `empty` (see below), [7] memory free, [8] compute free (all rooms), [9] the node's part of
      `score_added`'s numerator, 10 x (memory used x compute offered + compute used x memory offered) + memory
      offered x compute offered (None unless both are offered), [10] its denominator, 2 x the product of both,
      [11] the memory units every room offers (`memory_each`; -1 when they differ),
      [START : START + n]   every room's memory free, negated and ascending (the most free first),
      [START + n + p(p-1)/2 : + p], p = 1..n: the compute free of the p rooms with the most memory free, negated and
                            ascending (so its k-th entry is the k-th largest compute free among them).
    The rooms with `m` or more memory free are exactly such a prefix, so `fitting(m, c) >= k` is: p (how many have
    `m` free) >= k and the k-th largest compute free of those p is >= c."""

    __slots__ = ()
    START = 12

    @classmethod
    def of(cls, rooms: Sequence[Room], empty: bool = False) -> FreeSummary:
        order = sorted(rooms, key=lambda r: -r.memory_free)
        totals = tuple((r.memory_total, r.compute_total) for r in rooms)
        b, d = sum(r.memory_total for r in rooms), sum(r.compute_total for r in rooms)
        used_m, used_c = sum(r.memory_total - r.memory_free for r in rooms), sum(
            r.compute_total - r.compute_free for r in rooms)
        items: list[object] = [
            len(order), b, used_m, d, used_c, totals, None if empty else _empty_summary(totals), b - used_m,
            d - used_c, MAX_SCORE * (used_m * d + used_c * b) + b * d if b > 0 and d > 0 else None, 2 * b * d,
            totals[0][0] if totals and all(m == totals[0][0] for m, _ in totals) else -1]
        items += [-r.memory_free for r in order]
        prefix: list[int] = []
        for r in order:
            bisect.insort(prefix, -r.compute_free)
            items += prefix
        return tuple.__new__(cls, items)

    @property
    def memory_total(self) -> int:
        return self[1]

    @property
    def memory_used(self) -> int:
        return self[2]

    @property
    def compute_total(self) -> int:
        return self[3]

    @property
    def compute_used(self) -> int:
        return self[4]

    @property
    def totals(self) -> tuple[tuple[int, int], ...]:
        """Every room's (memory, compute) offered, in index order: the node empty."""
        return self[5]

    @property
    def memory_each(self) -> int:
        """The memory units every room offers; -1 when they differ (memory asked as a percent of each GPU then
        differs from GPU to GPU)."""
        return self[11]

    @property
    def empty(self) -> FreeSummary | None:
        """The same GPUs all empty (one object for every node with these GPUs); None in that summary itself."""
        return self[6]

    def fitting(self, memory: int, compute: int) -> int:
        """How many rooms have `memory` and `compute` free at once."""
        n, start = self[0], self.START
        p = bisect.bisect_right(self, -memory, start, start + n) - start
        lo = start + n + (p * (p - 1) >> 1)
        return bisect.bisect_right(self, -compute, lo, lo + p) - lo

    def holds(self, memory: int, compute: int, count: int = 1) -> bool:
        """Whether `count` distinct rooms each have `memory` and `compute` free at once (`fitting(...) >= count`,
        with an index for the count: the extender's loops write this out)."""
        n, start = self[0], self.START
        p = bisect.bisect_right(self, -memory, start, start + n) - start
        return count <= 0 or (p >= count and self[start + n + (p * (p - 1) >> 1) + count - 1] <= -compute)


def empty_summary(totals: tuple[tuple[int, int], ...]) -> FreeSummary:
    """The summary of GPUs offering `totals`, all empty: the one object every node's summary of such GPUs holds."""
    return _empty_summary(totals)


@functools.lru_cache(maxsize=256)
def _empty_summary(totals: tuple[tuple[int, int], ...]) -> FreeSummary:
    return FreeSummary.of([Room("", i, m, c, m, c) for i, (m, c) in enumerate(totals)], empty=True)


@dataclass(frozen=True)
class Shape:
    """A pod's needs with what filter and prioritize ask of them on every node, computed once per request (see
    `judge` for what the counts below tell)."""

    needs: tuple[Need, ...]
    has_init: bool
    steady_memory: int  # units the steady containers hold on the node, all their GPUs together
    steady_compute: int
    gpus: int = 1  # the most GPUs one container asks for
    each: tuple[tuple[int, int, int], ...] = ()  # (memory, compute, GPUs) of each steady container, `steady` order
    steady: tuple[Need, ...] = ()
    together: tuple[int, int, int] = (0, 0, 0)  # every steady container's slice summed, on `gpus` GPUs
    whys: tuple[str, ...] = ()  # _why_one of each steady container
    # Per GPU set (its shared empty summary, by identity: every node's summary holds its empty one, which lives as
    # long as any of them, and a Shape lives for one request) and policy: `_never`'s answer, and `apart`.
    nevers: dict[tuple[int, str], NoFit | None] = field(default_factory=dict, compare=False, hash=False, repr=False)
    aparts: dict[int, tuple[tuple[int, int, int], ...]] = field(default_factory=dict, compare=False, hash=False,
                                                                repr=False)
    # Memory asked as a percent of each GPU: the counts above do not hold it; `on` gives the shape on GPUs of one
    # size (kept here per size), and a node whose GPUs differ in size is placed.
    per_gpu: bool = False
    sized: dict[int, Shape] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @classmethod
    def of(cls, needs: Sequence[Need]) -> Shape:
        live = tuple(n for n in needs if n.asks)
        steady = tuple(n for n in live if n.kind != KIND_INIT)
        gpus = max((n.count for n in live), default=1)
        return cls(live, any(n.kind == KIND_INIT for n in live), sum(n.memory * n.count for n in steady),
                   sum(n.compute * n.count for n in steady), gpus,
                   tuple((n.memory, n.compute, n.count) for n in steady), steady,
                   (sum(n.memory for n in steady), sum(n.compute for n in steady), gpus),
                   tuple(_why_one(n) for n in steady), per_gpu=any(n.memory_percent for n in live))

    def on(self, memory_each: int) -> Shape:
        """This shape on GPUs offering `memory_each` memory units each (memory asked as a percent in units)."""
        if not self.per_gpu:
            return self
        try:
            return self.sized[memory_each]
        except KeyError:
            sized = self.sized[memory_each] = replace(Shape.of([n.on(memory_each) for n in self.needs]),
                                                      per_gpu=False)
            return sized

    def added(self, free: FreeSummary, rooms: Sequence[Room], policy: str = PACK) -> tuple[int, int]:
        """(memory, compute) units the steady containers hold on a node they fit (prioritize's score); with memory
        as a percent on GPUs of several sizes, where `policy` places them."""
        if not self.per_gpu:
            return self.steady_memory, self.steady_compute
        if free.memory_each >= 0:
            sized = self.on(free.memory_each)
            return sized.steady_memory, sized.steady_compute
        placed = place(self.needs, rooms, policy)  # GPUs of several sizes: the units depend on which GPUs
        if not isinstance(placed, Placement):
            return 0, 0
        units = {r.uuid: r.memory_total for r in rooms}
        return (sum(n.memory_on(units.get(g, 0)) for n in self.steady for g in placed.gpus.get(n.name, ())),
                self.steady_compute)

    def never(self, free: FreeSummary, policy: str) -> NoFit | None:
        """`_never` for this pod on `free`'s GPUs."""
        empty = free.empty or free
        key = (id(empty), policy)
        try:
            return self.nevers[key]
        except KeyError:
            never = self.nevers[key] = _never(self.needs, empty.totals, policy)
            return never

    def apart(self, free: FreeSummary) -> tuple[tuple[int, int, int], ...]:
        """(memory, compute, GPUs) per steady container, in the order `place` takes them on `free`'s GPUs, GPUs
        being its own count plus those of the containers placed before it (which touch at most that many)."""
        empty = free.empty or free
        try:
            return self.aparts[id(empty)]
        except KeyError:
            totals = empty.totals
            order = _largest_first(self.steady, max((m for m, _ in totals), default=0) or 1,
                                   max((c for _, c in totals), default=0) or 1)
            out, before = [], 0
            for n in order:
                out.append((n.memory, n.compute, n.count + before))
                before += n.count
            apart = self.aparts[id(empty)] = tuple(out)
            return apart

    @property
    def single(self) -> tuple[int, int, int] | None:
        """(memory, compute, GPUs) when the pod is one steady container: it fits where that many GPUs hold it."""
        return self.each[0] if len(self.each) == 1 and not self.has_init else None


class _Undecided:
    """`quick`'s answer when only placing can tell."""


UNDECIDED = _Undecided()


def quick(shape: Shape, rooms: Sequence[Room], free: FreeSummary, policy: str) -> NoFit | None | _Undecided:
    """Whether the pod fits, as `place` decides, without placing where counting tells (`judge`): None (fits), a
    NoFit, or UNDECIDED."""
    judged = judge(shape, free, policy)
    if judged is None or isinstance(judged, _Undecided):
        return judged
    return NoFit(judged[1], judged[0], tuple(rooms))


def judge(shape: Shape, free: FreeSummary, policy: str) -> tuple[bool, str] | None | _Undecided:
    """`judge_all` for one node."""
    return judge_all(shape, (free,), policy)[0]


Judged = tuple[bool, str] | None | _Undecided


def judge_all(shape: Shape, frees: Sequence[FreeSummary], policy: str) -> list[Judged]:
    """`quick` on each node's counts alone: None (fits), (resolvable, why) where it does not fit, or UNDECIDED.
    Exact, by these facts about `place` (which tries the other policy before giving up):
      - it places each container on distinct GPUs with room for it, so a container that no `count` GPUs hold alone
        makes the pod fail (and a pod of one container fits exactly where `count` GPUs hold it: the policy only
        picks which);
      - when `shape.gpus` GPUs can each hold every steady container's slice together, it succeeds: each
        container's GPUs are distinct, so the others take at most their own slice from each of those GPUs, and
        `count` of them are left with room for it (one GPU per container: whatever goes elsewhere only leaves that
        GPU more room);
      - it places the containers one by one in a fixed order (`_largest_first`), so those before one asking for k
        GPUs touch at most the sum of their GPU counts: when k more GPUs than that have room for it, k of them are
        untouched and it fits. If that holds for every container (`Shape.apart`), the pod fits.
    Whether a pod that does not fit would fit the same GPUs empty depends on their sizes only (`_never`, once per
    pod and set of GPU sizes). Filter asks this of thousands of nodes per pod, all at once: per count a binary
    search and an index (FreeSummary.holds, written out), nothing built per node."""
    if not shape.needs:
        return [None] * len(frees)
    if shape.has_init:
        return [UNDECIDED] * len(frees)  # init containers put the pod on one GPU: only placing tells
    if shape.per_gpu:  # memory as a percent: judged on each node in units of its GPUs' size
        by_size: dict[int, list[int]] = {}
        for i, f in enumerate(frees):
            by_size.setdefault(f[11], []).append(i)
        judged: list[Judged] = [UNDECIDED] * len(frees)  # GPUs of several sizes (-1): placed
        for size, where in by_size.items():
            if size >= 0:
                for i, answer in zip(where, judge_all(shape.on(size), [frees[i] for i in where], policy),
                                     strict=True):
                    judged[i] = answer
        return judged
    right = bisect.bisect_right
    start = FreeSummary.START
    gpus = shape.gpus
    each = shape.each
    out: list[Judged] = []
    add = out.append
    if len(each) == 1:
        (m, c, k), = each
        neg_m, neg_c = -m, -c
        resolvable = (True, shape.whys[0])
        for f in frees:
            n = f[0]
            if n < gpus:
                add(UNDECIDED)  # too few GPUs: place's own words
                continue
            end = start + n
            p = right(f, neg_m, start, end) - start
            if p >= k and f[end + (p * (p - 1) >> 1) + k - 1] <= neg_c:
                add(None)
                continue
            e = f[6] or f  # the same GPUs empty: the NoFit _one_no_fit gives
            end = start + e[0]
            p = right(e, neg_m, start, end) - start
            if p >= k and e[end + (p * (p - 1) >> 1) + k - 1] <= neg_c:
                add(resolvable)
                continue
            totals = f.totals
            add((False, _why_too_big(shape.steady[0], max(x for x, _ in totals), max(y for _, y in totals))))
        return out
    neg_each = [(i, -m, -c, k) for i, (m, c, k) in enumerate(each)]
    tm, tc, tk = shape.together
    alone: dict[int, list[tuple[bool, str]]] = {}  # per shared empty summary: the answer when container i has no room
    for f in frees:
        n = f[0]
        if n < gpus:
            add(UNDECIDED)
            continue
        end = start + n
        p = right(f, -tm, start, end) - start
        if p >= tk and f[end + (p * (p - 1) >> 1) + tk - 1] <= -tc:
            add(None)
            continue
        for i, neg_m, neg_c, k in neg_each:
            p = right(f, neg_m, start, end) - start
            if p < k or f[end + (p * (p - 1) >> 1) + k - 1] > neg_c:  # this container alone finds no room
                answers = alone.get(id(f[6] or f))
                if answers is None:
                    never = shape.never(f, policy)
                    answers = alone[id(f[6] or f)] = [(True, why) if never is None else (False, never.why)
                                                 for why in shape.whys]
                add(answers[i])
                break
        else:
            for m, c, k in shape.apart(f):
                p = right(f, -m, start, end) - start
                if p < k or f[end + (p * (p - 1) >> 1) + k - 1] > -c:
                    add(UNDECIDED)
                    break
            else:
                add(None)
    return out


def verdict(shape: Shape, rooms: Sequence[Room], free: FreeSummary, policy: str) -> Placement | NoFit | None:
    """`quick`, placing where it cannot tell: None (fits, where it goes not worked out), a Placement, or NoFit."""
    q = quick(shape, rooms, free, policy)
    return place(shape.needs, rooms, policy) if isinstance(q, _Undecided) else q


def score_added(added: tuple[int, int], free: FreeSummary, policy: str) -> int:
    """0..MAX_SCORE for a node the pod fits, once `added` (memory, compute) more units are in use there (its
    sidecars and regular containers): PACK favours the most used node, SPREAD the least used. Utilization is the
    mean over memory and compute of min(1, used / offered), rounded half up, in integers (exact, and cheap enough for
    thousands of nodes per request)."""
    b, d = free.memory_total, free.compute_total
    am, ac = added
    a = free.memory_used + am
    c = free.compute_used + ac
    if a > b:  # conditions, not min(): prioritize runs this for every node it is asked about
        a = b
    if c > d:
        c = d
    if b > 0 and d > 0:  # floor(10 * (a/b + c/d) / 2 + 1/2): the mean of the two shares, rounded half up
        if am <= free[7] and ac <= free[8]:  # the same, nothing capped: the node's part of it is ready
            packed = (free[9] + MAX_SCORE * (am * d + ac * b)) // free[10]
        else:
            packed = (MAX_SCORE * (a * d + c * b) + b * d) // (2 * b * d)
    elif b > 0:
        packed = (2 * MAX_SCORE * a + b) // (2 * b)
    elif d > 0:
        packed = (2 * MAX_SCORE * c + d) // (2 * d)
    else:
        packed = 0
    if packed < 0:
        packed = 0
    elif packed > MAX_SCORE:
        packed = MAX_SCORE
    return packed if policy == PACK else MAX_SCORE - packed
