"""What the services that retire records need of the profiler (alnair_agent.profiler.service.Profiler): the reconciler
(device plugin containers) and the DRA front-end (claims) both publish a record's final figures before it goes."""

from __future__ import annotations

from typing import Protocol

from alnair_agent.node.workspace import Allocation


class UsageSink(Protocol):
    """The profiler as a sink of records' usage: seen (a record to sample), final (its last figures written), forget."""

    def seen(self, alloc: Allocation) -> None: ...

    async def seen_all(self, allocs: list[Allocation]) -> None: ...

    async def final(self, alloc: Allocation, timeout: float = 10.0) -> bool: ...

    def forget(self, alloc: Allocation) -> None: ...
