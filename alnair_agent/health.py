"""GPU health: backend events (NVML Xid, or injected faults) turn a GPU's devices Unhealthy, and back."""

from __future__ import annotations

import asyncio
from typing import Protocol

import structlog

from alnair_agent.kube.events import EventSink
from alnair_agent.gpu.backend import GpuBackend
from alnair_agent.node.inventory import Inventory

log = structlog.get_logger(__name__)


class DeviceListener(Protocol):
    """The front-end that offers the GPUs (the device plugin's ListAndWatch, or the DRA ResourceSlice)."""

    async def notify_devices_changed(self) -> None: ...


class HealthService:
    def __init__(self, backend: GpuBackend, inventory: Inventory, plugin: DeviceListener, interval_s: float,
                 events: EventSink | None = None) -> None:
        self.events = events
        self.backend = backend
        self.inventory = inventory
        self.plugin = plugin
        self.interval_s = interval_s

    async def run(self) -> None:
        while True:
            # The backend blocks (NVML's event wait): keep it off the event loop.
            events = await asyncio.to_thread(self.backend.wait_health_events, self.interval_s)
            changed = False
            for event in events:
                if self.inventory.set_health(event.uuid, event.healthy):
                    changed = True
                    log.warning("gpu_health_changed", gpu=event.uuid, healthy=event.healthy, reason=event.reason)
                    if self.events is not None:
                        self.events.gpu_health(event.uuid, event.healthy, event.reason)
            if changed:
                await self.plugin.notify_devices_changed()
