"""The pods bound to this node, kept current by LIST then WATCH.

The device plugin asks it which pod kubelet is admitting: the pods bound here that kubelet has not admitted yet,
in the order they were bound (kubelet sees the same watch order and admits pods one at a time in it). With the
extender's per-node lock there is only one (see `alnair_agent.node.decision`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
from kubernetes_asyncio.client import ApiClient, CoreV1Api

from alnair_agent.kube.pods import PodError, PodInfo, log_invalid, parse_pod
from alnair_agent.kube.reflector import Reflector, ReflectorTiming, WatchProtocolError

__all__ = ["PodWatch", "WatchProtocolError", "WatchTiming"]

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class WatchTiming(ReflectorTiming):
    """The pod watch's timing: a short backoff, since the device plugin cannot tell which pod kubelet admits while
    the watch is down (a local API server is cheap to reconnect to; the jitter keeps a fleet of agents from
    retrying in lockstep)."""

    backoff_max_s: float = 5.0
    list_timeout_s: float = 60.0


class PodWatch:
    """Service: the map uid -> PodInfo of the pods bound to `node_name`. `api=None` runs without an API server
    (ALNAIR_KUBERNETES=off): no pods, synced at once, and the device plugin allocates without pod identity."""

    def __init__(self, api: ApiClient | None, node_name: str, timing: WatchTiming = WatchTiming()) -> None:
        self._api = api
        self.node_name = node_name
        self._timing = timing
        self._pods: dict[str, PodInfo] = {}
        self._names: dict[tuple[str, str], str] = {}  # (namespace, name) -> uid: `find` without a scan
        self._synced = asyncio.Event()
        self._changed = asyncio.Event()  # replaced on every change; waiters hold the one they saw
        self._generation = 0
        self._bound: dict[str, int] = {}  # uid -> order in which the pod was first seen bound here
        self._next_bound = 0
        if api is None:
            self._synced.set()

    @classmethod
    def disabled(cls, node_name: str) -> PodWatch:
        """A watch for ALNAIR_KUBERNETES=off."""
        return cls(None, node_name)

    @property
    def enabled(self) -> bool:
        return self._api is not None

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    @property
    def generation(self) -> int:
        """Grows by one on every change of the pod map; pass it to `changed` to wait for the next change."""
        return self._generation

    # -- queries ---------------------------------------------------------------------------------------------
    def pods(self) -> list[PodInfo]:
        return list(self._pods.values())

    def get(self, uid: str) -> PodInfo | None:
        return self._pods.get(uid)

    def find(self, namespace: str, name: str) -> PodInfo | None:
        """The pod by namespace and name (pod-resources names pods this way, not by uid)."""
        uid = self._names.get((namespace, name))
        return self._pods.get(uid) if uid is not None else None

    def bound_order(self, uid: str) -> int:
        """Position of the pod in the order the watch first saw pods bound to this node (lower = earlier)."""
        return self._bound.get(uid, 1 << 62)

    # -- waiting ---------------------------------------------------------------------------------------------
    async def wait_synced(self, timeout: float | None = None) -> bool:
        """True once the first LIST has filled the map (at once without an API server); False on timeout."""
        try:
            async with asyncio.timeout(timeout):
                await self._synced.wait()
        except TimeoutError:
            return False
        return True

    async def changed(self, since: int, timeout: float | None = None) -> bool:
        """Wait until `generation` exceeds `since`; True if it did, False on timeout."""
        try:
            async with asyncio.timeout(timeout):
                while self._generation <= since:
                    await self._changed.wait()
        except TimeoutError:
            return self._generation > since
        return True

    # -- the service -----------------------------------------------------------------------------------------
    async def run(self) -> None:
        """LIST then WATCH until cancelled (the shared loop: alnair_agent.kube.reflector)."""
        if self._api is None:
            await asyncio.Event().wait()  # nothing to watch; stay up like every other service until cancelled
            return
        core = CoreV1Api(self._api)
        await Reflector("pods", core.list_pod_for_all_namespaces, self._on_list, self._on_event,
                        field_selector=f"spec.nodeName={self.node_name}", timing=self._timing, synced=self._synced,
                        events="pod_watch").run()

    # -- map updates -----------------------------------------------------------------------------------------
    def _on_list(self, items: Sequence[Any]) -> None:
        pods: dict[str, PodInfo] = {}
        for item in items:
            pod = self._parse(item)
            if pod is not None and pod.node_name == self.node_name:
                pods[pod.uid] = pod
        for pod in sorted(pods.values(), key=lambda p: (p.created_at, p.namespace, p.name)):
            old = self._pods.get(pod.uid)
            if old is None or old.invalid != pod.invalid:
                log_invalid(pod)
            self._note_bound(pod.uid)
        self._pods = pods
        self._names = {}
        for uid, p in pods.items():
            self._names.setdefault((p.namespace, p.name), uid)  # the first of a name, as a scan would find it
        self._bound = {uid: n for uid, n in self._bound.items() if uid in pods}
        self._bump()

    def _on_event(self, kind: str, obj: Mapping[str, Any]) -> None:
        if kind == "DELETED":
            uid = (obj.get("metadata") or {}).get("uid")
            if isinstance(uid, str) and (gone := self._pods.pop(uid, None)) is not None:
                self._forget_name(gone)
                self._bound.pop(uid, None)
                self._bump()
            return
        pod = self._parse(obj)
        if pod is not None:
            self._store(pod)

    def _parse(self, obj: Any) -> PodInfo | None:
        try:
            return parse_pod(obj if isinstance(obj, Mapping) else {})
        except PodError as e:
            log.warning("pod_unparseable", error=str(e))
            return None

    def _store(self, pod: PodInfo) -> None:
        old = self._pods.get(pod.uid)
        if pod.node_name != self.node_name:  # moved off this node (cannot happen once bound; be safe)
            if old is not None:
                del self._pods[pod.uid]
                self._forget_name(old)
                self._bound.pop(pod.uid, None)
                self._bump()
            return
        if old is None or old.invalid != pod.invalid:
            log_invalid(pod)
        if old != pod:
            self._pods[pod.uid] = pod
            self._names.setdefault((pod.namespace, pod.name), pod.uid)
            self._note_bound(pod.uid)
            self._bump()

    def _forget_name(self, pod: PodInfo) -> None:
        """The pod left the map: its name now finds another pod of that name still here (a StatefulSet's next one,
        seen before this one's deletion), if any."""
        key = (pod.namespace, pod.name)
        if self._names.get(key) != pod.uid:
            return
        del self._names[key]
        other = next((uid for uid, p in self._pods.items() if (p.namespace, p.name) == key), None)
        if other is not None:
            self._names[key] = other

    def _note_bound(self, uid: str) -> None:
        if uid not in self._bound:
            self._bound[uid] = self._next_bound
            self._next_bound += 1

    def _bump(self) -> None:
        self._generation += 1
        event, self._changed = self._changed, asyncio.Event()
        event.set()
