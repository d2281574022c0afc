"""LIST then WATCH one kind of object through kubernetes-asyncio, feeding a handler, until cancelled.

The one such loop: the agent's pod watch and the extender's nodes and pods use it. Raw JSON (no client models:
cheaper, and thousands of Node objects stay affordable), resumed from the last resourceVersion, a fresh LIST on
410 Gone, capped exponential backoff with jitter on failures (so a fleet does not retry in lockstep after an outage).

The watch stream is read here, line by line, rather than through kubernetes-asyncio's `Watch`: that class builds a
new API client (an SSL context: the system's CA bundle loaded, 50 ms of a 2-core node's event loop) for every watch
connection, and encodes and decodes every event once more to hand back a copy this loop never uses. What `Watch`
handled is kept (tests/test_reflector.py): an ERROR event or a bare Status raises ApiException with its code (410
Gone: a fresh LIST); a BOOKMARK moves the resourceVersion a reconnect resumes from, as every event's object does;
lines are cut by aiohttp's readline on the agent's own session (an event split across chunks arrives whole; the
session's 2 MiB read buffer, set by kubernetes-asyncio, holds the largest objects); the server's timeoutSeconds
ends the stream and the loop reconnects from the last version, and a read timeout or a dropped connection is a
failure retried with backoff, from the same version.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import structlog
from kubernetes_asyncio.client.exceptions import ApiException

from alnair_agent.kube.client import read_json

log = structlog.get_logger(__name__)


class WatchProtocolError(RuntimeError):
    """The API server sent something that is not a list or a watch event."""


@dataclass(frozen=True)
class ReflectorTiming:
    """How the loop retries and how long it waits; tests shorten these."""

    backoff_initial_s: float = 0.2
    backoff_max_s: float = 30.0
    watch_timeout_s: int = 300
    connect_timeout_s: float = 10.0
    list_timeout_s: float = 120.0
    min_healthy_s: float = 1.0  # a watch that ends sooner than this having delivered nothing counts as a failure


@dataclass
class Reflector:
    """`list_call(**kwargs)` is a kubernetes-asyncio list method (e.g. CoreV1Api.list_node); `on_list(items)` gets
    every LIST, `on_event(type, obj)` every ADDED/MODIFIED/DELETED event. Its logs are `<events>_listed`,
    `<events>_expired` and `<events>_failed`, with `watch=name`."""

    name: str
    list_call: Callable[..., Awaitable[Any]]
    on_list: Callable[[Sequence[Any]], None]
    on_event: Callable[[str, Mapping[str, Any]], None]
    field_selector: str | None = None
    timing: ReflectorTiming = ReflectorTiming()
    synced: asyncio.Event | None = None
    events: str = "watch"

    def __post_init__(self) -> None:
        self._rv: str | None = None
        if self.synced is None:
            self.synced = asyncio.Event()

    def _kwargs(self) -> dict[str, Any]:
        return {"field_selector": self.field_selector} if self.field_selector else {}

    async def run(self) -> None:
        backoff = self.timing.backoff_initial_s
        while True:
            try:
                if self._rv is None:
                    await self._list()
                if await self._watch():
                    backoff = self.timing.backoff_initial_s
                    continue
                failure: dict[str, Any] = {"error": "WatchEndedEarly"}
            except ApiException as e:
                if e.status == 410:
                    # our resourceVersion fell out of the API server's history: only a fresh LIST catches up
                    log.info(f"{self.events}_expired", watch=self.name, resource_version=self._rv)
                    self._rv = None
                    continue
                failure = {"error": "ApiException", "status": e.status, "reason": e.reason}
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError, WatchProtocolError) as e:
                failure = {"error": type(e).__name__, "detail": str(e)[:200]}
            delay = backoff * random.uniform(0.5, 1.0)
            log.warning(f"{self.events}_failed", watch=self.name, retry_in_s=round(delay, 3), **failure)
            await asyncio.sleep(delay)
            backoff = min(backoff * 2, self.timing.backoff_max_s)

    async def _list(self) -> None:
        resp = await self.list_call(_preload_content=False, _request_timeout=self.timing.list_timeout_s,
                                    **self._kwargs())
        body = await read_json(resp)
        if not isinstance(body, Mapping) or not isinstance(body.get("items", []), list):
            raise WatchProtocolError(f"{self.name}: the LIST answer is not a list")
        rv = (body.get("metadata") or {}).get("resourceVersion")
        if not isinstance(rv, str) or not rv:
            raise WatchProtocolError(f"{self.name}: the LIST answer has no resourceVersion")
        self.on_list(body.get("items") or [])
        self._rv = rv
        assert self.synced is not None
        self.synced.set()
        log.info(f"{self.events}_listed", watch=self.name, items=len(body.get("items") or []), resource_version=rv)

    async def _watch(self) -> bool:
        """One watch connection from `_rv`; returns when the server ends it. True if it was healthy (delivered
        events or lasted a while), so the caller resets its backoff."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        events = 0
        timeout = aiohttp.ClientTimeout(sock_connect=self.timing.connect_timeout_s,
                                        sock_read=self.timing.watch_timeout_s + self.timing.connect_timeout_s)
        resp = await self.list_call(watch=True, resource_version=self._rv, timeout_seconds=self.timing.watch_timeout_s,
                                    allow_watch_bookmarks=True, _preload_content=False, _request_timeout=timeout,
                                    **self._kwargs())
        try:
            if not 200 <= resp.status <= 299:
                await read_json(resp)  # raises ApiException with the server's Status
            while line := await resp.content.readline():  # b"": the server ended the watch (its timeout)
                self._apply(self._event(line))
                events += 1
                # A burst of buffered events is read without suspending: let the loop's other work (a kubelet call
                # waiting on the agent) run between two of them, not after the whole burst.
                await asyncio.sleep(0)
        finally:
            resp.release()
        return events > 0 or loop.time() - started >= self.timing.min_healthy_s

    def _event(self, line: bytes) -> Mapping[str, Any]:
        """One line of the stream as a watch event; an ERROR event (410 Gone: our version fell out of the history)
        or a bare Status raises ApiException with its code, anything else unreadable WatchProtocolError."""
        try:
            event = json.loads(line)
        except ValueError:
            raise WatchProtocolError(f"{self.name}: not JSON: {line[:200]!r}") from None
        if not isinstance(event, Mapping):
            raise WatchProtocolError(f"{self.name}: not a watch event: {event!r:.200}")
        if "type" not in event or "object" not in event:
            if "code" in event:  # a Status in place of an event
                raise ApiException(status=event["code"], reason=f"{event.get('reason')}: {event.get('message')}")
            raise WatchProtocolError(f"{self.name}: not a watch event: {event!r:.200}")
        obj = event["object"]
        if event["type"] == "ERROR":
            status = obj if isinstance(obj, Mapping) else {}
            raise ApiException(status=status.get("code"), reason=f"{status.get('reason')}: {status.get('message')}")
        return event

    def _apply(self, event: Mapping[str, Any]) -> None:
        kind, obj = event.get("type"), event["object"]
        if not isinstance(obj, Mapping):
            raise WatchProtocolError(f"{self.name}: not a watch event: {event!r:.200}")
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            self.on_event(kind, obj)
        elif kind != "BOOKMARK":
            raise WatchProtocolError(f"{self.name}: unknown watch event type {kind!r}")
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if isinstance(rv, str) and rv:
            self._rv = rv
