"""A client that connects while an Alnair HTTP server stops is answered or closed, never left hanging.

CPython's asyncio loses a connection accepted in the tick before `Server.close()` (gh-109564): its socket stays
open with no protocol behind it. With a plain `runner.cleanup()` a connection made two loop ticks before the stop
hangs (its socket is closed only by the garbage collector, with a ResourceWarning); `http_stop.stop` closes it.
CI met it as a ResourceWarning in the extender-restart test of test_placement."""

from __future__ import annotations

import asyncio
import gc
import socket

import pytest
from aiohttp import web

from alnair_agent import http_stop
from alnair_agent.scheduler.server import serve
from alnair_agent.scheduler.view import ClusterView

CLIENT_WAIT_S = 2.0


def _answered_or_closed(client: socket.socket) -> bool:
    """True once the server closes (EOF or reset) or answers; False if nothing comes in CLIENT_WAIT_S."""
    client.settimeout(CLIENT_WAIT_S)
    try:
        client.recv(1)  # b"" (closed) or the first byte of an answer
    except ConnectionResetError:
        pass  # refused from the backlog once the listener closed: closed too
    except TimeoutError:
        return False
    return True


async def _ok(_: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _runner_on_loopback() -> tuple[web.AppRunner, int]:
    app = web.Application()
    app.router.add_get("/", _ok)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    [(_, port)] = [a for a in runner.addresses if isinstance(a, tuple)]
    return runner, port


# The tick at which the stop lands after the connect, around the window where CPython loses it (2 here).
@pytest.mark.parametrize("ticks", range(8))
async def test_a_connection_made_as_the_server_stops_is_closed(ticks: int) -> None:
    runner, port = await _runner_on_loopback()
    with socket.create_connection(("127.0.0.1", port)) as client:  # on loopback, complete before the loop sees it
        for _ in range(ticks):
            await asyncio.sleep(0)
        await http_stop.stop(runner)
        assert await asyncio.to_thread(_answered_or_closed, client), f"left hanging by a stop {ticks} ticks later"
    gc.collect()  # a lost transport would surface here as an unraisable ResourceWarning (an error in this suite)


async def test_requests_in_flight_at_the_stop_are_still_answered() -> None:
    runner, port = await _runner_on_loopback()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    await asyncio.sleep(0.05)
    await http_stop.stop(runner)
    assert (await asyncio.wait_for(reader.readline(), CLIENT_WAIT_S)).startswith(b"HTTP/1.1 200")
    writer.close()
    await writer.wait_closed()


@pytest.mark.parametrize("ticks", range(8))
async def test_alnair_scheduler_closes_a_connection_made_as_it_stops(ticks: int, unused_tcp_port: int) -> None:
    port = unused_tcp_port
    stop = asyncio.Event()
    task = asyncio.create_task(serve("127.0.0.1", port, stop, ClusterView()), name="scheduler")
    for _ in range(200):
        try:
            client = socket.create_connection(("127.0.0.1", port))
            break
        except ConnectionRefusedError:
            await asyncio.sleep(0.01)
    else:
        raise AssertionError("alnair-scheduler did not listen")
    with client:
        # A request first, so the stop meets a live keep-alive connection beside the new one.
        client.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.05)
        with socket.create_connection(("127.0.0.1", port)) as late:
            for _ in range(ticks):
                await asyncio.sleep(0)
            stop.set()
            await asyncio.wait_for(task, 5)
            assert await asyncio.to_thread(_answered_or_closed, late)
        client.settimeout(CLIENT_WAIT_S)
        head = client.recv(4096).split(b"\r\n\r\n", 1)
        assert head[0].startswith(b"HTTP/1.1 "), head
    gc.collect()
