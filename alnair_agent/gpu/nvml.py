"""The NVML backend (pynvml from nvidia-ml-py). The only module of the agent that imports pynvml.

Health: critical Xid events make a GPU unhealthy, except the Xids an application causes by itself
(constants.APPLICATION_XIDS), as NVIDIA's device plugin does. NVML reports no recovery event, so a GPU stays
unhealthy until the agent restarts (the DaemonSet restarts it after the node is fixed).
"""

from __future__ import annotations

import threading

import pynvml

from alnair_agent.constants import APPLICATION_XIDS
from alnair_agent.gpu.backend import GpuBackendError, GpuInfo, HealthEvent


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class NvmlBackend:
    def __init__(self) -> None:
        self._event_set = None
        self._started = False
        self._lock = threading.Lock()
        self._unwatched: list[str] = []

    def start(self) -> list[GpuInfo]:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            raise GpuBackendError(f"NVML init failed: {e} (is the NVIDIA driver installed and mounted?)") from e
        self._started = True
        try:
            count = pynvml.nvmlDeviceGetCount()
            if count == 0:
                raise GpuBackendError("NVML reports no GPUs on this node")
            gpus = []
            self._event_set = pynvml.nvmlEventSetCreate()
            for i in range(count):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                info = GpuInfo(
                    index=i,
                    uuid=_text(pynvml.nvmlDeviceGetUUID(h)),
                    name=_text(pynvml.nvmlDeviceGetName(h)),
                    memory_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(h).total),
                    pci_bus_id=_text(pynvml.nvmlDeviceGetPciInfo(h).busId),
                    minor=int(pynvml.nvmlDeviceGetMinorNumber(h)),
                )
                gpus.append(info)
                try:
                    pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, self._event_set)
                except pynvml.NVMLError:
                    # Some GPUs (and virtualised ones) cannot deliver Xid events: they stay healthy, and we say so.
                    self._unwatched.append(info.uuid)
            return gpus
        except pynvml.NVMLError as e:
            self.stop()
            raise GpuBackendError(f"NVML query failed: {e}") from e

    @property
    def unwatched(self) -> list[str]:
        """GPUs whose Xid events NVML cannot deliver (their health is not watched)."""
        return list(self._unwatched)

    def wait_health_events(self, timeout_s: float) -> list[HealthEvent]:
        if self._event_set is None:
            return []
        try:
            data = pynvml.nvmlEventSetWait_v2(self._event_set, int(timeout_s * 1000))
        except pynvml.NVMLError_Timeout:
            return []
        except pynvml.NVMLError as e:
            raise GpuBackendError(f"waiting for NVML events failed: {e}") from e
        if data.eventType != pynvml.nvmlEventTypeXidCriticalError:
            return []
        xid = int(data.eventData)
        if xid in APPLICATION_XIDS:
            return []
        try:
            uuid = _text(pynvml.nvmlDeviceGetUUID(data.device))
        except pynvml.NVMLError:
            return []
        return [HealthEvent(uuid, healthy=False, reason=f"xid {xid}")]

    def stop(self) -> None:
        with self._lock:
            if self._event_set is not None:
                try:
                    pynvml.nvmlEventSetFree(self._event_set)
                except pynvml.NVMLError:
                    pass  # freeing at shutdown: nothing left to protect
                self._event_set = None
            if self._started:
                self._started = False
                try:
                    pynvml.nvmlShutdown()
                except pynvml.NVMLError:
                    pass
