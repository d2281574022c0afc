"""The profiler service: every ALNAIR_PROFILE_INTERVAL_S, one backend sample (in a worker thread), its processes
mapped to allocations, each container's figures updated (a compute-capped container's GPU utilization
from the GPU time its shim counted in its turns, the same truth the dispatcher's turns give it; see
`_metered_utils`); each pod's `ai.centaurus.io/usage` annotation
written at most once per ALNAIR_ANNOTATE_INTERVAL_S, plus a final write when a container ends (`final`, which the
reconciler awaits before it removes the container's workspace).

The annotation is one JSON object keyed by container name. It is merged: entries of containers this agent does
not hold in memory (written before a restart, or by anyone else) are kept as found on the pod; only this
agent's containers' entries are replaced. Figures live in memory keyed by allocation, that is per (container, GPU):
a container of several GPUs has one allocation on each, and its entry is built from all of them (usage.py's
`container_entry`: combined figures and one entry per GPU), never one GPU's figures over another's. An ended
allocation's last figures are kept until its pod is gone, so later writes for the pod's other containers never drop
them. A process is placed per GPU it is seen on: a process of a multi-GPU container counts, on each GPU, for its
container's allocation on that GPU.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from alnair_agent.constants import MPS_SERVER_COMM, USAGE_ANNOTATION
from alnair_agent.gpu.backend import GpuBackend, GpuBackendError, Samples
from alnair_agent.node.region import Region, RegionError
from alnair_agent.profiler.pidmap import PidMapper, ProcReader, SlotPid
from alnair_agent.profiler.usage import ContainerUsage, container_entry, gpu_entry, parse_usage, render_usage

if TYPE_CHECKING:
    from alnair_agent.kube.pod_source import PodSource
    from alnair_agent.kube.pods import PodInfo
    from alnair_agent.node.ledger import Ledger
    from alnair_agent.node.reconcile import AnnotationSink
    from alnair_agent.node.workspace import Allocation, Workspace

log = structlog.get_logger(__name__)

PodKey = tuple[str, str]  # (namespace, pod name)
Slots = list[tuple[tuple[int, int, int], int]]  # a counter of each region slot: ((index, pid, start_time), value)
# A pass writing many pods' figures (each a parse and a render of JSON) gives the event loop back after this many: a
# hundred new pods' first figures in one go held a kubelet call 20-30 ms on a 2-core node.
PODS_PER_STEP = 8


@dataclass(frozen=True)
class _Snapshot:
    """What a tick's worker thread needs, taken on the event loop (the ledger is not thread-safe)."""

    alloc_ids: tuple[str, ...]
    # GPU UUID -> (pod UID, container ID) -> the container's allocation on that GPU
    containers: dict[str, dict[tuple[str, str], str]]
    pod_uids: dict[str, str]  # allocation id -> its pod's UID, where known
    gpus: dict[str, str]  # allocation id -> its GPU's UUID


@dataclass
class _Collected:
    samples: Samples
    places: dict[tuple[int, str], str]  # (host pid, GPU uuid) -> allocation id
    unattributed: dict[str, int]  # GPU uuid -> processes placed on no allocation
    waits: dict[str, Slots]  # allocation -> slots' wait counters
    copies: dict[str, Slots]  # allocation -> slots' copy_bytes counters
    region_memory: dict[str, int]  # allocation -> bytes its slots claim (fallback when NVML says nothing)
    gpu_time: dict[str, Slots]  # allocation -> slots' gpu_ns counters
    at: float = 0.0  # monotonic s the sample was taken (the end of its window), for the dispatcher
    mps_servers: frozenset[tuple[int, str]] = frozenset()  # (host pid, GPU uuid) of MPS servers: their clients' work
    launches: dict[str, Slots] = field(default_factory=dict)  # allocation -> slots' launch counters


def _device_utils(samples: Samples) -> dict[str, float]:
    """GPU uuid -> NVML's device utilization (%), for the GPUs that gave a finite one."""
    return {g.uuid: g.gpu_util for g in samples.gpus if g.gpu_util is not None and math.isfinite(g.gpu_util)}


def _order(alloc: "Allocation") -> tuple[int, float]:
    """Where an allocation's figures go among its container's: its GPU's position in the container's GPUs."""
    return (alloc.part, alloc.created_at)


class Profiler:
    def __init__(self, backend: GpuBackend, ledger: "Ledger", workspace: "Workspace",
                 pods: "PodSource | None", annotations: "AnnotationSink | None", interval_s: float = 1.0,
                 annotate_interval_s: float = 30.0, proc_root: Path = Path("/proc")) -> None:
        self.backend = backend
        self.ledger = ledger
        self.workspace = workspace
        self.pods = pods
        self.annotations = annotations
        self.interval_s = interval_s
        self.annotate_interval_s = annotate_interval_s
        self.mapper = PidMapper(ProcReader(proc_root))
        self.usage: dict[str, ContainerUsage] = {}  # allocation id -> figures
        self.last: Samples = Samples()
        self.unattributed: dict[str, int] = {}
        # (host pid, GPU uuid) -> (allocation, the process's start time) it was placed on in the previous sample
        self._placed: dict[tuple[int, str], tuple[str, int]] = {}
        self._regions: dict[str, Region] = {}
        # last figures of ended allocations, per pod: allocation id -> (its container key, its order, whether its
        # container has several GPUs, its entry)
        self._ended: dict[PodKey, dict[str, tuple[str, tuple[int, float], bool, dict[str, object]]]] = {}
        self._ended_uid: dict[PodKey, str] = {}  # the UID of the pod those entries belong to ("" if unknown)
        self._published: dict[PodKey, float] = {}  # monotonic time of the pod's last write
        # for the dispatcher: samples taken, seconds of window they covered, when the newest was taken
        self.samples = 0
        self.sampled_s = 0.0
        self.sample_at = 0.0
        self._regions_at: float | None = None  # monotonic s the slots were last read (the metered rates' window)
        # the tick's worker thread, while it runs: a cancelled tick cannot stop it, and it opens regions into
        # `_regions`, so closing them waits for it (closing under it: "dictionary changed size during iteration")
        self._collecting: asyncio.Future[_Collected] | None = None

    # -- what the reconciler calls -----------------------------------------------------------------------------
    def seen(self, alloc: "Allocation") -> None:
        """A live, identified container: make sure it has an entry; write its pod's annotation when due."""
        self._seen(alloc, None)

    async def seen_all(self, allocs: "list[Allocation]") -> None:
        """`seen` for each of a pass's containers: their pods' allocations found once, not once per pod, and the
        loop given back between batches of pods written."""
        by_pod: dict[PodKey, list[Allocation]] | None = None
        published = 0
        for alloc in allocs:
            if alloc.id not in self.ledger.allocations:
                continue  # retired while the pass gave the loop back
            if by_pod is None and self._due(alloc):
                by_pod = self._pod_keys()
            if self._seen(alloc, by_pod):
                published += 1
                if published % PODS_PER_STEP == 0:
                    await asyncio.sleep(0)

    def _due(self, alloc: "Allocation") -> bool:
        return (self.annotations is not None and bool(alloc.container) and self._synced()
                and time.monotonic() - self._published.get((alloc.namespace, alloc.pod_name), -1e18)
                >= self.annotate_interval_s)

    def _seen(self, alloc: "Allocation", by_pod: "dict[PodKey, list[Allocation]] | None") -> bool:
        """Its entry made; its pod's annotation written when due (True then)."""
        self._entry(alloc)
        if not self._due(alloc):
            return False
        key = (alloc.namespace, alloc.pod_name)
        self._publish(key, time.monotonic(), by_pod.get(key, []) if by_pod is not None else None)
        return True

    async def final(self, alloc: "Allocation", timeout: float = 10.0) -> bool:
        """The container has ended: write its last figures now (no rate limit); True once written."""
        u = self._entry(alloc)
        u.state = "ended"
        u.idle()
        if self.annotations is None or not alloc.identified:
            return True
        key = (alloc.namespace, alloc.pod_name)
        self._keep_ended(alloc, u)
        self._publish(key, time.monotonic())
        return await self.annotations.flush(timeout=timeout, pod=key)  # this pod's, not every pending figure

    def forget(self, alloc: "Allocation") -> None:
        """The allocation is retired (its last figures are written)."""
        u = self.usage.pop(alloc.id, None)
        if u is not None and alloc.identified and self.annotations is not None and self.pods is not None:
            self._keep_ended(alloc, u)
        # its region handle is closed by the next tick's snapshot (a worker thread may be reading it now)

    def _keep_ended(self, alloc: "Allocation", u: ContainerUsage) -> None:
        key = (alloc.namespace, alloc.pod_name)
        self._ended.setdefault(key, {})[alloc.id] = (alloc.container, _order(alloc), bool(alloc.gpus), u.entry())
        pod = self._pod(alloc)
        self._ended_uid[key] = alloc.pod_uid or (pod.uid if pod is not None else "")

    # -- the service -------------------------------------------------------------------------------------------
    async def run(self) -> None:
        failing: str | None = None  # the sampling error being suffered (logged once, not every tick)
        try:
            while True:
                started = time.monotonic()
                try:
                    await self.tick()
                    if failing is not None:
                        log.info("profiler_sampling_recovered", error=failing)
                        failing = None
                except GpuBackendError as e:  # an NVML fault: keep trying, say it once
                    if str(e) != failing:
                        log.warning("profiler_sampling_failed", error=str(e))
                        failing = str(e)
                except Exception:
                    log.exception("profiler_tick_failed")
                await self._until_next(started)
        finally:
            collecting = self._collecting
            if collecting is not None and not collecting.done():
                await asyncio.wait([collecting], timeout=5.0)
            self.close()

    async def _until_next(self, started: float) -> None:
        await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    async def tick(self) -> None:
        snap = self._snapshot()
        self._collecting = asyncio.ensure_future(asyncio.to_thread(self._collect, snap))
        collected = await asyncio.shield(self._collecting)  # cancelled, the thread still ends before `close`
        now_mono, now = time.monotonic(), time.time()
        dt = collected.samples.window_s  # 0 on the first sample: nothing to add yet
        self.last = collected.samples
        self.unattributed = collected.unattributed
        per_alloc: dict[str, list] = {}
        for p in collected.samples.processes:
            alloc_id = collected.places.get((p.pid, p.gpu_uuid))
            if alloc_id is not None:
                per_alloc.setdefault(alloc_id, []).append(p)
        copied: dict[str, int] = {}
        for alloc_id in snap.alloc_ids:
            alloc = self.ledger.allocations.get(alloc_id)
            if alloc is not None:
                copied[alloc_id] = self._entry(alloc).add_copies(collected.copies.get(alloc_id, []))
        dma = self._copy_shares(collected.samples, copied)
        metered = self._metered_utils(collected, snap)
        served = self._mps_unmetered_utils(collected, snap, metered)
        metered_mem = self._metered_mem_utils(collected, metered | served)
        for alloc_id in snap.alloc_ids:
            alloc = self.ledger.allocations.get(alloc_id)
            if alloc is None:
                continue
            u = self._entry(alloc)
            u.add_waits(collected.waits.get(alloc_id, []))
            procs = per_alloc.get(alloc_id, [])
            share = dma.get(alloc_id, 0.0)
            mine = metered.get(alloc_id, served.get(alloc_id))
            if (procs or share or mine) and dt > 0:
                memory = sum(p.used_memory_bytes or 0 for p in procs)
                if not memory:
                    memory = collected.region_memory.get(alloc_id, 0)
                util = mine if mine is not None else sum(p.sm_util or 0.0 for p in procs)
                kernel_mem = metered_mem.get(alloc_id)
                if kernel_mem is None:
                    kernel_mem = sum(p.mem_util or 0.0 for p in procs)
                u.add(now, dt, util, kernel_mem + share, memory)
            else:
                u.idle()
        if dt > 0:
            self.sampled_s += dt
            self.sample_at = collected.at
            self.samples += 1
        self._drop_gone_pods()
        await self._publish_due(now_mono)

    # -- internals ---------------------------------------------------------------------------------------------
    def _metered_utils(self, collected: _Collected, snap: _Snapshot) -> dict[str, float]:
        """Per compute-capped allocation, its GPU utilization (%) since the last read of the slots: the GPU time its
        shim counted (its kernels, timed in its own turns, where no other capped context runs) over the wall time.
        NVML's per-process figure cannot give this on a time-sliced GPU (the H200 gives each ~1/6 s period to one
        process: a draw, not a share). NVML's device utilization is exact (the time any kernel ran): what it leaves
        after the GPU's other processes (uncapped containers, processes of no container: their own NVML figures)
        bounds what the capped containers can have run together. Where they claim more (their kernels' timings then
        hold other contexts' slices: uncapped neighbours run outside the turns, elastic containers lent the GPU
        together overlap), each is scaled down by the same factor."""
        last, self._regions_at = self._regions_at, collected.at
        raw: dict[str, float] = {}
        for alloc_id in snap.alloc_ids:
            alloc = self.ledger.allocations.get(alloc_id)
            if alloc is None or not 0 < alloc.compute_limit < 100:
                continue
            counter = self._entry(alloc).gpu_time
            had_baseline = counter.started  # the first read only sets it: nothing to say for that window
            grown = counter.grown(collected.gpu_time.get(alloc_id, []))
            if had_baseline and last is not None and collected.at > last:
                raw[alloc_id] = min(100.0 * grown / ((collected.at - last) * 1e9), 100.0)
        room = _device_utils(collected.samples)
        for proc in collected.samples.processes:
            key = (proc.pid, proc.gpu_uuid)
            # an MPS server's figure is its clients' work (ALNAIR_MPS_PIPE_DIR): the capped containers' own
            if proc.gpu_uuid in room and collected.places.get(key) not in raw and key not in collected.mps_servers:
                room[proc.gpu_uuid] -= proc.sm_util or 0.0
        claimed = self._per_gpu_sum(raw)
        out = {}
        for alloc_id, util in raw.items():
            gpu = self.ledger.allocations[alloc_id].gpu_uuid
            if gpu in room and claimed[gpu] > max(room[gpu], 0.0):
                util *= max(room[gpu], 0.0) / claimed[gpu]  # (claimed > 0 here)
            out[alloc_id] = util
        return out

    def _mps_unmetered_utils(self, collected: _Collected, snap: _Snapshot,
                             metered: dict[str, float]) -> dict[str, float]:
        """Under MPS, per allocation its shim does not meter (compute uncapped) on a GPU whose MPS server NVML
        sampled: NVML books every client's work to the server (an uncapped client's own samples read 0 on an H100),
        so what the server ran beyond what the capped containers' shims timed is the uncapped clients'. All of it to
        the one that launched this tick; among several, split by the launches their shims counted (launches are not
        time: a container of few long kernels gets too little beside one of many short ones)."""
        served: dict[str, float] = {}
        for proc in collected.samples.processes:
            if (proc.pid, proc.gpu_uuid) in collected.mps_servers:
                served[proc.gpu_uuid] = served.get(proc.gpu_uuid, 0.0) + (proc.sm_util or 0.0)
        device = _device_utils(collected.samples)
        claimed = self._per_gpu_sum(metered)
        counts: dict[str, dict[str, int]] = {}
        for alloc_id in snap.alloc_ids:
            alloc = self.ledger.allocations.get(alloc_id)
            if alloc is None or 0 < alloc.compute_limit < 100:
                continue
            grown = self._entry(alloc).launches.grown(collected.launches.get(alloc_id, []))  # every tick: its baseline
            counts.setdefault(alloc.gpu_uuid, {})[alloc_id] = grown
        out: dict[str, float] = {}
        for gpu, by_alloc in counts.items():
            if gpu not in served:
                continue
            left = max(0.0, min(served[gpu], device.get(gpu, served[gpu])) - claimed.get(gpu, 0.0))
            total = sum(by_alloc.values())
            for alloc_id, n in by_alloc.items():
                if n > 0:  # one that launched nothing this tick ran nothing of it
                    out[alloc_id] = left * n / total
        return out

    def _per_gpu_sum(self, utils: dict[str, float]) -> dict[str, float]:
        """Per GPU uuid, the sum of its allocations' figures in `utils` (allocation id -> figure)."""
        out: dict[str, float] = {}
        for alloc_id, util in utils.items():
            gpu = self.ledger.allocations[alloc_id].gpu_uuid
            out[gpu] = out.get(gpu, 0.0) + util
        return out

    def _metered_mem_utils(self, collected: _Collected, metered: dict[str, float]) -> dict[str, float]:
        """Per compute-capped allocation, its part of the memory utilization NVML gave the capped containers'
        processes on its GPU, split by their metered GPU utilization. NVML's per-process memory figure on a
        time-sliced GPU is a draw as its SM figure is (an H100 gave one of two capped matmul processes the device's
        whole 24 % every second and the other 0), so only the capped processes' sum is taken from it. Where the
        capped containers of a GPU metered no GPU time, each keeps its own processes' figure. Under MPS the server's
        sample is its clients' (they have none): it goes into the pool too, so an uncapped client's memory traffic,
        which NVML no longer tells apart, is then split among the capped containers of its GPU."""
        pool: dict[str, float] = {}
        for proc in collected.samples.processes:
            key = (proc.pid, proc.gpu_uuid)
            if collected.places.get(key) in metered or key in collected.mps_servers:
                pool[proc.gpu_uuid] = pool.get(proc.gpu_uuid, 0.0) + (proc.mem_util or 0.0)
        total = self._per_gpu_sum(metered)
        out = {}
        for alloc_id, util in metered.items():
            gpu = self.ledger.allocations[alloc_id].gpu_uuid
            if total[gpu] > 0:
                out[alloc_id] = pool.get(gpu, 0.0) * util / total[gpu]
        return out

    def _copy_shares(self, samples: Samples, copied: dict[str, int]) -> dict[str, float]:
        """Per allocation, its part of its GPU's memory-copy utilization that no process's own (kernel) memory
        utilization explains: copy-engine transfers, which NVML attributes to no process. Split by the bytes each
        container's copies moved this tick (counted by the shim in the region); nothing where nobody copied."""
        explained: dict[str, float] = {}
        for p in samples.processes:
            explained[p.gpu_uuid] = explained.get(p.gpu_uuid, 0.0) + (p.mem_util or 0.0)
        by_gpu: dict[str, list[tuple[str, int]]] = {}
        for alloc_id, n in copied.items():
            alloc = self.ledger.allocations.get(alloc_id)
            if alloc is not None and n > 0:
                by_gpu.setdefault(alloc.gpu_uuid, []).append((alloc_id, n))
        out: dict[str, float] = {}
        for g in samples.gpus:
            movers = by_gpu.get(g.uuid)
            if not movers or g.memcpy_util is None:
                continue
            left = max(0.0, g.memcpy_util - explained.get(g.uuid, 0.0))
            total = sum(n for _, n in movers)
            for alloc_id, n in movers:
                out[alloc_id] = left * n / total
        return out

    def _entry(self, alloc: "Allocation") -> ContainerUsage:
        u = self.usage.get(alloc.id)
        if u is None:
            u = self.usage[alloc.id] = ContainerUsage(alloc.gpu_uuid, alloc.id, alloc.created_at,
                                                      alloc.memory_limit, alloc.compute_limit)
        if not u.resumed and self._synced() and alloc.identified:
            # After an agent restart: carry on from what the pod says of this allocation (once, before this run's
            # first write; the pod watch must have listed the pods for that).
            pod = self._pod(alloc)
            u.resume(gpu_entry(parse_usage(pod.usage).get(alloc.container), alloc.id)
                     if pod is not None and alloc.container else None)
        u.memory_limit_bytes, u.compute_limit_percent = alloc.memory_limit, alloc.compute_limit
        return u

    def _synced(self) -> bool:
        return self.pods is None or self.pods.synced

    def _pod(self, alloc: "Allocation") -> "PodInfo | None":
        if self.pods is None or not alloc.identified:
            return None
        return self.pods.get(alloc.pod_uid) if alloc.pod_uid else self.pods.find(alloc.namespace, alloc.pod_name)

    def _snapshot(self) -> _Snapshot:
        containers: dict[str, dict[tuple[str, str], str]] = {}
        pod_uids: dict[str, str] = {}
        gpus: dict[str, str] = {}
        for alloc in self.ledger.allocations.values():
            gpus[alloc.id] = alloc.gpu_uuid
            pod = self._pod(alloc)
            if pod is None:
                if alloc.pod_uid:
                    pod_uids[alloc.id] = alloc.pod_uid
                continue
            pod_uids[alloc.id] = pod.uid
            on_gpu = containers.setdefault(alloc.gpu_uuid, {})
            for name, cid in pod.container_ids:
                if alloc.serves(name):  # a DRA claim's slice may serve several containers
                    on_gpu[(pod.uid, cid)] = alloc.id
        for alloc_id in [i for i in self._regions if i not in self.ledger.allocations]:
            self._regions.pop(alloc_id).close()
        return _Snapshot(tuple(self.ledger.allocations), containers, pod_uids, gpus)

    def _region(self, alloc_id: str) -> Region | None:
        region = self._regions.get(alloc_id)
        if region is None:
            try:
                region = self._regions[alloc_id] = self.workspace.open_region(alloc_id)
            except RegionError:
                return None
        return region

    def _collect(self, snap: _Snapshot) -> _Collected:
        """In a worker thread: sample the GPUs, read the region slots, place every process."""
        samples = self.backend.sample()
        at = time.monotonic()
        slots: dict[str, list[SlotPid]] = {}  # GPU uuid -> the slots of its allocations' regions
        waits: dict[str, Slots] = {}
        copies: dict[str, Slots] = {}
        gpu_time: dict[str, Slots] = {}
        launches: dict[str, Slots] = {}
        region_memory: dict[str, int] = {}
        for alloc_id in snap.alloc_ids:
            region = self._region(alloc_id)
            if region is None:
                continue
            try:
                readings = region.slots()
                region_memory[alloc_id] = region.memory_in_use(readings)
            except RegionError:
                continue
            on_gpu = slots.setdefault(snap.gpus[alloc_id], [])
            for s in readings:
                on_gpu.append(SlotPid(alloc_id, s.pid, s.start_time, snap.pod_uids.get(alloc_id, "")))
            waits[alloc_id] = [((s.index, s.pid, s.start_time), s.wait_ns) for s in readings]
            copies[alloc_id] = [((s.index, s.pid, s.start_time), s.copy_bytes) for s in readings]
            gpu_time[alloc_id] = [((s.index, s.pid, s.start_time), s.gpu_ns) for s in readings]
            launches[alloc_id] = [((s.index, s.pid, s.start_time), s.launches) for s in readings]
        places: dict[tuple[int, str], str] = {}
        placed: dict[tuple[int, str], tuple[str, int]] = {}
        unattributed: dict[str, int] = {g.uuid: 0 for g in samples.gpus}
        mps_servers: set[tuple[int, str]] = set()
        for p in samples.processes:
            key = (p.pid, p.gpu_uuid)
            # per GPU: a process of a container of several GPUs is on each of them, for its allocation there
            if key in places:
                continue
            place = self.mapper.place(p.pid, snap.containers.get(p.gpu_uuid, {}), slots.get(p.gpu_uuid, []))
            owner = place.alloc_id if place is not None else None
            started = self.mapper.proc.start_time(p.pid)
            before = self._placed.get(key)
            if owner is None and before is not None and started == before[1] and before[0] in snap.gpus:
                # The same process (same start time) its allocation's evidence no longer shows for a moment: its
                # slot reclaimed as it exits while the driver still lists it, its container's status in flux. It
                # stays where it was rather than flicker to unattributed and back (a process never changes
                # container).
                owner = before[0]
            if owner is None:
                unattributed[p.gpu_uuid] = unattributed.get(p.gpu_uuid, 0) + 1
                if self.mapper.proc.comm(p.pid) == MPS_SERVER_COMM:
                    mps_servers.add(key)
                continue
            places[key] = owner
            if started is not None:
                placed[key] = (owner, started)
        self._placed = placed
        return _Collected(samples, places, unattributed, waits, copies, region_memory, gpu_time, at,
                          frozenset(mps_servers), launches)

    def _drop_gone_pods(self) -> None:
        if self.pods is None or not self.pods.synced:
            return
        for key in list(self._ended):
            pod, uid = self.pods.find(*key), self._ended_uid.get(key, "")
            if pod is None or (uid and pod.uid != uid):  # gone, or a new pod of the same name (StatefulSet)
                del self._ended[key]
                self._ended_uid.pop(key, None)
                self._published.pop(key, None)

    def _pod_keys(self) -> dict[PodKey, list["Allocation"]]:
        out: dict[PodKey, list[Allocation]] = {}
        for alloc in self.ledger.allocations.values():
            if alloc.identified and alloc.container:
                out.setdefault((alloc.namespace, alloc.pod_name), []).append(alloc)
        return out

    async def _publish_due(self, now: float) -> None:
        if self.annotations is None or not self._synced():
            return  # never write before the pods' current annotations are known: they are merged
        published = 0
        for key, allocs in self._pod_keys().items():
            if now - self._published.get(key, -1e18) >= self.annotate_interval_s:
                if published and published % PODS_PER_STEP == 0:
                    await asyncio.sleep(0)
                self._publish(key, now, allocs)
                published += 1

    def _publish(self, key: PodKey, now: float, allocs: "list[Allocation] | None" = None) -> None:
        """Write the pod's usage annotation: as found on the pod, with this agent's entries replaced (`allocs`: the
        pod's allocations, where the caller has them: a pass over every pod must not look them up per pod; it may
        have found them before it gave the loop back, so one retired since is skipped: its final figures are in
        `_ended`, and an entry made again for it would reset them and never be forgotten)."""
        assert self.annotations is not None
        entries: dict[str, object] = {}
        pod = self.pods.find(*key) if self.pods is not None else None
        if pod is not None:
            entries.update(parse_usage(pod.usage))
        # this agent's figures, per allocation (a container's GPU each): its container key, its order among the
        # container's GPUs, whether that container has several, its entry; a live one's over its kept last ones
        ours: dict[str, tuple[str, tuple[int, float], bool, dict[str, object]]] = {}
        uid = self._ended_uid.get(key, "")
        if pod is None or not uid or pod.uid == uid:
            ours.update(self._ended.get(key, {}))
        if allocs is None:
            allocs = [a for a in self.ledger.allocations.values()
                      if a.identified and a.container and (a.namespace, a.pod_name) == key]
        held = self.ledger.allocations
        for alloc in allocs:
            if alloc.id not in held:
                continue
            u = self.usage.get(alloc.id) or self._entry(alloc)
            ours[alloc.id] = (alloc.container, _order(alloc), bool(alloc.gpus), u.entry())
        by_container: dict[str, list[tuple[tuple[int, float], bool, dict[str, object]]]] = {}
        for container, order, several, entry in ours.values():
            by_container.setdefault(container, []).append((order, several, entry))
        for container, parts in by_container.items():
            parts.sort(key=lambda p: p[0])
            entries[container] = container_entry([e for _, _, e in parts],
                                                 several=len(parts) > 1 or any(f for _, f, _ in parts))
        self._published[key] = now
        self.annotations.set_pod(key[0], key[1], {USAGE_ANNOTATION: render_usage(entries)})

    def close(self) -> None:
        for region in self._regions.values():
            region.close()
        self._regions.clear()
