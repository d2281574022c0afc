"""The extender's view of the cluster: each node's GPUs and free units, and which node is locked by which pod.

Fed by watches (nodes, and the pods of Alnair's scheduler profiles) and by the extender's own binds. A node's free
units are what its agent reports (`ai.centaurus.io/gpu-devices`) minus the units of the pods placed on it that the
report does not account for yet (its `pods` list): pods bound with a decision, and binds in flight. So a burst of
binds never double-books a GPU, however stale the report, and after a restart the view is rebuilt from the pods'
own decisions. A node is locked while a pod placed on it waits for admission (`alnair_agent.node.decision`).

Everything here runs on the event loop; nothing blocks. Per-node summaries are cached by a version number that
every change of the node, or of a pod on it, bumps.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import structlog

from alnair_agent.kube.pods import PodError, PodInfo, parse_pod
from alnair_agent.node import fit
from alnair_agent.node.decision import LOCK_TTL_S, Decision
from alnair_agent.node.gpu_devices import STALE_AFTER_S, AnnotationError, NodeReport, report_of_node

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
    # Verdicts of the fit rule on this state, by Shape.key (whether a pod fits does not depend on its profile):
    # kube-scheduler asks filter, then prioritize, then retries unschedulable pods, and a burst of replicas asks
    # the same question of every unchanged node.
    verdicts: dict[int, fit.NoFit | None] = field(default_factory=dict)

    def verdict(self, shape: fit.Shape, policy: str) -> fit.NoFit | None:
        """None when the pod fits here, else why not (the node must have rooms)."""
        key = shape.key
        try:
            return self.verdicts[key]
        except KeyError:
            pass
        assert self.rooms is not None and self.free is not None
        result = fit.verdict(shape, self.rooms, self.free, policy)
        out = result if isinstance(result, fit.NoFit) else None
        if len(self.verdicts) < 64:
            self.verdicts[key] = out
        return out


@dataclass
class ClusterView:
    nodes: dict[str, NodeState] = field(default_factory=dict)
    pods: dict[str, PodInfo] = field(default_factory=dict)  # uid -> pod (Alnair profiles' pods)
    reservations: dict[str, Reservation] = field(default_factory=dict)
    synced: bool = False
    _on_node: dict[str, set[str]] = field(default_factory=dict)  # node -> uids placed there (pods, reservations)
    _cache: dict[str, Summary] = field(default_factory=dict)
    # Per question (a pod shape, and for scores a profile): node -> (answer, valid until). A burst of replicas asks
    # the same question of thousands of nodes of which one changed since: answers are dropped per node on change.
    _answers: OrderedDict[tuple[Any, ...], dict[str, tuple[Any, float]]] = field(default_factory=OrderedDict)
    _changed: asyncio.Condition | None = None

    # -- feeding -----------------------------------------------------------------------------------------------
    def _bump(self, node: str) -> None:
        self._cache.pop(node, None)
        for answers in self._answers.values():
            answers.pop(node, None)

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
            for gpu, (m, c) in fit.usage(needs, decision.gpus).items():
                room = rooms.get(gpu)
                if room is not None:
                    rooms[gpu] = room.less(m, c)
        valid = expires.timestamp() if expires is not None else float("inf")
        if report.heartbeat is not None:
            valid = min(valid, (report.heartbeat + timedelta(seconds=STALE_AFTER_S)).timestamp())
        ordered = tuple(sorted(rooms.values(), key=lambda r: r.index))
        return Summary(ordered, "", True, locked_by, expires, valid, fit.FreeSummary.of(ordered))

    def _answers_for(self, key: tuple[Any, ...]) -> dict[str, tuple[Any, float]]:
        answers = self._answers.get(key)
        if answers is None:
            answers = self._answers[key] = {}
            while len(self._answers) > MAX_QUESTIONS:
                self._answers.popitem(last=False)
        else:
            self._answers.move_to_end(key)
        return answers

    def fits_on(self, names: Sequence[str], shape: fit.Shape, policy: str, now_ts: float
                ) -> list[tuple[str, Summary | None, fit.NoFit | None]]:
        """(node, summary or None when cached, why not) for each name; `why not` None = fits. A node that takes no
        pods comes with its summary (its error says why)."""
        answers = self._answers_for(("fits", shape.key))
        out: list[tuple[str, Summary | None, fit.NoFit | None]] = []
        for name in names:
            hit = answers.get(name)
            if hit is not None and now_ts < hit[1]:
                out.append((name, None, hit[0]))
                continue
            summary = self.summary_at(name, now_ts)
            if summary.rooms is None or summary.free is None:
                out.append((name, summary, None))
                continue
            no_fit = summary.verdict(shape, policy)
            answers[name] = (no_fit, summary.valid_until)
            out.append((name, None, no_fit))
        return out

    def scores_on(self, names: Sequence[str], shape: fit.Shape, policy: str, now_ts: float) -> list[tuple[str, int]]:
        """(node, score) for each name (0 where the pod does not fit or the node takes no pods)."""
        answers = self._answers_for(("score", shape.key, policy))
        fits = self._answers.get(("fits", shape.key), {})  # filter's answers, usually there for these very nodes
        added = (shape.steady_memory, shape.steady_compute)
        out = []
        for name in names:
            hit = answers.get(name)
            if hit is not None and now_ts < hit[1]:
                out.append((name, hit[0]))
                continue
            summary = self.summary_at(name, now_ts)
            free = summary.free
            if free is None:
                value = 0
            else:
                known = fits.get(name)
                no_fit = known[0] if known is not None and now_ts < known[1] else summary.verdict(shape, policy)
                value = 0 if no_fit is not None else fit.score_added(added, free, policy)
            answers[name] = (value, summary.valid_until)
            out.append((name, value))
        return out

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


MAX_QUESTIONS = 32  # pod shapes (and profiles) whose per-node answers are kept


def _name_of(obj: Any) -> str:
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    name = meta.get("name") if isinstance(meta, Mapping) else None
    return name if isinstance(name, str) else ""
