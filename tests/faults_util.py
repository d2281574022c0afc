"""Helpers of the fault suite (tests/test_faults*.py): the real agent process, its logs, its HTTP endpoint,
its open descriptors, and small filesystems (tmpfs) that can be made full or read-only."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from alnair_agent.config import Settings
from alnair_standins.node import AgentProcess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def events(agent: AgentProcess) -> list[dict[str, Any]]:
    out = []
    for line in agent.output().splitlines():
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if isinstance(entry, dict):
                out.append(entry)
    return out


def count(agent: AgentProcess, event: str, **fields: Any) -> int:
    return sum(1 for e in events(agent) if e.get("event") == event and all(e.get(k) == v for k, v in fields.items()))


async def http_get(port: int, path: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}{path}", timeout=aiohttp.ClientTimeout(total=5)) as resp:
            return resp.status, await resp.text()


async def wait_until(predicate, timeout: float = 10.0, step: float = 0.05) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(step)


@contextlib.asynccontextmanager
async def agent_process(settings: Settings) -> AsyncIterator[AgentProcess]:
    """The real `alnair-agent` process; stopped (SIGTERM, then SIGKILL) at the end."""
    agent = AgentProcess(settings)
    agent.start()
    try:
        yield agent
    finally:
        stop(agent)


def stop(agent: AgentProcess) -> None:
    if agent.proc is not None and agent.proc.poll() is None:
        agent.proc.send_signal(signal.SIGTERM)
        try:
            agent.proc.wait(10)
        except subprocess.TimeoutExpired:
            agent.proc.kill()
            agent.proc.wait(5)


def kill(agent: AgentProcess) -> None:
    assert agent.proc is not None
    agent.proc.send_signal(signal.SIGKILL)
    agent.proc.wait(5)


O_PATH = 0o10000000


def open_paths(pid: int) -> list[str]:
    """What the process's descriptors that can read or write point at (O_PATH descriptors, which open nothing,
    are left out)."""
    out = []
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            flags = next(int(line.split()[1], 8) for line in
                         Path(f"/proc/{pid}/fdinfo/{fd.name}").read_text().splitlines() if line.startswith("flags:"))
            if not flags & O_PATH:
                out.append(target)
    return out


@contextlib.contextmanager
def tmpfs(path: Path, size: str, read_only: bool = False) -> Iterator[Path]:
    """A small tmpfs at `path` (root only: skipped where mounting is not allowed)."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size},mode=0755" + (",ro" if read_only else "")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(folder: Path, leave: int = 0) -> Path:
    """Fill the filesystem of `folder` until at most `leave` bytes are free; returns the filler file."""
    filler = folder / "filler"
    with open(filler, "wb") as f:
        chunk = b"\0" * 65536
        while True:
            st = os.statvfs(folder)
            free = st.f_bavail * st.f_frsize
            if free <= leave:
                break
            try:
                f.write(chunk[: max(1, min(len(chunk), free - leave))])
                f.flush()
            except OSError:
                break
    return filler
