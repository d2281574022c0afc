"""Named root tasks: the first one to end (or the stop flag) stops all, in order, and every failure is logged."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

import structlog

log = structlog.get_logger(__name__)


class ServiceFailed(RuntimeError):
    """A service crashed or ended on its own; the agent stops non-zero so the DaemonSet restarts it."""

    def __init__(self, name: str, error: BaseException | None) -> None:
        what = f"{type(error).__name__}: {error}" if error else "ended unexpectedly"
        super().__init__(f"service {name} {what}")
        self.name = name
        self.error = error


async def run_services(services: list[tuple[str, Coroutine[Any, Any, None]]], stop: asyncio.Event,
                       shutdown_timeout: float = 4.0) -> None:
    """Run the services until `stop` is set or one ends; then cancel the rest in the order given.

    Returns normally after a requested stop; raises ServiceFailed naming the first service that ended by itself.
    """
    tasks = [asyncio.create_task(coro, name=name) for name, coro in services]
    stopper = asyncio.create_task(stop.wait(), name="stop-flag")
    try:
        done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        done = set()
        raise
    finally:
        first_failure: ServiceFailed | None = None
        for task in tasks:
            if task in done:
                error = None if task.cancelled() else task.exception()
                log.error("service_ended", service=task.get_name(), error=repr(error) if error else None)
                first_failure = first_failure or ServiceFailed(task.get_name(), error)
        stopper.cancel()
        for task in tasks:
            task.cancel()
        try:
            async with asyncio.timeout(shutdown_timeout):
                for task in tasks:
                    with contextlib.suppress(asyncio.CancelledError):
                        try:
                            await task
                        except Exception as e:  # noqa: BLE001 - each failure is logged by name, then we go on
                            if task not in done:
                                log.error("service_failed_during_shutdown", service=task.get_name(), error=repr(e))
        except TimeoutError:
            log.error("shutdown_timeout", pending=[t.get_name() for t in tasks if not t.done()])
        with contextlib.suppress(asyncio.CancelledError):
            await stopper
    if first_failure is not None:
        raise first_failure
