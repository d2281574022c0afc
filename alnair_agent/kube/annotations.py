"""Annotation writer: pod figures and the node's GPU inventory, written to the API server as JSON merge patches.

Other services say what an annotation should be (`set_pod`, `set_node`; None removes it); this service sends
only what changed since the last successful write, at most one patch per object per `min_interval_s` (values set
in between are coalesced into the next patch) and at most `patches_per_s` over all objects (a burst of `burst`;
client-go's QPS limit: a hundred new pods' first figures must not land on the API server, nor on the node's cores
under kubelet's calls, in one go), retries 5xx/429/connection failures with capped exponential
backoff, keeps values the server refuses (400/422) and retries them after the longest backoff, and drops a pod's
pending values with a warning on 404 (the pod is gone). `flush` returns once all that
was set before it is written: the agent removes an ended container's workspace only after its last figures are.
What a flush or an urgent set waits for skips both limits; the node's report goes before pods' figures.

kubernetes-asyncio picks strategic-merge-patch for a dict body unless told otherwise; the patch content type is
always passed explicitly as application/merge-patch+json (nodes and pods both accept it; `null` deletes a key).
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp
import structlog
from kubernetes_asyncio.client import ApiClient, CoreV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from alnair_agent.kube.client import MERGE_PATCH, read_json

log = structlog.get_logger(__name__)

_MISSING = object()  # an annotation we have never written: its value on the object is unknown
# Worth retrying: the server or the network may recover, or credentials/RBAC may be fixed (401/403).
_RETRY_STATUSES = frozenset({0, 401, 403, 408, 409, 429})


@dataclass(frozen=True)
class WriterTiming:
    """Rate limit, backoff and timeouts of the writer; tests shorten these."""

    min_interval_s: float = 2.0  # per object: at most one patch per this many seconds (flush skips the wait)
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    request_timeout_s: float = 10.0
    max_concurrent: int = 8  # patches in flight at once, over all objects
    patches_per_s: float = 20.0  # over all objects, for what no flush waits on
    burst: int = 10

    def __post_init__(self) -> None:
        if not self.patches_per_s > 0 or self.burst < 1:
            raise ValueError(f"patches_per_s must be > 0 and burst >= 1, got {self.patches_per_s}, {self.burst}")


@dataclass
class _Target:
    """One object's annotations: what is wanted, what is known written, and what still has to be sent."""

    kind: str  # "pod" | "node"
    namespace: str  # "" for the node
    name: str
    desired: dict[str, str | None] = field(default_factory=dict)
    written: dict[str, str | None] = field(default_factory=dict)
    pending: dict[str, int] = field(default_factory=dict)  # key -> sequence number of its earliest unsent set
    in_flight: dict[str, int] = field(default_factory=dict)  # the same, for the patch being sent
    flush_mark: int = 0  # changes up to here are sent without waiting for the rate limits (a flush of this pod)
    last_attempt_at: float = -math.inf
    retry_at: float = -math.inf
    backoff_s: float = 0.0

    def oldest_unwritten(self) -> int | None:
        seqs = [*self.pending.values(), *self.in_flight.values()]
        return min(seqs) if seqs else None


class AnnotationWriter:
    """Service writing annotations of this node and its pods. `api=None` (no API server) makes every call a
    no-op and `flush` return at once."""

    def __init__(self, api: ApiClient | None, node_name: str, timing: WriterTiming = WriterTiming()) -> None:
        self._api = api
        self.node_name = node_name
        self._timing = timing
        self._targets: dict[tuple[str, str, str], _Target] = {}
        self._seq = 0  # grows with every change set; flush waits for all changes up to its mark
        self._flush_mark = 0  # changes up to here are sent without waiting for the rate limit
        self._wake = asyncio.Event()  # something to send, or a flush
        self._progress = asyncio.Event()  # replaced after every finished patch; flush waiters hold the one they saw

    # -- what other services call ----------------------------------------------------------------------------
    def set_pod(self, namespace: str, name: str, annotations: Mapping[str, str | None], urgent: bool = False) -> None:
        """Want these annotation values on pod namespace/name (None: remove the annotation). `urgent` sends them
        without waiting for the rate limit (someone waits for them: the extender's node lock)."""
        self._set(("pod", namespace, name), annotations)
        if urgent and self._api is not None:
            self._flush_mark = max(self._flush_mark, self._seq)
            self._wake.set()

    def set_node(self, annotations: Mapping[str, str | None]) -> None:
        """Want these annotation values on this node (None: remove the annotation)."""
        self._set(("node", "", self.node_name), annotations)

    def forget_pod(self, namespace: str, name: str) -> None:
        """Drop all state of a pod deleted from the API (nothing more can be written to it)."""
        if self._targets.pop(("pod", namespace, name), None) is not None:
            self._notify_progress()

    def written_pod(self, namespace: str, name: str) -> dict[str, str | None]:
        """The values last written successfully to the pod (what this writer knows of it)."""
        target = self._targets.get(("pod", namespace, name))
        return dict(target.written) if target else {}

    def unwritten(self) -> int:
        """How many objects have changes not yet written."""
        return sum(1 for t in self._targets.values() if t.oldest_unwritten() is not None)

    async def flush(self, timeout: float | None = None, pod: tuple[str, str] | None = None) -> bool:
        """Wait until everything set before this call has been written (or dropped: pod gone, patch refused); with
        `pod` (namespace, name), only what was set for that pod (an unprepare waits for its own pod's last figures,
        not for every pod's). Those changes are sent without waiting for the rate limits. True when done, False on
        timeout."""
        if self._api is None:
            return True
        mark = self._seq
        if pod is None:
            self._flush_mark = max(self._flush_mark, mark)
            done = lambda: self._done_up_to(mark)  # noqa: E731 - the one condition, checked in two places
        else:
            key = ("pod", *pod)
            target = self._targets.get(key)
            if target is None:
                return True
            target.flush_mark = max(target.flush_mark, mark)

            def done() -> bool:
                if self._targets.get(key) is not target:  # dropped (pod gone) or forgotten
                    return True
                oldest = target.oldest_unwritten()
                return oldest is None or oldest > mark
        self._wake.set()
        try:
            async with asyncio.timeout(timeout):
                while not done():
                    await self._progress.wait()
        except TimeoutError:
            return done()
        return True

    # -- the service -----------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Send due patches until cancelled."""
        if self._api is None:
            await asyncio.Event().wait()  # nothing to write to; stay up like every other service until cancelled
            return
        core = CoreV1Api(self._api)
        loop = asyncio.get_running_loop()
        limit = asyncio.Semaphore(self._timing.max_concurrent)
        rate, burst = self._timing.patches_per_s, self._timing.burst
        tokens, refilled = float(burst), loop.time()
        while True:
            now = loop.time()
            tokens, refilled = min(float(burst), tokens + (now - refilled) * rate), now
            due = [t for t in self._targets.values() if t.pending and self._due_at(t) <= now]
            urgent = [t for t in due if self._flushing(t)]
            paced = sorted((t for t in due if not self._flushing(t)),
                           key=lambda t: (t.kind != "node", t.oldest_unwritten() or 0))
            taken = paced[:int(tokens)]
            tokens -= len(taken)
            if urgent or taken:
                async with asyncio.TaskGroup() as tg:
                    for target in urgent + taken:
                        tg.create_task(self._write(core, target, limit))
                continue
            waits = [at - now for t in self._targets.values() if t.pending and (at := self._due_at(t)) > now]
            if paced:  # due, but over the rate: until the next token
                waits.append((1.0 - tokens) / rate)
            self._wake.clear()
            try:
                async with asyncio.timeout(max(0.0, min(waits)) if waits else None):
                    await self._wake.wait()
            except TimeoutError:
                pass

    # -- internals -------------------------------------------------------------------------------------------
    def _set(self, key: tuple[str, str, str], annotations: Mapping[str, str | None]) -> None:
        if self._api is None:
            return
        target = self._targets.get(key)
        if target is None:
            target = self._targets[key] = _Target(*key)
        changed = False
        for name, value in annotations.items():
            if target.desired.get(name, _MISSING) == value:
                continue
            target.desired[name] = value
            self._seq += 1
            target.pending.setdefault(name, self._seq)
            changed = True
        if changed:
            self._wake.set()

    def _flushing(self, t: _Target) -> bool:
        oldest = t.oldest_unwritten()
        return oldest is not None and oldest <= max(self._flush_mark, t.flush_mark)

    def _due_at(self, t: _Target) -> float:
        if self._flushing(t):
            return t.retry_at  # a flush is waiting: skip the rate limit, never the backoff
        return max(t.last_attempt_at + self._timing.min_interval_s, t.retry_at)

    def _done_up_to(self, mark: int) -> bool:
        for t in self._targets.values():
            oldest = t.oldest_unwritten()
            if oldest is not None and oldest <= mark:
                return False
        return True

    def _notify_progress(self) -> None:
        event, self._progress = self._progress, asyncio.Event()
        event.set()

    async def _write(self, core: CoreV1Api, t: _Target, limit: asyncio.Semaphore) -> None:
        loop = asyncio.get_running_loop()
        t.in_flight, t.pending = t.pending, {}
        diff = {k: t.desired[k] for k in t.in_flight if t.written.get(k, _MISSING) != t.desired[k]}
        if not diff:  # changed back to what is already written
            t.in_flight = {}
            self._notify_progress()
            return
        where = {"kind": t.kind, "namespace": t.namespace, "name": t.name} if t.kind == "pod" else {
            "kind": t.kind, "name": t.name}
        body = {"metadata": {"annotations": diff}}
        async with limit:
            t.last_attempt_at = loop.time()
            try:
                if t.kind == "pod":
                    resp = await core.patch_namespaced_pod(
                        t.name, t.namespace, body, _content_type=MERGE_PATCH, _preload_content=False,
                        _request_timeout=self._timing.request_timeout_s)
                else:
                    resp = await core.patch_node(
                        t.name, body, _content_type=MERGE_PATCH, _preload_content=False,
                        _request_timeout=self._timing.request_timeout_s)
                await read_json(resp)
            except ApiException as e:
                status = e.status or 0
                if status == 404:
                    log.warning("annotation_target_gone", keys=sorted(diff), **where)
                    if self._targets.get((t.kind, t.namespace, t.name)) is t:
                        del self._targets[(t.kind, t.namespace, t.name)]
                    t.in_flight = {}
                elif status >= 500 or status in _RETRY_STATUSES:
                    self._retry_later(t, loop.time(), error="ApiException", status=status, reason=e.reason, **where)
                else:
                    # The server refuses this patch (e.g. 400/422: a value too large). Keep the values and try
                    # again after the longest backoff (an admission webhook or a quota may change its mind; a
                    # later value may fit), but as a new change: a flush waiting on it is done.
                    log.error("annotation_patch_rejected", status=status, reason=e.reason, keys=sorted(diff),
                              retry_in_s=self._timing.backoff_max_s, **where)
                    for key in t.in_flight:
                        self._seq += 1
                        t.pending.setdefault(key, self._seq)
                    t.in_flight = {}
                    t.backoff_s = self._timing.backoff_max_s
                    t.retry_at = loop.time() + t.backoff_s
                    self._wake.set()
            except (aiohttp.ClientError, TimeoutError, OSError) as e:
                self._retry_later(t, loop.time(), error=type(e).__name__, detail=str(e)[:200], **where)
            else:
                t.written.update(diff)
                t.in_flight = {}
                t.backoff_s = 0.0
                t.retry_at = -math.inf
                log.debug("annotations_written", keys=sorted(diff), **where)
        self._notify_progress()

    def _retry_later(self, t: _Target, now: float, **failure: object) -> None:
        for key, seq in t.in_flight.items():  # back into pending, keeping the earliest sequence number
            t.pending[key] = min(seq, t.pending.get(key, seq))
        t.in_flight = {}
        t.backoff_s = min(t.backoff_s * 2 or self._timing.backoff_initial_s, self._timing.backoff_max_s)
        # Jitter (half to all of the backoff): after an outage every node's writer must not retry in lockstep.
        delay = t.backoff_s * random.uniform(0.5, 1.0)
        t.retry_at = now + delay
        log.warning("annotation_patch_failed", retry_in_s=round(delay, 3), **failure)
        self._wake.set()
