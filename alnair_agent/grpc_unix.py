"""The one way a grpc.aio server is started on a unix socket, by the agent (device plugin, DRA plugin) and by the
kubelet stand-ins alike: a stale socket file at the path is removed first (a server that died leaves it, and gRPC
will not bind over it), and the mode is set once the socket exists (kubelet, root, is the only one to dial it)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

import grpc
import grpc.aio


async def serve_unix(path: Path, *servicers: Callable[[grpc.aio.Server], None], mode: int | None = None) -> grpc.aio.Server:
    """Start a server on `path` with each `servicers` adder applied to it (e.g. `lambda s:
    pb_grpc.add_XServicer_to_server(servicer, s)`); the server, started."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    server = grpc.aio.server()
    for add in servicers:
        add(server)
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    if mode is not None:
        os.chmod(path, mode)
    return server
