"""GPU health: backend events (NVML Xid, or injected faults) turn a GPU's devices Unhealthy, and back."""

from __future__ import annotations

import asyncio

import structlog

from alnair_agent.kube.events import EventSink
from alnair_agent.kubelet.deviceplugin import DevicePluginService
from alnair_agent.gpu.backend import GpuBackend
from alnair_agent.node.inventory import Inventory

log = structlog.get_logger(__name__)


class HealthService:
    def __init__(self, backend: GpuBackend, inventory: Inventory, plugin: DevicePluginService, interval_s: float,
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
