"""The NVML backend (pynvml from nvidia-ml-py). The only module of the agent that imports pynvml.

Health: critical Xid events make a GPU unhealthy, except the Xids an application causes by itself
(constants.APPLICATION_XIDS), as NVIDIA's device plugin does. NVML reports no recovery event, so a GPU stays
unhealthy until the agent restarts (the DaemonSet restarts it after the node is fixed).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import pynvml

from alnair_agent.constants import APPLICATION_XIDS
from alnair_agent.gpu.backend import GpuBackendError, GpuInfo, GpuSample, HealthEvent, ProcessSample, Samples

T = TypeVar("T")

# NVML answers a per-process utilization query with one sample per process: its newest sampling period with
# non-zero utilization after the timestamp given. Asked after the newest timestamp of *any* process, a process
# whose newest period came just before another's is skipped (its period is not newer than the other's); so the
# agent asks after the oldest of the listed processes' own last timestamps (at most PID_LOOKBACK_US back) and keeps
# for each process only a sample newer than its own last one. Where the driver gives each period to one process
# (Attribution.sampled), asking more often than about once a second still skews the shares (a window without a new
# period of a process reads 0 for it), so there the agent asks at most every SAMPLED_QUERY_S and holds each
# process's figure between asks. On the H200, two tenants doing 34 % and 66 % of the work read 34.3 / 64.1 % asked
# every 0.5 s in one run and 40 / 59 % in another (each asked after the newest of any process).
PID_LOOKBACK_US = 2_000_000
SAMPLED_QUERY_S = 1.0
SAMPLED_QUERY_SLACK_S = 0.1  # an ask due at 1 s that comes a little early (the sampling loop's jitter) still asks


def _field(call: Callable[[], T]) -> T | None:
    """One NVML query; None when this GPU (or driver) does not support it or it fails now."""
    try:
        return call()
    except pynvml.NVMLError:
        return None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class Attribution:
    """Tells from the per-process samples how the driver attributes them (GpuSample.process_util_sampled): over the
    last PERIODS sampling periods that reported anyone, several processes were reported but never two in one
    period -> sampled; two in one period -> per-process shares. Fewer periods, or one process only: unknown."""

    PERIODS = 6

    def __init__(self) -> None:
        self.periods: list[frozenset[int]] = []  # pids reported per sampling period (timestamp), oldest first

    def add(self, samples: list[tuple[int, int]]) -> None:
        """(timestamp us, pid) of the samples of one call, in any order."""
        by_ts: dict[int, set[int]] = {}
        for ts, pid in samples:
            by_ts.setdefault(ts, set()).add(pid)
        self.periods += [frozenset(by_ts[t]) for t in sorted(by_ts)]
        del self.periods[:-self.PERIODS]

    @property
    def sampled(self) -> bool | None:
        if any(len(p) > 1 for p in self.periods):
            return False
        if len(self.periods) < self.PERIODS or len(frozenset().union(*self.periods)) < 2:
            return None
        return True


class NvmlBackend:
    def __init__(self) -> None:
        self._handles: list[tuple[str, Any]] = []  # (uuid, handle) per GPU
        self._attribution: dict[str, Attribution] = {}
        self._pid_seen: dict[str, dict[int, int]] = {}  # per GPU: pid -> timestamp of its newest sample seen
        # (the GPU's newest is their max: an entry is dropped only once it is far older than that)
        self._held: dict[str, tuple[float, dict[int, tuple[float, float]]]] = {}  # per sampled GPU: (asked at,
        # pid -> (sm %, memory-copy %))
        self._last_sample_at: float | None = None
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
                self._handles.append((info.uuid, h))
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

    def sample(self) -> Samples:
        now = time.monotonic()
        window = 0.0 if self._last_sample_at is None else now - self._last_sample_at
        self._last_sample_at = now
        gpus, procs = [], []
        for uuid, h in self._handles:
            util = _field(partial(pynvml.nvmlDeviceGetUtilizationRates, h))
            mem = _field(partial(pynvml.nvmlDeviceGetMemoryInfo, h))
            rx = _field(partial(pynvml.nvmlDeviceGetPcieThroughput, h, pynvml.NVML_PCIE_UTIL_RX_BYTES))
            tx = _field(partial(pynvml.nvmlDeviceGetPcieThroughput, h, pynvml.NVML_PCIE_UTIL_TX_BYTES))
            power = _field(partial(pynvml.nvmlDeviceGetPowerUsage, h))
            clock = _field(partial(pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_SM))
            gpus.append(GpuSample(
                uuid,
                gpu_util=float(util.gpu) if util is not None else None,
                memcpy_util=float(util.memory) if util is not None else None,
                memory_used_bytes=int(mem.used) if mem is not None else None,
                memory_total_bytes=int(mem.total) if mem is not None else None,
                pcie_rx_bytes_per_s=rx * 1024.0 if rx is not None else None,  # NVML reports KB/s
                pcie_tx_bytes_per_s=tx * 1024.0 if tx is not None else None,
                power_watts=power / 1000.0 if power is not None else None,  # mW
                sm_clock_mhz=int(clock) if clock is not None else None,
                process_util_sampled=self._attribution.setdefault(uuid, Attribution()).sampled,
            ))
            procs += self._processes(uuid, h, now)
        return Samples(tuple(gpus), tuple(procs), window)

    def _processes(self, uuid: str, h: Any, now: float) -> list[ProcessSample]:
        """Running compute and graphics processes (used memory) joined with per-process utilization samples
        newer than the last ones seen (the newest sample per process within the window; a listed process
        without one was idle). Where periods are given to one process each, asked at most every SAMPLED_QUERY_S
        (see there) and held between asks."""
        used: dict[int, int | None] = {}
        for lister in (pynvml.nvmlDeviceGetComputeRunningProcesses, pynvml.nvmlDeviceGetGraphicsRunningProcesses):
            for p in _field(partial(lister, h)) or []:
                mem = getattr(p, "usedGpuMemory", None)  # None or a huge value: not available (e.g. under MIG)
                pid = int(p.pid)
                if isinstance(mem, int) and 0 <= mem < 1 << 50:
                    used[pid] = (used.get(pid) or 0) + mem
                else:
                    used.setdefault(pid, None)
        attribution = self._attribution.setdefault(uuid, Attribution())
        held = self._held.get(uuid)
        if attribution.sampled and held is not None and now - held[0] < SAMPLED_QUERY_S - SAMPLED_QUERY_SLACK_S:
            utils = {pid: v for pid, v in held[1].items() if pid in used}  # an ended process is not held on
        else:
            utils = self._ask(uuid, h, attribution, set(used))
            if attribution.sampled:
                self._held[uuid] = (now, utils)
            else:
                self._held.pop(uuid, None)
        return [ProcessSample(uuid, pid, *utils.get(pid, (0.0, 0.0)), used.get(pid))
                for pid in sorted(set(used) | set(utils))]

    def _ask(self, uuid: str, h: Any, attribution: Attribution, listed: set[int]) -> dict[int, tuple[float, float]]:
        """Each process's (sm %, memory-copy %) from its samples newer than its own newest seen."""
        seen = self._pid_seen.setdefault(uuid, {})
        newest = max(seen.values(), default=0)
        since = max(min([seen[p] for p in listed if p in seen] + [newest]), newest - PID_LOOKBACK_US, 0)
        samples = _field(partial(pynvml.nvmlDeviceGetProcessUtilization, h, since)) or []
        fresh = [s for s in samples if int(s.timeStamp) > seen.get(int(s.pid), since)]
        attribution.add([(int(s.timeStamp), int(s.pid)) for s in fresh])
        sums: dict[int, tuple[int, float, float]] = {}
        for s in fresh:
            pid, ts = int(s.pid), int(s.timeStamp)
            newest, seen[pid] = max(newest, ts), max(seen.get(pid, 0), ts)
            # several samples of one process in the window: average them
            n, sm, mm = sums.get(pid, (0, 0.0, 0.0))
            sums[pid] = (n + 1, sm + float(s.smUtil), mm + float(s.memUtil))
        for pid in [p for p in seen if p not in listed and seen[p] < newest - PID_LOOKBACK_US]:
            del seen[pid]  # ended long ago
        return {pid: (sm / n, mm / n) for pid, (n, sm, mm) in sums.items()}

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
