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

    def sample(self) -> "Samples":
        """Per-GPU and per-process figures since the previous call (blocking; called from a worker thread).
        A field a GPU does not support is None; never raises for one."""
        ...

    def stop(self) -> None:
        """Release the backend (blocking). Safe to call twice."""
        ...


@dataclass(frozen=True)
class GpuSample:
    """One GPU over the last sampling window. A field the GPU (or backend) cannot report is None.
    Utilizations are percent of the whole GPU (0..100), as NVML reports them."""

    uuid: str
    gpu_util: float | None = None  # percent of time a kernel ran
    memcpy_util: float | None = None  # percent of time memory was read or written (NVML "memory" utilization)
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    pcie_rx_bytes_per_s: float | None = None
    pcie_tx_bytes_per_s: float | None = None
    power_watts: float | None = None
    sm_clock_mhz: int | None = None
    # True: the driver gives each of its sampling periods to ONE process (the H200 with driver 580 does: every
    # ~200 ms one sample, one pid, the device's utilization), so a process's figure over a short window is a draw,
    # not its share; only long averages hold. False: every period reports each process that ran. None: not known.
    process_util_sampled: bool | None = None


@dataclass(frozen=True)
class ProcessSample:
    """One process on one GPU over the last sampling window: host PID, its own share of the GPU (percent)."""

    gpu_uuid: str
    pid: int  # host PID (NVML's view)
    sm_util: float | None = None
    mem_util: float | None = None
    used_memory_bytes: int | None = None


@dataclass(frozen=True)
class Samples:
    """What one `sample` call saw: every GPU and every process on them, and the window it covers."""

    gpus: tuple[GpuSample, ...] = ()
    processes: tuple[ProcessSample, ...] = ()
    window_s: float = 0.0

