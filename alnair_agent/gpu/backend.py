"""The GPU backend interface and the facts it reports."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class GpuBackendError(RuntimeError):
    """The backend cannot start (no driver, no GPUs) or lost its GPUs."""


@dataclass(frozen=True)
class GpuInfo:
    """One physical GPU as discovered at start."""

    index: int
    uuid: str
    name: str
    memory_bytes: int
    pci_bus_id: str
    minor: int


@dataclass(frozen=True)
class HealthEvent:
    """A GPU's health changed. `reason` says why, for logs (e.g. 'xid 79')."""

    uuid: str
    healthy: bool
    reason: str


class GpuBackend(Protocol):
    """What the agent needs of the GPUs. Blocking methods are called from a worker thread."""

    def start(self) -> list[GpuInfo]:
        """Initialise and list the GPUs (blocking). Raises GpuBackendError when there are none."""
        ...

    def wait_health_events(self, timeout_s: float) -> list[HealthEvent]:
        """Block up to timeout_s for health changes; return those that happened (maybe none)."""
        ...

    def stop(self) -> None:
        """Release the backend (blocking). Safe to call twice."""
        ...
