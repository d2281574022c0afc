"""Stopping an aiohttp server without losing a connection accepted at the moment it stops.

CPython's asyncio (gh-109564, still open; met here on 3.11) accepts a connection in one loop tick and builds its
transport in a task that runs a tick later; when `Server.close()` lands between the two, the transport's
`Server._attach()` fails an assert that nobody sees, and the accepted socket is left open with no protocol: its
client waits for an answer that never comes, and the socket is only closed when the garbage collector finds it (a
ResourceWarning then). Any server that stops while a client connects meets it: alnair-scheduler restarting under
kube-scheduler's traffic, the agent's metrics endpoint under a scraper, the test stand-ins.

`quiesce` takes the listening sockets off the loop first, so nothing more is accepted, then yields once, so every
connection already accepted has attached before the close; aiohttp's shutdown then closes it like the others."""

from __future__ import annotations

import asyncio

from aiohttp import web


async def quiesce(runner: web.BaseRunner) -> None:
    """Stop accepting on every site of `runner` and let the connections already accepted attach. Call it just
    before `runner.cleanup()` (or a TestServer's `close()`); the close itself is left to them."""
    loop = asyncio.get_running_loop()
    for site in runner.sites:
        # aiohttp keeps the site's asyncio.Server in _server (None before start); its sockets are public.
        server = getattr(site, "_server", None)
        for sock in getattr(server, "sockets", None) or ():
            loop.remove_reader(sock.fileno())
    # The accept callbacks that already ran scheduled their tasks' first steps ahead of this resumption.
    await asyncio.sleep(0)


async def stop(runner: web.BaseRunner) -> None:
    """`runner.cleanup()`, with no connection accepted during the stop left open."""
    await quiesce(runner)
    await runner.cleanup()
