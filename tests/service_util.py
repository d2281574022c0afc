"""Small async helpers for tests of long-lived services."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any


@contextlib.asynccontextmanager
async def running(service: Coroutine[Any, Any, None], name: str = "service") -> AsyncIterator[asyncio.Task[None]]:
    """Run a service's `run()` coroutine as a task for the block; cancel and await it after. A service that
    died on its own re-raises its exception here."""
    task = asyncio.create_task(service, name=name)
    try:
        yield task
    finally:
        if task.done():
            task.result()  # surface a crash of the service
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0, interval: float = 0.01) -> None:
    """Poll `predicate` until true; AssertionError after `timeout` s."""
    try:
        async with asyncio.timeout(timeout):
            while not predicate():
                await asyncio.sleep(interval)
    except TimeoutError:
        raise AssertionError(f"condition not met within {timeout} s") from None
