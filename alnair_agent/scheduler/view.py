"""The extender's view of the cluster: each node's GPUs and free units, and which node is locked by which pod.

Fed by watches (nodes, and the pods of Alnair's scheduler profiles) and by the extender's own binds. A node's free
units are what its agent reports (`ai.centaurus.io/gpu-devices`) minus the units of the pods placed on it that the
report does not account for yet (its `pods` list): pods bound with a decision, and binds in flight. So a burst of
binds never double-books a GPU, however stale the report, and after a restart the view is rebuilt from the pods'
own decisions. A node is locked while a pod placed on it waits for admission (`alnair_agent.node.decision`).

Everything here runs on the event loop; nothing blocks. A node's summary (its rooms, digested into one flat
`fit.FreeSummary`) is kept until the node, or a pod on it, changes, or a lock on it expires or its report goes
stale; each question filter and prioritize ask (a pod's needs) keeps its answers per node until that node changes.
Measured with 5,000 nodes in bench/RESULTS.md.
"""

from __future__ import annotations

import asyncio
import heapq
import operator
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from itertools import compress, filterfalse
from typing import Any, cast

import structlog

from alnair_agent.kube.pods import PodError, PodInfo, parse_pod
from alnair_agent.node import fit
from alnair_agent.node.decision import LOCK_TTL_S, Decision
from alnair_agent.node.gpu_devices import STALE_AFTER_S, AnnotationError, NodeReport, report_of_node
from alnair_agent.scheduler.columns import NOT_JUDGED, UNDECIDED, Columns

log = structlog.get_logger(__name__)


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


@dataclass
class NodeState:
    name: str
    report: NodeReport | None
    error: str = ""  # why the report is missing or unreadable


@dataclass(frozen=True)
class Reservation:
    """A bind in flight: decided here, not yet visible in the pod watch."""

    uid: str
    namespace: str
    name: str
    needs: tuple[fit.Need, ...]
    decision: Decision


@dataclass(frozen=True)
class Summary:
    """A node as filter and prioritize see it, cached per node version."""

    rooms: tuple[fit.Room, ...] | None  # None: the node takes no Alnair pods (reason in `error`)
    error: str
    resolvable: bool
    locked_by: str  # namespace/name of the pod holding the node's lock, "" if none
    lock_expires: datetime | None
    valid_until: float = float("inf")  # epoch seconds: a lock expires or the report goes stale then
    free: fit.FreeSummary | None = None  # the rooms, digested for filter and prioritize
    # Verdicts that took placing (fit.quick could not tell), by the pod's needs (whether a pod fits does not depend
    # on its profile): kube-scheduler asks filter, then prioritize, then retries unschedulable pods. Counting
    # answers the rest faster than a lookup, and keeps nothing per node and question.
    placed: dict[tuple[fit.Need, ...], fit.NoFit | None] = field(default_factory=dict)

    def verdict(self, shape: fit.Shape, policy: str) -> fit.NoFit | None:
        """None when the pod fits here, else why not (the node must have rooms)."""
        assert self.rooms is not None and self.free is not None
        quick = fit.quick(shape, self.rooms, self.free, policy)
        if not isinstance(quick, fit._Undecided):
            return quick
        try:
            return self.placed[shape.needs]
        except KeyError:
            pass
        result = fit.place(shape.needs, self.rooms, policy)
        out = result if isinstance(result, fit.NoFit) else None
        if len(self.placed) < 16:
            self.placed[shape.needs] = out
        return out


@dataclass
class _Answers:
    """One question's answers per node: plain sets and dicts of names, so thousands of them cost the cyclic GC
    nothing (no object per node) and a lookup is one hash probe."""

    fits: set[str] = field(default_factory=set)
    fails: dict[str, tuple[bool, str]] = field(default_factory=dict)  # node -> (resolvable, why)
    packed: dict[str, int] = field(default_factory=dict)  # node the pod fits -> its score under PACK

    def forget(self, node: str) -> None:
        self.fits.discard(node)
        self.fails.pop(node, None)
        self.packed.pop(node, None)


_OPEN = bytes((NOT_JUDGED, UNDECIDED))  # the columns' codes that leave a node to `Summary.verdict`

# `scores`: a score under PACK (0..MAX_SCORE), or _NO_FIT, to the policy's score
_NO_FIT = fit.MAX_SCORE + 1
_AS_PACKED = [*range(fit.MAX_SCORE + 1), 0]
_AS_SPREAD = [*(fit.MAX_SCORE - k for k in range(fit.MAX_SCORE + 1)), 0]

MAX_QUESTIONS = 64  # questions whose answers are kept (at 5,000 nodes about 0.5 MB each)


@dataclass
class ClusterView:
    nodes: dict[str, NodeState] = field(default_factory=dict)
    pods: dict[str, PodInfo] = field(default_factory=dict)  # uid -> pod (Alnair profiles' pods)
    reservations: dict[str, Reservation] = field(default_factory=dict)
    synced: bool = False
    _on_node: dict[str, set[str]] = field(default_factory=dict)  # node -> uids placed there (pods, reservations)
    _cache: dict[str, Summary] = field(default_factory=dict)
    # The `free` of every cached summary that has rooms, by node: filter and prioritize look nodes up here, one
    # flat tuple each (fit.FreeSummary), and meet the summary itself only where counting cannot tell.
    _free: dict[str, fit.FreeSummary] = field(default_factory=dict)
    _expiring: list[tuple[float, str]] = field(default_factory=list)  # heap of (valid_until, node) of summaries
    # The same rooms laid out in columns, one field per node (`columns.Columns`): a question no node was asked yet
    # is judged for all of them at once there (the rare node whose units need more than 64 bits is not kept).
    _columns: Columns = field(default_factory=Columns)
    # Per question (a pod's needs), what the nodes asked about answered, until a node changes: a burst of replicas,
    # and prioritize after filter, ask the same question of thousands of unchanged nodes.
    _answers: OrderedDict[tuple[fit.Need, ...], _Answers] = field(default_factory=OrderedDict)
    _changed: asyncio.Condition | None = None

    # -- feeding -----------------------------------------------------------------------------------------------
    def _bump(self, node: str) -> None:
        self._cache.pop(node, None)
        self._free.pop(node, None)
        self._columns.drop(node)
        for answers in self._answers.values():
            answers.forget(node)

    def _notify(self) -> None:
        cond = self._changed
        if cond is not None:
            async def wake() -> None:
                async with cond:
                    cond.notify_all()
            loop = asyncio.get_running_loop()
            loop.create_task(wake())

    def apply_node(self, obj: Any) -> None:
        name = _name_of(obj)
        if not name:
            return
        try:
            state = NodeState(name, report_of_node(obj))
        except AnnotationError as e:
            state = NodeState(name, None, str(e))
        old = self.nodes.get(name)
        if old is None or old.report != state.report or old.error != state.error:
            self.nodes[name] = state
            self._bump(name)
            self._notify()

    def delete_node(self, name: str) -> None:
        if self.nodes.pop(name, None) is not None:
            self._bump(name)

    def replace_nodes(self, objs: Iterable[Any]) -> None:
        seen = set()
        for obj in objs:
            self.apply_node(obj)
            seen.add(_name_of(obj))
        for name in [n for n in self.nodes if n not in seen]:
            self.delete_node(name)

    def _placed_node(self, pod: PodInfo) -> str:
        if pod.decision is not None and pod.node_name == pod.decision.node:
            return pod.node_name
        return ""

    def apply_pod(self, obj: Any) -> None:
        try:
            pod = parse_pod(obj if isinstance(obj, Mapping) else {})
        except PodError as e:
            log.warning("pod_unparseable", error=str(e))
            return
        self.store_pod(pod)

    def store_pod(self, pod: PodInfo) -> None:
        old = self.pods.get(pod.uid)
        if old == pod:
            return
        self.pods[pod.uid] = pod
        for node in {self._placed_node(pod), self._placed_node(old) if old else ""} - {""}:
            self._index(pod.uid, node)
        reservation = self.reservations.get(pod.uid)
        if reservation is not None and (self._placed_node(pod) == reservation.decision.node or not pod.live):
            del self.reservations[pod.uid]  # the watch shows the bind (or the pod's end): it speaks for itself now
            self._index(pod.uid, reservation.decision.node)
        self._notify()

    def delete_pod(self, uid: str) -> None:
        old = self.pods.pop(uid, None)
        reservation = self.reservations.pop(uid, None)
        for node in {self._placed_node(old) if old else "", reservation.decision.node if reservation else ""} - {""}:
            self._index(uid, node)
        self._notify()

    def replace_pods(self, pods: Sequence[Any], selector_profile: str) -> None:
        """A fresh LIST of one profile's pods: those of the profile not in it are gone."""
        listed = set()
        for obj in pods:
            self.apply_pod(obj)
            listed.add(((obj.get("metadata") or {}).get("uid")) if isinstance(obj, Mapping) else None)
        for uid in [u for u, p in self.pods.items() if p.scheduler_name == selector_profile and u not in listed]:
            self.delete_pod(uid)

    def _index(self, uid: str, node: str) -> None:
        on = self._on_node.setdefault(node, set())
        if self._counts_on(uid, node):
            on.add(uid)
        else:
            on.discard(uid)
        self._bump(node)

    def reserve(self, reservation: Reservation) -> None:
        self.reservations[reservation.uid] = reservation
        self._on_node.setdefault(reservation.decision.node, set()).add(reservation.uid)
        self._bump(reservation.decision.node)

    def unreserve(self, uid: str) -> None:
        reservation = self.reservations.pop(uid, None)
        if reservation is not None:
            self._index(uid, reservation.decision.node)
            self._notify()

    # -- reading -----------------------------------------------------------------------------------------------
    def _counts_on(self, uid: str, node: str) -> bool:
        r = self.reservations.get(uid)
        if r is not None and r.decision.node == node:
            return True
        pod = self.pods.get(uid)
        return pod is not None and self._placed_node(pod) == node

    def _placed(self, node: str) -> list[tuple[str, str, tuple[fit.Need, ...], Decision, bool, bool]]:
        """(uid, ref, needs, decision, live, confirmed) of every pod placed on `node`."""
        out = []
        for uid in sorted(self._on_node.get(node, ())):
            r = self.reservations.get(uid)
            pod = self.pods.get(uid)
            if r is not None and r.decision.node == node:
                live = pod.live if pod is not None else True
                confirmed = pod.allocated if pod is not None else False
                out.append((uid, f"{r.namespace}/{r.name}", r.needs, r.decision, live, confirmed))
            elif pod is not None and pod.decision is not None and self._placed_node(pod) == node:
                out.append((uid, f"{pod.namespace}/{pod.name}", tuple(pod.needs()), pod.decision, pod.live,
                            pod.allocated))
        return out

    def summary(self, node: str, now: datetime | None = None) -> Summary:
        return self.summary_at(node, now.timestamp() if now is not None else time.time())

    def summary_at(self, node: str, now_ts: float) -> Summary:
        """`summary` with the time as epoch seconds (filter and prioritize ask for thousands of nodes at once)."""
        cached = self._cache.get(node)
        if cached is not None and now_ts < cached.valid_until:
            return cached
        summary = self._summarize(node, datetime.fromtimestamp(now_ts, timezone.utc))
        self._cache[node] = summary
        if summary.free is not None and summary.rooms is not None:
            self._free[node] = summary.free
            self._columns.set(node, summary.rooms, summary.free)
        else:
            self._free.pop(node, None)
            self._columns.drop(node)
        if summary.valid_until != float("inf"):
            heapq.heappush(self._expiring, (summary.valid_until, node))
        return summary

    def _summarize(self, node: str, now: datetime) -> Summary:
        state = self.nodes.get(node)
        if state is None:
            return Summary(None, "node is unknown to alnair-scheduler (not in its node watch yet)", True, "", None)
        report = state.report
        if report is None:
            return Summary(None, state.error, False, "", None)
        if report.heartbeat is not None and report.stale(now):
            age = int((now - report.heartbeat).total_seconds()) if report.heartbeat else 0
            return Summary(None, f"the node's Alnair agent has not reported for {age} s (more than {STALE_AFTER_S:.0f} "
                           "s): it takes no new pods until its agent is back", True, "", None)
        rooms = {r.uuid: r for r in report.rooms()}
        if not rooms:
            unhealthy = len(report.gpus) - len(report.healthy)
            return Summary(None, f"node has no healthy GPU ({len(report.gpus)} GPU(s), {unhealthy} unhealthy)", False,
                           "", None)
        locked_by, expires = "", None
        for uid, ref, needs, decision, live, confirmed in self._placed(node):
            if not live:
                continue
            if not confirmed and not decision.expired(now):
                locked_by = ref
                candidate = decision.decided_at + timedelta(seconds=LOCK_TTL_S)
                expires = candidate if expires is None or candidate < expires else expires
            if uid in report.pods:
                continue  # the report's free counts already subtract it
            for gpu, (m, c) in fit.usage(needs, decision.gpus, {r.uuid: r.memory_total for r in rooms.values()}).items():
                room = rooms.get(gpu)
                if room is not None:
                    rooms[gpu] = room.less(m, c)
        valid = expires.timestamp() if expires is not None else float("inf")
        if report.heartbeat is not None:
            valid = min(valid, (report.heartbeat + timedelta(seconds=STALE_AFTER_S)).timestamp())
        ordered = tuple(sorted(rooms.values(), key=lambda r: r.index))
        return Summary(ordered, "", True, locked_by, expires, valid, fit.FreeSummary.of(ordered))

    # filter and prioritize: one pass over the names kube-scheduler sends (every node: thousands). A node already
    # asked this question (same needs and profile, node unchanged) answers from `_Answers`; else `fit.judge` on its
    # FreeSummary (counting: a binary search and an index), and `Summary.verdict` (placing) only where counting
    # cannot tell. Prioritize's score (`fit.score_added`) is written out in its loop; tests/test_scheduler.py checks
    # both verbs against the fit rule over many seeds.

    def filter(self, names: Sequence[str], shape: fit.Shape, now_ts: float
               ) -> tuple[list[str], dict[str, str], dict[str, str]]:
        """(nodes the pod fits, {node: why not} where freeing GPUs would help, {node: why not} where even empty
        GPUs would not), `names` in order. A node that takes no pods at all gives its summary's error."""
        answers, errors = self._answered(names, shape, now_ts)
        fits, fails = answers.fits, answers.fails
        inside = list(map(fits.__contains__, names))
        passed = list(compress(names, inside))
        failed: dict[str, str] = {}
        unresolvable: dict[str, str] = {}
        if len(passed) < len(names):
            for name in compress(names, map(operator.not_, inside)):
                known = fails.get(name) or errors[name]
                (failed if known[0] else unresolvable)[name] = known[1]
        return passed, failed, unresolvable

    def scores(self, names: Sequence[str], shape: fit.Shape, policy: str, now_ts: float) -> list[int]:
        """Each name's score, in order (0 where the pod does not fit or the node takes no pods). Built with
        C-level maps over the names: the per-node work is in the columns (or, for the few nodes they leave, below)."""
        answers, _ = self._answered(names, shape, now_ts)
        fits, packed, frees = answers.fits, answers.packed, self._free
        todo = list(compress(names, map(fits.__contains__, names)))
        if packed:
            todo = [name for name in todo if name not in packed]
        if todo:  # the nodes' scores under PACK, all at once in columns
            columns = self._columns
            kept = [name for name in todo if name in columns.pos]
            values = columns.packed(shape, kept)
            if None in values:
                packed.update((name, value) for name, value in zip(kept, values, strict=True) if value is not None)
            else:
                packed.update(zip(kept, cast(list[int], values), strict=True))
        raw: list[int | None] = list(map(packed.get, names))  # the score under PACK; None: not known yet
        i = -1
        while True:
            try:
                i = raw.index(None, i + 1)
            except ValueError:
                break
            name = names[i]
            if name not in fits:
                raw[i] = _NO_FIT
                continue
            f = frees[name]
            if shape.per_gpu and f[11] < 0:  # GPUs of several sizes: which ones it gets depends on the profile
                raw[i] = fit.score_added(shape.added(f, self.summary_at(name, now_ts).rooms or (), policy), f,
                                         fit.PACK)  # (not kept: another profile puts the pod elsewhere)
                continue
            sized = shape.on(f[11]) if shape.per_gpu else shape  # memory as a percent: in units of its GPUs
            raw[i] = packed[name] = fit.score_added((sized.steady_memory, sized.steady_compute), f, fit.PACK)
        return list(map((_AS_PACKED if policy == fit.PACK else _AS_SPREAD).__getitem__, cast(list[int], raw)))

    def _answered(self, names: Sequence[str], shape: fit.Shape, now_ts: float
                  ) -> tuple[_Answers, dict[str, tuple[bool, str]]]:
        """The question's answers, with every node of `names` in them: judged by counting (`fit.judge_all`'s
        answers, for all the nodes not asked yet at once in `columns`), placed (`Summary.verdict`) where counting
        cannot tell. Nodes that take
        no pods at all come back apart, with their summary's error (cached with the summary).

        Whether a pod fits does not depend on its profile (`place` tries the other policy before giving up), so
        both profiles share the answers, judged under PACK: where a pod of several containers fails, the words
        name the container that PACK found no room for."""
        self._expire(now_ts)
        policy = fit.PACK
        answers = self._answers_for(shape)
        fits, fails = answers.fits, answers.fails
        errors: dict[str, tuple[bool, str]] = {}
        new = list(filterfalse(fails.__contains__, filterfalse(fits.__contains__, names))) if fits or fails else names
        if not new:
            return answers, errors
        coded = self._columns.codes(shape, new, policy)
        left: Iterable[str] = new  # placed (or their summaries' errors) below
        if coded is not None:  # sorted by answer with C-level passes over the codes (a few distinct ones)
            codes, table = coded
            for value in set(codes):
                answer = table[value]
                if answer is None:
                    fits.update(compress(new, map(value.__eq__, codes)))
                elif not isinstance(answer, fit._Undecided):
                    fails.update(dict.fromkeys(compress(new, map(value.__eq__, codes)), answer))
            # counting cannot tell, or the node is not in columns (its units need more than 64 bits, or it has no
            # summary now): its summary's verdict (`quick`: judge_all on the one node, else placing)
            left = list(compress(new, map(_OPEN.__contains__, codes)))
        for name in left:
            summary = self.summary_at(name, now_ts)
            if summary.free is None:
                errors[name] = (summary.resolvable, summary.error)
                continue
            no_fit = summary.verdict(shape, policy)
            if no_fit is None:
                fits.add(name)
            else:
                fails[name] = (no_fit.resolvable, no_fit.why)
        return answers, errors

    def _answers_for(self, shape: fit.Shape) -> _Answers:
        key = shape.needs
        answers = self._answers.get(key)
        if answers is None:
            answers = self._answers[key] = _Answers()
            while len(self._answers) > MAX_QUESTIONS:
                self._answers.popitem(last=False)
        else:
            self._answers.move_to_end(key)
        return answers

    def _expire(self, now_ts: float) -> None:
        """Drop the summaries that a lock's expiry or a stale report changes by `now_ts` (filter and prioritize
        read `_free` without looking at the time, node by node)."""
        heap = self._expiring
        while heap and heap[0][0] <= now_ts:
            _, node = heapq.heappop(heap)
            cached = self._cache.get(node)
            if cached is not None and cached.valid_until <= now_ts:
                self._bump(node)

    def warm(self) -> None:
        """Summarize every node now (after the first LIST), so the first requests find them cached."""
        now = utcnow()
        for node in self.nodes:
            self.summary(node, now)

    def locked(self, node: str, now: datetime | None = None) -> str:
        return self.summary(node, now).locked_by

    # -- waiting -----------------------------------------------------------------------------------------------
    def wake(self) -> None:
        """Have every wait_unlocked re-check now (its `stop` was set)."""
        self._notify()

    async def wait_unlocked(self, node: str, timeout: float, stop: asyncio.Event | None = None) -> bool:
        """Wait until `node` has no lock holder (re-checked on every change, at lock expiry and on `wake`); False on
        timeout or once `stop` is set. Returns with the view's condition NOT held: the caller must reserve before
        awaiting anything else."""
        if self._changed is None:
            self._changed = asyncio.Condition()
        cond = self._changed
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if stop is not None and stop.is_set():
                return False
            summary = self.summary(node)
            if not summary.locked_by:
                return True
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            until_expiry = (summary.lock_expires - utcnow()).total_seconds() if summary.lock_expires else remaining
            async with cond:
                try:
                    await asyncio.wait_for(cond.wait(), max(0.001, min(remaining, until_expiry)))
                except TimeoutError:
                    pass


def _name_of(obj: Any) -> str:
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    name = meta.get("name") if isinstance(meta, Mapping) else None
    return name if isinstance(name, str) else ""
