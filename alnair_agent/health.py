"""GPU health: backend events (NVML Xid, or injected faults) turn a GPU's devices Unhealthy, and back."""

from __future__ import annotations

import asyncio
from typing import Protocol

import structlog

from alnair_agent.gpu.backend import GpuBackend, HealthEvent
from alnair_agent.kube.events import EventSink
from alnair_agent.node.inventory import Inventory

log = structlog.get_logger(__name__)

# The backend's wait for GPU events blocks a worker thread that nothing can interrupt (NVML's event wait has no
# cancel), and the interpreter joins it at exit: a stopping agent waited out the whole health interval (up to 60 s,
# past kubelet's 30 s grace). Waits are this long at most; events queue in the event set between them.
WAIT_SLICE_S = 0.5


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
        loop = asyncio.get_running_loop()
        while True:
            # The backend blocks (NVML's event wait): keep it off the event loop, and in slices (WAIT_SLICE_S).
            deadline = loop.time() + self.interval_s
            events: list[HealthEvent] = []
            while not events and loop.time() < deadline:
                wait_s = max(0.0, min(deadline - loop.time(), WAIT_SLICE_S))
                events = await asyncio.to_thread(self.backend.wait_health_events, wait_s)
            changed = False
            for event in events:
                if self.inventory.set_health(event.uuid, event.healthy):
                    changed = True
                    log.warning("gpu_health_changed", gpu=event.uuid, healthy=event.healthy, reason=event.reason)
                    if self.events is not None:
                        self.events.gpu_health(event.uuid, event.healthy, event.reason)
            if changed:
                await self.plugin.notify_devices_changed()
