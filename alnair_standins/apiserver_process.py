"""The API server stand-in in a process of its own, driven through the same test hooks.

FakeApiServer shares its caller's event loop; beside a benchmarked agent that is the wrong picture: on a node the API
server is elsewhere, and the work it does for the agent's own writes (patches, watch events) must not delay what the
benchmark times (kubelet's calls). `ApiServerProcess` runs a FakeApiServer with its own interpreter and event loop
(`python -c`, a fresh interpreter: nothing of the caller's threads or loop is forked, and unlike multiprocessing's
spawn the caller's main module is not imported again) and forwards every hook (`add_claim`, `claim`,
`set_claim_status`, `resource_slices`, ...) as a call over a socket pair: arguments and results are pickled copies,
as the in-process hooks already return copies.

    async with ApiServerProcess() as api:
        api.add_claim(make_claim(...))          # a blocking round trip of a fraction of a millisecond
        client = api.api_client()               # a kubernetes-asyncio client for it (caller closes it)
"""

from __future__ import annotations

import asyncio
import inspect
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any

from kubernetes_asyncio.client import ApiClient, Configuration

from alnair_standins.apiserver import FakeApiServer

START_TIMEOUT_S = 60.0  # a fresh interpreter imports aiohttp, kubernetes-asyncio and the schema validator


class ApiServerProcess:
    def __init__(self) -> None:
        self.host = ""
        self._conn: Connection | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    async def __aenter__(self) -> ApiServerProcess:
        ours, theirs = socket.socketpair()
        code = "import sys; from alnair_standins.apiserver_process import serve; serve(int(sys.argv[1]))"
        self._proc = subprocess.Popen([sys.executable, "-c", code, str(theirs.fileno())], pass_fds=[theirs.fileno()])
        theirs.close()
        conn = Connection(ours.detach())
        try:
            if not await asyncio.to_thread(conn.poll, START_TIMEOUT_S):
                raise TimeoutError("the API server stand-in's process did not start")
            kind, self.host = conn.recv()
            assert kind == "ready", kind
        except BaseException:
            conn.close()
            self._proc.kill()
            self._proc.wait(5)
            raise
        self._conn = conn
        return self

    async def __aexit__(self, *exc: object) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.send(None)  # stop
            conn.close()
        if self._proc is not None:
            try:
                await asyncio.to_thread(self._proc.wait, 10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                await asyncio.to_thread(self._proc.wait, 5)

    def api_client(self) -> ApiClient:
        """A real kubernetes-asyncio client for the server; the caller closes it."""
        return ApiClient(Configuration(host=self.host))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*args: Any, **kwargs: Any) -> Any:
            assert self._conn is not None, "not started"
            self._conn.send((name, args, kwargs))
            kind, value = self._conn.recv()
            if kind == "error":
                raise value
            return value

        call.__name__ = name
        return call


def serve(fd: int) -> None:
    """The child's side (`python -c`): a FakeApiServer answering the hooks sent over socket `fd` until told to stop."""
    asyncio.run(_main(Connection(fd)))


async def _main(conn: Connection) -> None:
    loop = asyncio.get_running_loop()
    stopped = asyncio.Event()
    pending: set[asyncio.Task[None]] = set()

    def answer(value: Any) -> None:
        try:
            conn.send(("ok", value))
        except Exception as e:  # noqa: BLE001 - a result that cannot be pickled is the caller's error to see
            conn.send(("error", RuntimeError(f"unpicklable result: {e}")))

    async def finish(result: Any) -> None:
        try:
            answer(await result)
        except Exception as e:  # noqa: BLE001 - the hook's own error goes back to the caller
            conn.send(("error", e))

    def on_command() -> None:
        try:
            message = conn.recv()
        except EOFError:
            message = None
        if message is None:
            loop.remove_reader(conn.fileno())
            stopped.set()
            return
        name, args, kwargs = message
        try:
            result = getattr(api, name)(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the hook's own error goes back to the caller
            conn.send(("error", e))
            return
        if inspect.isawaitable(result):  # outage(), recover(): answered once done
            task = asyncio.ensure_future(finish(result))
            pending.add(task)
            task.add_done_callback(pending.discard)
        else:
            answer(result)

    async with FakeApiServer() as api:
        conn.send(("ready", api.host))
        loop.add_reader(conn.fileno(), on_command)
        await stopped.wait()
