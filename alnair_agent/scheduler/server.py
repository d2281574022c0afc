"""The extender's HTTP side (aiohttp): POST /filter, POST /prioritize, GET /healthz.

Every POST is answered 200 with a body kube-scheduler can decode: a failure (a body that is not JSON, a missing
Pod, a malformed quantity, even a bug) goes into the filter answer's `Error`, or gives zero scores and a log line
for prioritize. Decoding, judging and encoding run in a worker thread: kube-scheduler may send thousands of Node
objects (megabytes of JSON), and the event loop keeps answering /healthz and other requests meanwhile.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web

from alnair_agent.scheduler.extender import FilterResult, PrioritizeResult, filter_nodes, prioritize_nodes

log = structlog.get_logger(__name__)

MAX_BODY_BYTES = 256 * 1024 * 1024  # a NodeList of 5000 nodes is tens of MiB; aiohttp's default is 1 MiB
SHUTDOWN_TIMEOUT_S = 10.0  # on SIGTERM, how long requests in flight may take to finish


@dataclass(frozen=True)
class Answer:
    body: bytes  # the JSON kube-scheduler gets
    pod: str
    error: str
    summary: dict[str, Any]  # what the log line says


def _decode(body: bytes) -> Any:
    return json.loads(body)


def _encode(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def answer_filter(body: bytes) -> Answer:
    """Bytes in, bytes out; never raises."""
    try:
        result = filter_nodes(_decode(body))
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        result = FilterResult(error=f"request body is not JSON ExtenderArgs: {e}")
    except Exception as e:  # a bug must not take kube-scheduler's request down with it
        log.exception("filter_failed")
        result = FilterResult(error=f"alnair-scheduler internal error: {type(e).__name__}: {e}")
    passed = result.nodes if result.nodes is not None else result.node_names or []
    summary = {"passed": len(passed), "failed": len(result.failed), "unresolvable": len(result.unresolvable)}
    if result.failed or result.unresolvable:
        log.debug("filter_reasons", pod=result.pod, failed=result.failed, unresolvable=result.unresolvable)
    return Answer(_encode(result.to_json()), result.pod, result.error, summary)


def answer_prioritize(body: bytes) -> Answer:
    """Bytes in, bytes out; never raises."""
    try:
        result = prioritize_nodes(_decode(body))
    except ValueError as e:
        result = PrioritizeResult(error=f"request body is not JSON ExtenderArgs: {e}")
    except Exception as e:
        log.exception("prioritize_failed")
        result = PrioritizeResult(error=f"alnair-scheduler internal error: {type(e).__name__}: {e}")
    best = max(result.hosts, key=lambda h: h.score, default=None)
    summary = {"nodes": len(result.hosts), "best": best.host if best else "", "best_score": best.score if best else 0}
    log.debug("prioritize_scores", pod=result.pod, scores={h.host: h.score for h in result.hosts})
    return Answer(_encode(result.to_json()), result.pod, result.error, summary)


def _json(body: bytes) -> web.Response:
    return web.Response(body=body, content_type="application/json")


async def _read(request: web.Request) -> bytes | str:
    """The body, or why it could not be read (too large, connection trouble)."""
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        return f"request body larger than {MAX_BODY_BYTES} bytes"
    except Exception as e:
        return f"request body could not be read: {type(e).__name__}: {e}"


async def _filter(request: web.Request) -> web.Response:
    body = await _read(request)
    if isinstance(body, str):
        answer = Answer(_encode(FilterResult(error=body).to_json()), "", body, {})
    else:
        answer = await asyncio.to_thread(answer_filter, body)
    if answer.error:
        log.warning("filter_error", pod=answer.pod, error=answer.error)
    else:
        log.info("filter", pod=answer.pod, **answer.summary)
    return _json(answer.body)


async def _prioritize(request: web.Request) -> web.Response:
    body = await _read(request)
    if isinstance(body, str):
        answer = Answer(_encode([]), "", body, {})
    else:
        answer = await asyncio.to_thread(answer_prioritize, body)
    if answer.error:
        log.warning("prioritize_error", pod=answer.pod, error=answer.error, **answer.summary)
    else:
        log.info("prioritize", pod=answer.pod, **answer.summary)
    return _json(answer.body)


async def _healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


def build_app() -> web.Application:
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_post("/filter", _filter)
    app.router.add_post("/prioritize", _prioritize)
    app.router.add_get("/healthz", _healthz)
    return app


async def serve(host: str, port: int, stop: asyncio.Event) -> None:
    """Listen until `stop` is set, then stop accepting, let requests in flight finish, and return."""
    runner = web.AppRunner(build_app(), access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, shutdown_timeout=SHUTDOWN_TIMEOUT_S).start()
        addresses = [f"{a[0]}:{a[1]}" for a in runner.addresses if isinstance(a, tuple)]
        log.info("scheduler_listening", addresses=addresses)
        await stop.wait()
        log.info("scheduler_stopping")
    finally:
        await runner.cleanup()
