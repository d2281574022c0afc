"""The extender's HTTP side (aiohttp): POST /filter, /prioritize, /bind on the verbs' address (kube-scheduler in
the same pod: 127.0.0.1), and GET /healthz (process up) and /readyz (node and pod watches synced) on a health port
of its own, bound to every address so kubelet's probes reach it.

Every POST is answered 200 with a body kube-scheduler can decode: a failure (a body that is not JSON, a missing
Pod, a malformed quantity, even a bug) goes into the answer's `Error`, or gives zero scores and a log line for
prioritize. The verbs run on the event loop against the in-memory view (they only read it, in well under the
time a request takes to arrive); bind awaits the API server.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web

from alnair_agent import http_stop
from alnair_agent.scheduler.bind import Binder
from alnair_agent.scheduler.dra import DraView, prioritize_dra
from alnair_agent.scheduler.extender import FilterResult, PrioritizeResult, filter_nodes, prioritize_nodes
from alnair_agent.scheduler.view import ClusterView

log = structlog.get_logger(__name__)

MAX_BODY_BYTES = 256 * 1024 * 1024  # a kube-scheduler not node-cache-capable sends whole NodeLists (tens of MiB)
# On SIGTERM binds waiting for a node's lock are answered at once; this is how long the requests still in flight
# (a bind's API calls, normally milliseconds) may take before they are cancelled: the process exits within 2 s.
SHUTDOWN_TIMEOUT_S = 1.0
VIEW_KEY = web.AppKey("view", ClusterView)
BINDER_KEY = web.AppKey("binder", Binder)
DRA_VIEW_KEY = web.AppKey("dra_view", DraView)


@dataclass(frozen=True)
class Answer:
    body: bytes  # the JSON kube-scheduler gets
    pod: str
    error: str
    summary: dict[str, Any]  # what the log line says


def _encode(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def answer_filter(body: bytes, view: ClusterView) -> Answer:
    """Bytes in, bytes out; never raises."""
    try:
        result = filter_nodes(json.loads(body), view)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        result = FilterResult(error=f"request body is not JSON ExtenderArgs: {e}")
    except Exception as e:  # a bug must not take kube-scheduler's request down with it
        log.exception("filter_failed")
        result = FilterResult(error=f"alnair-scheduler internal error: {type(e).__name__}: {e}")
    summary = {"passed": len(result.node_names or []), "failed": len(result.failed),
               "unresolvable": len(result.unresolvable)}
    if result.failed or result.unresolvable:
        log.debug("filter_reasons", pod=result.pod, failed=result.failed, unresolvable=result.unresolvable)
    return Answer(result.encode(), result.pod, result.error, summary)


def answer_prioritize(body: bytes, view: ClusterView) -> Answer:
    """Bytes in, bytes out; never raises."""
    return _answer_scores(body, lambda args: prioritize_nodes(args, view), "prioritize_failed")


def answer_prioritize_dra(body: bytes, view: DraView) -> Answer:
    """Bytes in, bytes out; never raises (the DRA pods' profiles: alnair_agent.scheduler.dra)."""
    return _answer_scores(body, lambda args: prioritize_dra(args, view), "prioritize_dra_failed")


def _answer_scores(body: bytes, verb: Callable[[Any], PrioritizeResult], failed: str) -> Answer:
    try:
        result = verb(json.loads(body))
    except ValueError as e:
        result = PrioritizeResult(error=f"request body is not JSON ExtenderArgs: {e}")
    except Exception as e:
        log.exception(failed)
        result = PrioritizeResult(error=f"alnair-scheduler internal error: {type(e).__name__}: {e}")
    best = result.best()
    summary = {"nodes": len(result.hosts), "best": best[0] if best else "", "best_score": best[1] if best else 0}
    return Answer(result.encode(), result.pod, result.error, summary)


def _json(body: bytes, started: float | None = None) -> web.Response:
    """The answer; with `started`, a Server-Timing header says how long the verb took here (decode, judge,
    encode), apart from the network and the caller."""
    headers = {}
    if started is not None:
        headers["Server-Timing"] = f"verb;dur={(time.perf_counter() - started) * 1e3:.3f}"
    return web.Response(body=body, content_type="application/json", headers=headers)


async def _read(request: web.Request) -> bytes | str:
    """The body, or why it could not be read (too large, connection trouble)."""
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        return f"request body larger than {MAX_BODY_BYTES} bytes"
    except Exception as e:  # noqa: BLE001 - any unreadable body is an Error answer, never a crash or a non-200
        return f"request body could not be read: {type(e).__name__}: {e}"


async def _filter(request: web.Request) -> web.Response:
    body = await _read(request)
    started = time.perf_counter()
    if isinstance(body, str):
        answer = Answer(_encode(FilterResult(error=body).to_json()), "", body, {})
    else:
        answer = answer_filter(body, request.app[VIEW_KEY])
    if answer.error:
        log.warning("filter_error", pod=answer.pod, error=answer.error)
    else:
        log.info("filter", pod=answer.pod, **answer.summary)
    return _json(answer.body, started)


async def _prioritize(request: web.Request) -> web.Response:
    return await _scores(request, "prioritize", lambda body: answer_prioritize(body, request.app[VIEW_KEY]))


async def _prioritize_dra(request: web.Request) -> web.Response:
    return await _scores(request, "prioritize_dra",
                         lambda body: answer_prioritize_dra(body, request.app.get(DRA_VIEW_KEY) or DraView()))


async def _scores(request: web.Request, event: str, answer_of: Callable[[bytes], Answer]) -> web.Response:
    body = await _read(request)
    started = time.perf_counter()
    answer = Answer(_encode([]), "", body, {}) if isinstance(body, str) else answer_of(body)
    if answer.error:
        log.warning(f"{event}_error", pod=answer.pod, error=answer.error, **answer.summary)
    else:
        log.info(event, pod=answer.pod, **answer.summary)
    return _json(answer.body, started)


async def _bind(request: web.Request) -> web.Response:
    body = await _read(request)
    started = time.perf_counter()
    if isinstance(body, str):
        error = body
    else:
        try:
            args = json.loads(body)
        except ValueError as e:
            error = f"request body is not JSON ExtenderBindingArgs: {e}"
        else:
            binder = request.app.get(BINDER_KEY)
            if binder is None:
                error = "alnair-scheduler runs without an API server (--kubernetes off) and cannot bind"
            else:
                try:
                    error = await binder.bind(args)
                except Exception as e:  # a bug must not take kube-scheduler's request down with it
                    log.exception("bind_failed")
                    error = f"alnair-scheduler internal error: {type(e).__name__}: {e}"
    if error:
        log.warning("bind_error", error=error)
    return _json(_encode({"Error": error}), started)


async def _healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


async def _readyz(request: web.Request) -> web.Response:
    if request.app[VIEW_KEY].synced:
        return web.Response(text="ok\n")
    return web.Response(status=503, text="node and pod watches not synced yet\n")


def build_app(view: ClusterView, binder: Binder | None = None, dra_view: DraView | None = None) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[VIEW_KEY] = view
    if binder is not None:
        app[BINDER_KEY] = binder
    if dra_view is not None:
        app[DRA_VIEW_KEY] = dra_view
    app.router.add_post("/filter", _filter)
    app.router.add_post("/prioritize", _prioritize)
    app.router.add_post("/prioritize-dra", _prioritize_dra)
    app.router.add_post("/bind", _bind)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    return app


def build_health_app(view: ClusterView) -> web.Application:
    app = web.Application()
    app[VIEW_KEY] = view
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    return app


async def serve(host: str, port: int, stop: asyncio.Event, view: ClusterView, binder: Binder | None = None,
                health_port: int | None = None, dra_view: DraView | None = None) -> None:
    """Listen until `stop` is set or the task is cancelled, then answer every bind waiting for a node's lock with an
    Error (kube-scheduler retries it), stop accepting, let the requests in flight finish (at most
    SHUTDOWN_TIMEOUT_S), and return."""
    runners = [web.AppRunner(build_app(view, binder, dra_view), access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)]
    if health_port is not None:
        runners.append(web.AppRunner(build_health_app(view), access_log=None))
    try:
        for runner in runners:
            await runner.setup()
        await web.TCPSite(runners[0], host, port).start()
        if health_port is not None:
            await web.TCPSite(runners[1], "0.0.0.0", health_port).start()
        addresses = [f"{a[0]}:{a[1]}" for r in runners for a in r.addresses if isinstance(a, tuple)]
        log.info("scheduler_listening", addresses=addresses)
        await stop.wait()
    finally:
        if binder is not None:
            binder.stop()  # before the runners wait for the handlers: a waiting bind would hold them for 20 s
        for runner in runners:
            await http_stop.stop(runner)
