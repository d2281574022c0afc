"""The pods bound to this node, kept current by LIST then WATCH.

The device plugin asks it which pod kubelet is admitting: the pods bound here that kubelet has not admitted yet,
in the order they were bound (kubelet sees the same watch order and admits pods one at a time in it). With the
extender's per-node lock there is only one (see `alnair_agent.node.decision`).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import structlog
from kubernetes_asyncio import watch
from kubernetes_asyncio.client import ApiClient, CoreV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from alnair_agent.kube.client import read_json
from alnair_agent.kube.pods import PodError, PodInfo, log_invalid, parse_pod

log = structlog.get_logger(__name__)


class WatchProtocolError(RuntimeError):
    """The API server sent something that is not a watch event."""


@dataclass(frozen=True)
class WatchTiming:
    """How the watch retries and how long it waits; tests shorten these."""

    backoff_initial_s: float = 0.2
    # Short: the device plugin cannot tell which pod kubelet admits while the watch is down (a local API server is
    # cheap to reconnect to; the jitter keeps a fleet of agents from retrying in lockstep).
    backoff_max_s: float = 5.0
    watch_timeout_s: int = 300  # server-side: the API server ends each watch after this; it is then resumed
    connect_timeout_s: float = 10.0
    list_timeout_s: float = 60.0
    min_healthy_s: float = 1.0  # a watch that ends sooner than this having delivered nothing counts as a failure


class PodWatch:
    """Service: the map uid -> PodInfo of the pods bound to `node_name`. `api=None` runs without an API server
    (ALNAIR_KUBERNETES=off): no pods, synced at once, and the device plugin allocates without pod identity."""

    def __init__(self, api: ApiClient | None, node_name: str, timing: WatchTiming = WatchTiming()) -> None:
        self._api = api
        self.node_name = node_name
        self._timing = timing
        self._pods: dict[str, PodInfo] = {}
        self._rv: str | None = None  # resourceVersion to resume from; None: LIST first
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
        for pod in self._pods.values():
            if pod.namespace == namespace and pod.name == name:
                return pod
        return None

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
        """LIST then WATCH until cancelled; re-LIST on 410 Gone; back off (capped, doubling) on failures."""
        if self._api is None:
            await asyncio.Event().wait()  # nothing to watch; stay up like every other service until cancelled
            return
        core = CoreV1Api(self._api)
        backoff = self._timing.backoff_initial_s
        while True:
            try:
                if self._rv is None:
                    await self._list(core)
                healthy = await self._watch(core)
                if healthy:
                    backoff = self._timing.backoff_initial_s
                    continue
                failure: dict[str, Any] = {"error": "WatchEndedEarly"}
            except ApiException as e:
                if e.status == 410:
                    # Our resourceVersion fell out of the API server's history: only a fresh LIST catches up.
                    log.info("pod_watch_expired", resource_version=self._rv)
                    self._rv = None
                    continue
                failure = {"error": "ApiException", "status": e.status, "reason": e.reason}
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError, WatchProtocolError) as e:
                failure = {"error": type(e).__name__, "detail": str(e)[:200]}
            delay = backoff * random.uniform(0.5, 1.0)  # jitter: nodes must not retry in lockstep after an outage
            log.warning("pod_watch_failed", retry_in_s=round(delay, 3), **failure)
            await asyncio.sleep(delay)
            backoff = min(backoff * 2, self._timing.backoff_max_s)

    async def _list(self, core: CoreV1Api) -> None:
        resp = await core.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={self.node_name}",
            _preload_content=False,
            _request_timeout=self._timing.list_timeout_s,
        )
        body = await read_json(resp)
        if not isinstance(body, Mapping) or not isinstance(body.get("items", []), list):
            raise WatchProtocolError("pod list is not a PodList")
        pods: dict[str, PodInfo] = {}
        for item in body.get("items") or []:
            pod = self._parse(item)
            if pod is not None and pod.node_name == self.node_name:
                pods[pod.uid] = pod
        rv = (body.get("metadata") or {}).get("resourceVersion")
        if not isinstance(rv, str) or not rv:
            raise WatchProtocolError("pod list has no resourceVersion")
        for pod in sorted(pods.values(), key=lambda p: (p.created_at, p.namespace, p.name)):
            old = self._pods.get(pod.uid)
            if old is None or old.invalid != pod.invalid:
                log_invalid(pod)
            self._note_bound(pod.uid)
        self._pods = pods
        self._bound = {uid: n for uid, n in self._bound.items() if uid in pods}
        self._rv = rv
        self._bump()
        self._synced.set()
        log.info("pod_watch_listed", pods=len(pods), resource_version=rv)

    async def _watch(self, core: CoreV1Api) -> bool:
        """One watch connection from `_rv`; returns when the server ends it. True if it was healthy (delivered
        events or lasted a while), so the caller resets its backoff."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        events = 0
        timeout = aiohttp.ClientTimeout(
            sock_connect=self._timing.connect_timeout_s,
            # A half-dead connection delivers nothing: give up a little after the server should have ended it.
            sock_read=self._timing.watch_timeout_s + self._timing.connect_timeout_s,
        )
        async with watch.Watch(return_type="object") as w:  # "object": events carry the pod's JSON dict
            stream = w.stream(
                core.list_pod_for_all_namespaces,
                field_selector=f"spec.nodeName={self.node_name}",
                resource_version=self._rv,
                timeout_seconds=self._timing.watch_timeout_s,
                allow_watch_bookmarks=True,
                _request_timeout=timeout,
            )
            try:
                async for event in stream:
                    self._apply(event)
                    events += 1
            except ApiException:
                raise
            except Exception as e:
                # kubernetes-asyncio's Watch signals a malformed event with a bare Exception; that is the API
                # server's (or a proxy's) fault, so it is retried like a dropped connection, not a crash.
                if type(e) is not Exception:
                    raise
                raise WatchProtocolError(str(e)[:200]) from None
        log.debug("pod_watch_ended", events=events, resource_version=self._rv)
        return events > 0 or loop.time() - started >= self._timing.min_healthy_s

    # -- map updates -----------------------------------------------------------------------------------------
    def _apply(self, event: Any) -> None:
        if not isinstance(event, Mapping) or not isinstance(event.get("raw_object"), Mapping):
            raise WatchProtocolError(f"not a watch event: {event!r:.200}")
        kind, obj = event.get("type"), event["raw_object"]
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if kind in ("ADDED", "MODIFIED"):
            pod = self._parse(obj)
            if pod is not None:
                self._store(pod)
        elif kind == "DELETED":
            uid = (obj.get("metadata") or {}).get("uid")
            if isinstance(uid, str) and self._pods.pop(uid, None) is not None:
                self._bound.pop(uid, None)
                self._bump()
        elif kind != "BOOKMARK":
            raise WatchProtocolError(f"unknown watch event type {kind!r}")
        if isinstance(rv, str) and rv:
            self._rv = rv

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
                self._bound.pop(pod.uid, None)
                self._bump()
            return
        if old is None or old.invalid != pod.invalid:
            log_invalid(pod)
        if old != pod:
            self._pods[pod.uid] = pod
            self._note_bound(pod.uid)
            self._bump()

    def _note_bound(self, uid: str) -> None:
        if uid not in self._bound:
            self._bound[uid] = self._next_bound
            self._next_bound += 1

    def _bump(self) -> None:
        self._generation += 1
        event, self._changed = self._changed, asyncio.Event()
        event.set()
