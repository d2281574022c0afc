"""The reflector reads the watch stream itself (not kubernetes-asyncio's Watch): what that class handled must hold
here, against a server whose every byte the test writes: bookmarks move the resourceVersion a reconnect resumes
from, an event may arrive in pieces across chunks and be larger than aiohttp's default buffer, an ERROR event or a
bare Status with 410 Gone means a fresh LIST, and anything unreadable is a retried failure, not a crash."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from kubernetes_asyncio.client import ApiClient, Configuration, CoreV1Api
from service_util import running, wait_until
from structlog.testing import capture_logs

from alnair_agent.kube.reflector import Reflector, ReflectorTiming

pytestmark = pytest.mark.timeout(20)

FAST = ReflectorTiming(backoff_initial_s=0.01, backoff_max_s=0.05, watch_timeout_s=30, min_healthy_s=0.0)
Chunk = bytes | float  # bytes to send, or seconds to wait before the next piece


def line(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj).encode() + b"\n"


def pod(name: str, rv: str, **extra: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}", "resourceVersion": rv,
                         **extra}}


@dataclass
class ScriptedServer:
    """LISTs answer `list_rv` with no items; the n-th watch connection sends `watches[n]` (then ends the stream),
    and connections past the script stay open, sending nothing."""

    watches: list[Sequence[Chunk]]
    list_rv: str = "10"
    lists: int = 0
    watched_from: list[str] = field(default_factory=list)  # resourceVersion of each watch connection

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.query.get("watch", "").lower() not in ("true", "1"):
            self.lists += 1
            return web.json_response({"kind": "PodList", "metadata": {"resourceVersion": self.list_rv},
                                      "items": []})
        self.watched_from.append(request.query.get("resourceVersion", ""))
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        n = len(self.watched_from) - 1
        if n >= len(self.watches):
            await asyncio.Event().wait()  # an idle watch, until the client goes
        for piece in self.watches[n]:
            if isinstance(piece, float):
                await asyncio.sleep(piece)
            else:
                await resp.write(piece)
        await resp.write_eof()
        return resp


@pytest.fixture
async def serve() -> AsyncIterator[Any]:
    servers: list[TestServer] = []
    clients: list[ApiClient] = []

    async def start(script: ScriptedServer) -> ApiClient:
        app = web.Application()
        app.router.add_get("/api/v1/pods", script.handle)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        client = ApiClient(Configuration(host=str(server.make_url("")).rstrip("/")))
        clients.append(client)
        return client

    yield start
    for client in clients:
        await client.close()
    for server in servers:
        await server.close()


class Seen:
    def __init__(self) -> None:
        self.lists: list[Sequence[Any]] = []
        self.events: list[tuple[str, str]] = []  # (type, name)
        self.objects: list[Mapping[str, Any]] = []

    def on_list(self, items: Sequence[Any]) -> None:
        self.lists.append(items)

    def on_event(self, kind: str, obj: Mapping[str, Any]) -> None:
        self.events.append((kind, obj["metadata"]["name"]))
        self.objects.append(obj)


def reflector(client: ApiClient, seen: Seen) -> Reflector:
    return Reflector("pods", CoreV1Api(client).list_pod_for_all_namespaces, seen.on_list, seen.on_event, timing=FAST)


async def test_a_bookmark_moves_the_version_a_reconnect_resumes_from(serve: Any) -> None:
    script = ScriptedServer([
        [line({"type": "ADDED", "object": pod("a", "11")}),
         line({"type": "BOOKMARK", "object": {"kind": "Pod", "metadata": {"resourceVersion": "42"}}})],
        [line({"type": "MODIFIED", "object": pod("a", "43")})],
    ])
    seen = Seen()
    async with running(reflector(await serve(script), seen).run()):
        await wait_until(lambda: len(script.watched_from) >= 3)
    assert script.watched_from[:3] == ["10", "42", "43"]
    assert seen.events == [("ADDED", "a"), ("MODIFIED", "a")]  # a bookmark is no event for the handler
    assert script.lists == 1


async def test_an_event_in_pieces_and_larger_than_aiohttps_default_buffer_arrives_whole(serve: Any) -> None:
    big = pod("big", "12", annotations={"note": "x" * (300 << 10)})  # over aiohttp's 64 KiB (128 KiB line) default
    raw = line({"type": "ADDED", "object": big})
    pieces: list[Chunk] = [line({"type": "ADDED", "object": pod("a", "11")})[:7], 0.05]
    pieces += [line({"type": "ADDED", "object": pod("a", "11")})[7:] + raw[:1000], 0.05]
    pieces += [raw[i:i + (50 << 10)] for i in range(1000, len(raw), 50 << 10)]
    script = ScriptedServer([pieces])
    seen = Seen()
    async with running(reflector(await serve(script), seen).run()):
        await wait_until(lambda: len(script.watched_from) >= 2)
    assert seen.events == [("ADDED", "a"), ("ADDED", "big")]
    assert seen.objects[1] == big
    assert script.watched_from[1] == "12"


@pytest.mark.parametrize("gone", [
    {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}},
    {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"},  # a bare Status, no event
])
async def test_410_gone_in_the_stream_relists(serve: Any, gone: dict[str, Any]) -> None:
    script = ScriptedServer([[line({"type": "ADDED", "object": pod("a", "11")}), line(gone)]], list_rv="50")
    seen = Seen()
    with capture_logs() as logs:
        async with running(reflector(await serve(script), seen).run()):
            await wait_until(lambda: len(script.watched_from) >= 2)
    assert script.lists == 2  # a fresh LIST, watched from its version (not resumed from "11", the last event's)
    assert script.watched_from[:2] == ["50", "50"]
    assert any(e["event"] == "watch_expired" for e in logs)


async def test_an_error_event_other_than_gone_is_retried_from_the_same_version(serve: Any) -> None:
    script = ScriptedServer([
        [line({"type": "ADDED", "object": pod("a", "11")}),
         line({"type": "ERROR", "object": {"kind": "Status", "code": 500, "reason": "InternalError",
                                           "message": "etcd"}})],
    ])
    seen = Seen()
    with capture_logs() as logs:
        async with running(reflector(await serve(script), seen).run()):
            await wait_until(lambda: len(script.watched_from) >= 2)
    assert script.lists == 1 and script.watched_from[:2] == ["10", "11"]
    assert [e.get("status") for e in logs if e["event"] == "watch_failed"] == [500]


@pytest.mark.parametrize("garbage", [b"not json\n", b"[1, 2]\n", b'{"type": "ADDED"}\n',
                                     line({"type": "SURPRISE", "object": pod("a", "12")}),
                                     line({"type": "ADDED", "object": "a string"}),
                                     b'{"type": "ADDED", "object": {"metadata": '])  # cut short: EOF mid-line
async def test_an_unreadable_line_is_a_retried_failure_not_a_crash(serve: Any, garbage: bytes) -> None:
    script = ScriptedServer([[line({"type": "ADDED", "object": pod("a", "11")}), garbage]])
    seen = Seen()
    with capture_logs() as logs:
        async with running(reflector(await serve(script), seen).run()):
            await wait_until(lambda: len(script.watched_from) >= 2)
    assert script.watched_from[:2] == ["10", "11"]  # resumed after what was read, no relist
    assert [e.get("error") for e in logs if e["event"] == "watch_failed"] == ["WatchProtocolError"]
