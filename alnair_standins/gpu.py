"""Simulated GPUs: the demo's and the tests' GPUs, with faults that tests can inject."""

from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from alnair_agent.config import SimGpu
from alnair_agent.gpu.backend import (
    GpuBackendError,
    GpuInfo,
    GpuSample,
    HealthEvent,
    ProcessSample,
    Samples,
)
from alnair_standins import simtimeline as TL


def sim_uuid(index: int, node_name: str = "") -> str:
    """A stable, valid-looking UUID for simulated GPU `index` of node `node_name`: unique per node (as real GPU
    UUIDs are), so a cluster of simulated nodes never has two GPUs of one UUID."""
    node = hashlib.sha256(node_name.encode()).hexdigest()[:8]
    return f"GPU-{node}-0000-4000-8000-{index:012d}"


@dataclass
class SimulatedBackend:
    """GPUs from ALNAIR_SIM_GPUS. `inject_health` makes one go unhealthy or come back (thread-safe).

    With `timeline_dir` (ALNAIR_SIM_TIMELINE_DIR), `sample` reports what the simulated driver's processes did on
    each GPU's shared timeline (gpu/simtimeline.py); without it, idle GPUs and no processes."""

    specs: tuple[SimGpu, ...]
    node_name: str = ""
    timeline_dir: Path | None = None
    _events: "queue.Queue[HealthEvent]" = field(default_factory=queue.Queue)
    _gpus: list[GpuInfo] = field(default_factory=list)
    _last_bucket: int | None = None  # the last timeline bucket already reported
    # The NVML fault hook (ALNAIR_SIM_FAULTS_FILE): off (None) unless configured.
    faults_file: Path | None = None
    _faults_seen: tuple[int, ...] | None = None  # (mtime_ns, size, ino) of the file last read
    _file_unhealthy: dict[int, str] = field(default_factory=dict)
    _sample_error: str | None = None
    _faults_lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def from_settings(cls, settings) -> "SimulatedBackend":  # type: ignore[no-untyped-def]
        return cls(tuple(settings.sim_gpus), settings.node_name, getattr(settings, "sim_timeline_dir", None),
                   faults_file=getattr(settings, "sim_faults_file", None))

    # -- the fault hook ----------------------------------------------------------------------------------------
    def _read_faults(self) -> None:
        """Re-read the fault file when it changed: GPUs it names go unhealthy (like an Xid), those it no longer
        names come back; `sample_error` makes `sample` fail like an NVML error. A malformed file is ignored
        (and the last good state kept): the hook must never be a way to crash the agent."""
        if self.faults_file is None:
            return
        with self._faults_lock:  # read from the health thread and the profiler's thread
            self._read_faults_locked()

    def _read_faults_locked(self) -> None:
        assert self.faults_file is not None
        try:
            st = os.stat(self.faults_file)
            seen: tuple[int, ...] = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            seen = ()
        if seen == self._faults_seen:
            return
        self._faults_seen = seen
        data: object = {}
        if seen:
            try:
                data = json.loads(Path(self.faults_file).read_text()[:65536])
            except (OSError, ValueError):
                return
        if not isinstance(data, dict):
            return
        raw = data.get("unhealthy", {})
        wanted: dict[int, str] = {}
        if isinstance(raw, dict):
            for key, reason in raw.items():
                if isinstance(key, str) and key.isascii() and key.isdigit() and int(key) < len(self._gpus):
                    wanted[int(key)] = str(reason)[:200]
        error = data.get("sample_error")
        self._sample_error = str(error)[:200] if error else None
        for index in sorted(set(self._file_unhealthy) | set(wanted)):
            if index in wanted and index not in self._file_unhealthy:
                self._events.put(HealthEvent(self._gpus[index].uuid, False, wanted[index]))
            elif index not in wanted:
                self._events.put(HealthEvent(self._gpus[index].uuid, True, "fault cleared"))
        self._file_unhealthy = wanted

    def start(self) -> list[GpuInfo]:
        if not self.specs:
            raise GpuBackendError("no simulated GPUs configured")
        self._gpus = [
            GpuInfo(index=i, uuid=sim_uuid(i, self.node_name), name="Simulated GPU", memory_bytes=spec.memory_bytes,
                    pci_bus_id=f"00000000:{0x10 + i:02X}:00.0", minor=i)
            for i, spec in enumerate(self.specs)
        ]
        if self.timeline_dir is not None:
            self.timeline_dir.mkdir(parents=True, exist_ok=True)
            for gpu in self._gpus:
                TL.create(self.timeline_dir / gpu.uuid)
        return list(self._gpus)

    def sample(self) -> Samples:
        """Complete timeline buckets since the previous call; the first call only marks where to start."""
        self._read_faults()
        if self._sample_error:
            raise GpuBackendError(f"injected NVML fault: {self._sample_error}")
        k1 = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // TL.BUCKET_NS  # buckets before k1 are complete
        k0 = k1 if self._last_bucket is None else self._last_bucket
        k0 = max(k0, k1 - TL.BUCKETS)
        self._last_bucket = k1
        window_ns = (k1 - k0) * TL.BUCKET_NS
        gpus, procs = [], []
        for gpu in self._gpus:
            seen = TL.read_window(self.timeline_dir / gpu.uuid, k0, k1) if self.timeline_dir and window_ns else None
            if seen is None:
                gpus.append(GpuSample(gpu.uuid, 0.0, 0.0, 0, gpu.memory_bytes))
                continue
            live = [s for s in seen.slots if _alive(s.pid)]
            pct = 100.0 / window_ns
            gpus.append(GpuSample(gpu.uuid, min(100.0, seen.busy_ns * pct), min(100.0, seen.copy_ns * pct),
                                  sum(s.memory_bytes for s in live), gpu.memory_bytes,
                                  process_util_sampled=False))  # the timeline books each process's own time
            # As NVML does: a process's memory utilization is its kernels' memory traffic (none is simulated), and
            # copy-engine time is the GPU's only, attributed to no process.
            procs += [ProcessSample(gpu.uuid, s.pid, min(100.0, s.busy_ns * pct), 0.0,
                                    s.memory_bytes) for s in live]
        return Samples(tuple(gpus), tuple(procs), window_ns / 1e9)

    def inject_health(self, index: int, healthy: bool, reason: str = "injected") -> None:
        if not 0 <= index < len(self._gpus):
            raise IndexError(f"no simulated GPU {index}; there are {len(self._gpus)}")
        self._events.put(HealthEvent(self._gpus[index].uuid, healthy, reason))

    def wait_health_events(self, timeout_s: float) -> list[HealthEvent]:
        self._read_faults()
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


def _alive(pid: int) -> bool:
    """Whether the process still has the GPU as NVML would list it: running, not a zombie (the driver tears its
    contexts down as it exits, before its parent reaps it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc to tell (or it just went): kill said it was there
    return stat[stat.rfind(")") + 2:][:1] not in ("Z", "X")
