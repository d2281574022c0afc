"""Named root tasks under one TaskGroup: the stop flag shuts them down in order; one ending stops all.

A service that raises or returns on its own is logged by name and fails the group (the TaskGroup cancels the
others); the process then exits non-zero and Kubernetes restarts it rather than leave it half alive. Both the agent
and alnair-scheduler run this way; `process` names which one in the log (`agent_stopping`, `scheduler_stopping`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import structlog

log = structlog.get_logger(__name__)


class ServiceFailed(RuntimeError):
    """A service crashed or ended on its own."""

    def __init__(self, name: str, error: BaseException | None) -> None:
        what = f"{type(error).__name__}: {error}" if error else "ended unexpectedly"
        super().__init__(f"service {name} {what}")
        self.name = name
        self.error = error


async def _guard(process: str, name: str, coro: Coroutine[Any, Any, None]) -> None:
    try:
        await coro
    except asyncio.CancelledError:
        raise
    except Exception as e:
        log.error("service_ended", process=process, service=name, error=repr(e))
        raise ServiceFailed(name, e) from e
    log.error("service_ended", process=process, service=name, error=None)
    raise ServiceFailed(name, None)


async def run_services(services: list[tuple[str, Coroutine[Any, Any, None]]], stop: asyncio.Event, *,
                       process: str, shutdown_timeout: float = 4.0) -> None:
    """Run the services of `process` ("agent", "scheduler": the prefix of its `<process>_stopping` event) until
    `stop` is set (then stop them in the order given, each within the time left) or until one ends (then raise
    ServiceFailed naming it)."""

    async def stop_in_order(tasks: list[asyncio.Task[None]]) -> None:
        await stop.wait()
        log.info(f"{process}_stopping", services=[t.get_name() for t in tasks])
        deadline = asyncio.get_running_loop().time() + shutdown_timeout
        for task in tasks:
            task.cancel()
            remaining = deadline - asyncio.get_running_loop().time()
            done, _ = await asyncio.wait([task], timeout=max(0.0, remaining))
            if not done:
                log.error("service_stop_timeout", process=process, service=task.get_name())

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(_guard(process, name, coro), name=name) for name, coro in services]
            group.create_task(stop_in_order(tasks), name="stop-flag")
    except* ServiceFailed as failures:
        raise failures.exceptions[0] from None
