"""Simulated GPUs: the demo's and the tests' GPUs, with faults that tests can inject."""

from __future__ import annotations

import hashlib
import queue
from dataclasses import dataclass, field

from alnair_agent.config import SimGpu
from alnair_agent.gpu.backend import GpuBackendError, GpuInfo, HealthEvent


def sim_uuid(index: int, node_name: str = "") -> str:
    """A stable, valid-looking UUID for simulated GPU `index` of node `node_name`: unique per node (as real GPU
    UUIDs are), so a cluster of simulated nodes never has two GPUs of one UUID."""
    node = hashlib.sha256(node_name.encode()).hexdigest()[:8]
    return f"GPU-{node}-0000-4000-8000-{index:012d}"


@dataclass
class SimulatedBackend:
    """GPUs from ALNAIR_SIM_GPUS. `inject_health` makes one go unhealthy or come back (thread-safe)."""

    specs: tuple[SimGpu, ...]
    node_name: str = ""
    _events: "queue.Queue[HealthEvent]" = field(default_factory=queue.Queue)
    _gpus: list[GpuInfo] = field(default_factory=list)

    @classmethod
    def from_settings(cls, settings) -> "SimulatedBackend":  # type: ignore[no-untyped-def]
        return cls(tuple(settings.sim_gpus), settings.node_name)

    def start(self) -> list[GpuInfo]:
        if not self.specs:
            raise GpuBackendError("no simulated GPUs configured")
        self._gpus = [
            GpuInfo(index=i, uuid=sim_uuid(i, self.node_name), name="Simulated GPU", memory_bytes=spec.memory_bytes,
                    pci_bus_id=f"00000000:{0x10 + i:02X}:00.0", minor=i)
            for i, spec in enumerate(self.specs)
        ]
        return list(self._gpus)

    def inject_health(self, index: int, healthy: bool, reason: str = "injected") -> None:
        if not 0 <= index < len(self._gpus):
            raise IndexError(f"no simulated GPU {index}; there are {len(self._gpus)}")
        self._events.put(HealthEvent(self._gpus[index].uuid, healthy, reason))

    def wait_health_events(self, timeout_s: float) -> list[HealthEvent]:
        try:
            events = [self._events.get(timeout=timeout_s)]
        except queue.Empty:
            return []
        while True:
            try:
                events.append(self._events.get_nowait())
            except queue.Empty:
                return events

    def stop(self) -> None:
        pass
