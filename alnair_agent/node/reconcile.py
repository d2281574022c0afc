"""Keeps the ledger's records true to kubelet and the pods: restart recovery, ended containers, heartbeats.

- kubelet's pod-resources API is the authority on which container holds which device IDs: IDs it reports that
  no record covers are held (never offered again), an unidentified record learns its pod from it, and a record
  whose devices kubelet reports for another container is corrected to that container.
- A record is retired (its last figures written to the pod, then its folder removed) only when its container has
  ended (per the pod: terminated for good, or the pod is gone; without an API server: unseen by kubelet for a
  while) AND kubelet no longer reports the container's devices. Nothing kubelet still reports is ever retired.
- The node annotation (`alnair_agent.node.gpu_devices`) reports free units, the pods they account for and a
  heartbeat; the pod annotation `ai.centaurus.io/allocated` confirms a pod's admission (it releases the
  extender's node lock, so it is written at once).
- The agent's heartbeat goes into every live region.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from datetime import datetime, timezone
from typing import Protocol

import structlog

from alnair_agent import constants as C
from alnair_agent.kube.pod_source import PodSource
from alnair_agent.kube.pods import PodInfo, container_ended
from alnair_agent.kubelet.admission import Allocator
from alnair_agent.kubelet.podresources import DeviceAssignment
from alnair_agent.node.decision import ALLOCATED_ANNOTATION, Granted, allocated_json
from alnair_agent.node.gpu_devices import HEARTBEAT_S, GpuReport, NodeReport
from alnair_agent.node.ledger import Ledger
from alnair_agent.node.region import Region, RegionError
from alnair_agent.node.workspace import Allocation, Workspace
from alnair_agent.profiler.sink import UsageSink

log = structlog.get_logger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
# A fresh allocation is not yet visible in pod-resources (kubelet records it as the container is created):
# only after this long may its absence there mean that the container is gone.
UNSEEN_GRACE_S = 30.0
# One reconcile pass waits at most this long for ended containers' final figures to be written (an API outage
# must not hold the pass: what is not written yet is retried on the next pass, the folder kept meanwhile).
FINAL_FLUSH_S = 2.0
# Passes over every record (the folder sweep, the heartbeat) give the event loop back after this many records: a
# pass over hundreds of slices is milliseconds of file calls, and a kubelet call arriving meanwhile must not wait
# for all of it.
RECORDS_PER_STEP = 8


class AnnotationSink(Protocol):
    def set_pod(self, namespace: str, name: str, annotations: dict[str, str | None], urgent: bool = False) -> None: ...

    def written_pod(self, namespace: str, name: str) -> dict[str, str | None]: ...

    def set_node(self, annotations: dict[str, str | None]) -> None: ...

    async def flush(self, timeout: float, pod: tuple[str, str] | None = None) -> bool: ...

    def forget_pod(self, namespace: str, name: str) -> None: ...


def node_report(allocator: Allocator, heartbeat: datetime) -> NodeReport:
    """The node annotation the scheduler extender reads: each GPU's units, free units and health."""
    inventory = allocator.inventory
    free, pods = allocator.report()
    rooms = {room.uuid: room for room in free}
    gpus = []
    for gpu in inventory.gpus.values():
        room = rooms.get(gpu.uuid)
        gpus.append(GpuReport(
            index=gpu.info.index, uuid=gpu.uuid, name=gpu.info.name, healthy=gpu.healthy,
            memory_units=gpu.units[C.RESOURCE_MEMORY], memory_free=room.memory_free if room else 0,
            compute_units=gpu.units[C.RESOURCE_COMPUTE], compute_free=room.compute_free if room else 0,
        ))
    return NodeReport(inventory.memory_unit_bytes >> 20, tuple(gpus), heartbeat, frozenset(pods))


class Reconciler:
    def __init__(
        self,
        ledger: Ledger,
        allocator: Allocator,
        workspace: Workspace,
        list_held: Callable[[], Awaitable[list[DeviceAssignment]]] | None,
        pods: PodSource | None,
        annotations: AnnotationSink | None,
        interval_s: float,
        unseen_grace_s: float = UNSEEN_GRACE_S,
        usage: UsageSink | None = None,
    ) -> None:
        self.ledger = ledger
        self.allocator = allocator  # the device plugin's admission: the node report, and pods to confirm
        self.workspace = workspace
        self.list_held = list_held
        self.pods = pods
        self.annotations = annotations
        self.interval_s = interval_s
        self.unseen_grace_s = unseen_grace_s
        self.usage = usage
        self._regions: dict[str, Region] = {}
        self.kick = asyncio.Event()
        self._report: NodeReport | None = None  # last node report set (its heartbeat is kept while nothing changes)
        self._finalized: set[str] = set()  # ended records whose last figures are published
        allocator.on_pod_allocated = self._confirm

    def _forget_region(self, alloc_id: str) -> None:
        region = self._regions.pop(alloc_id, None)
        if region is not None:
            region.close()

    def _region(self, alloc_id: str) -> Region | None:
        region = self._regions.get(alloc_id)
        if region is None:
            try:
                region = self.workspace.open_region(alloc_id)
            except RegionError:  # the workspace has said so, once per bad file
                return None
            self._regions[alloc_id] = region
        return region

    async def _held(self) -> list[DeviceAssignment] | None:
        if self.list_held is None:
            return None
        try:
            return await self.list_held()
        except Exception as e:  # noqa: BLE001 - kubelet briefly unreachable must not stop the agent
            log.warning("pod_resources_unavailable", error=str(e))
            return None

    def _save(self, alloc: Allocation) -> None:
        """Write a corrected record; a full or failing disk is logged and the record kept in memory (it is
        written again on the next change, and kubelet's pod-resources re-teaches it after a restart)."""
        try:
            self.workspace.save(alloc)
        except OSError as e:
            log.warning("allocation_record_write_failed", allocation=alloc.id, error=str(e))

    async def _sweep(self) -> None:
        records = list(self.ledger.allocations.values())
        for n, alloc in enumerate(records):
            if n and n % RECORDS_PER_STEP == 0:
                await asyncio.sleep(0)
            if alloc.id not in self.ledger.allocations:
                continue  # retired meanwhile: its folder is gone
            freed = self.workspace.sweep(alloc.id)
            if freed:
                log.warning("container_files_removed", allocation=alloc.id, pod=alloc.ref(), bytes=freed,
                            reason="only the region belongs in /run/alnair")

    async def once(self) -> None:
        await self._sweep()  # first: what a container piled up in its folder must not fail the rest of the pass
        held = await self._held()
        by_id: dict[str, DeviceAssignment] | None = None
        if held is not None:
            by_id = {i: h for h in held if h.resource in C.RESOURCES for i in h.device_ids}
            self._correct_identities(by_id)
            ours = self.ledger.recorded_ids()
            external = {i for i in by_id if i not in ours}
            if external != self.ledger.external_held:
                log.info("pod_resources_external_devices", count=len(external))
                self.ledger.external_held = external
        elif self.list_held is None:
            by_id = None
        for alloc_id in [i for i in self._regions if i not in self.ledger.allocations]:
            self._forget_region(alloc_id)  # abandoned by the allocator
        now = time.time()
        ended: list[Allocation] = []
        live: list[Allocation] = []
        for n, alloc in enumerate(list(self.ledger.allocations.values())):
            if n and n % RECORDS_PER_STEP == 0:
                await asyncio.sleep(0)
            if alloc.id not in self.ledger.allocations:
                continue  # retired meanwhile
            if self._ended(alloc, by_id, now):
                ended.append(alloc)
            elif self.usage is not None and alloc.identified:
                live.append(alloc)
        if self.usage is not None and live:
            await self.usage.seen_all(live)
        if ended:
            await self._finish(ended, by_id, asked=held is not None)
        self._set_node_report()

    def _set_node_report(self) -> None:
        if self.annotations is None:
            return
        now = datetime.now(timezone.utc)
        report = node_report(self.allocator, now)
        last = self._report
        if last is not None and last.heartbeat is not None and replace(report, heartbeat=None) == replace(
                last, heartbeat=None) and (now - last.heartbeat).total_seconds() < HEARTBEAT_S:
            report = last  # nothing changed and the heartbeat is recent: no write
        self._report = report
        self.annotations.set_node({C.NODE_GPU_DEVICES: report.to_json()})

    def _confirm(self, pod: PodInfo, granted: dict[str, Granted]) -> None:
        """Every Alnair container of the pod is allocated: say so on the pod at once (it releases the extender's
        node lock) and refresh the node report."""
        if self.annotations is not None:
            self.annotations.set_pod(pod.namespace, pod.name,
                                     {ALLOCATED_ANNOTATION: allocated_json(self.allocator.node_name, granted)},
                                     urgent=True)
        self.kick.set()

    def _learn_identities(self, by_id: dict[str, DeviceAssignment]) -> None:
        for alloc in self.ledger.allocations.values():
            if alloc.identified:
                continue
            owner = next((by_id[i] for i in alloc.all_ids() if i in by_id), None)
            if owner is not None:
                alloc.namespace, alloc.pod_name, alloc.container = owner.namespace, owner.pod, owner.container
                self._save(alloc)
                log.info("allocation_identified", allocation=alloc.id, pod=f"{owner.namespace}/{owner.pod}",
                         container=owner.container)

    def _correct_identities(self, by_id: dict[str, DeviceAssignment]) -> None:
        """kubelet's record wins: a record whose devices kubelet reports for another container becomes that
        container's (its pod UID from the watch), unless another record already is that container's."""
        self._learn_identities(by_id)
        claimed = {(a.namespace, a.pod_name, a.container) for a in self.ledger.allocations.values()
                   if a.identified}
        for alloc in self.ledger.allocations.values():
            if not alloc.identified or not self.ledger.live(alloc):
                continue
            owners = {(by_id[i].namespace, by_id[i].pod, by_id[i].container) for i in alloc.all_ids() if i in by_id}
            if len(owners) != 1:
                continue
            owner = owners.pop()
            mine = (alloc.namespace, alloc.pod_name, alloc.container)
            if owner == mine or owner in claimed:
                continue
            pod = self.pods.find(owner[0], owner[1]) if self.pods is not None else None
            log.warning("allocation_identity_corrected", allocation=alloc.id, was="/".join(mine),
                        now="/".join(owner))
            claimed.discard(mine)
            claimed.add(owner)
            alloc.namespace, alloc.pod_name, alloc.container = owner
            alloc.pod_uid = pod.uid if pod is not None else ""
            self._save(alloc)

    def _reported(self, alloc: Allocation, by_id: dict[str, DeviceAssignment]) -> bool:
        """Whether kubelet still reports any of the record's devices for the record's own container."""
        for i in alloc.all_ids():
            a = by_id.get(i)
            if a is not None and (not alloc.identified or (a.namespace, a.pod, a.container) == (
                    alloc.namespace, alloc.pod_name, alloc.container)):
                return True
        return False

    def _ended(self, alloc: Allocation, by_id: dict[str, DeviceAssignment] | None, now: float) -> bool:
        """Whether the record's container has ended for good: per its pod (terminated for good, or the pod is gone)
        or because kubelet gave its devices to another; without an API server, when kubelet has not reported it
        for a while. A DRA claim's slice never ends here: the DRA front-end retires it when kubelet unprepares the
        claim (alnair_agent.dra.prepare)."""
        if alloc.claim is not None:
            return False
        if self.pods is not None and self.pods.synced and alloc.identified:
            return alloc.id in self.ledger.freed_by_kubelet or container_ended(self._pod(alloc), alloc.container)
        if by_id is None:
            return False  # no authority to ask: keep it
        return not self._reported(alloc, by_id) and now - alloc.created_at > self.unseen_grace_s

    async def _finish(self, ended: list[Allocation], by_id: dict[str, DeviceAssignment] | None, asked: bool) -> None:
        """Write the ended containers' last figures at once (one bounded wait for all of them: an API outage must
        not hold the pass), then remove the folders of those kubelet no longer reports, once their figures are
        written; the rest wait for a later pass. Nothing kubelet still reports is removed."""
        fresh = [a for a in ended if a.id not in self._finalized]
        if self.usage is not None and self.annotations is not None:
            for alloc in fresh:
                if alloc.identified:
                    await self.usage.final(alloc, timeout=0)  # published; the flush below waits for all at once
        self._finalized.update(a.id for a in fresh)
        retirable = [a for a in ended if (self.list_held is None or asked)
                     and not (by_id is not None and self._reported(a, by_id))]
        if not retirable and not fresh:
            return
        if self.annotations is not None and not await self.annotations.flush(timeout=FINAL_FLUSH_S):
            log.warning("allocation_final_figures_pending", allocations=len(ended))
            return  # keep the folders until the figures are written; retried next pass
        for alloc in retirable:
            if self.usage is not None and alloc.identified:
                self.usage.forget(alloc)
            self._finalized.discard(alloc.id)
            self._forget_region(alloc.id)
            self.workspace.remove(alloc.id)
            self.ledger.remove(alloc.id)
            if self.annotations is not None and alloc.identified and self._pod_gone(alloc):
                # A later pod of the same name (StatefulSet) must get its annotations written afresh.
                self.annotations.forget_pod(alloc.namespace, alloc.pod_name)
            log.info("allocation_ended", allocation=alloc.id, pod=alloc.ref(), container=alloc.container or None)

    def _pod(self, alloc: Allocation) -> PodInfo | None:
        """The allocation's pod as the watch knows it (by uid; by name for one identified from pod-resources)."""
        assert self.pods is not None
        return self.pods.get(alloc.pod_uid) if alloc.pod_uid else self.pods.find(alloc.namespace, alloc.pod_name)

    def _pod_gone(self, alloc: Allocation) -> bool:
        return self.pods is not None and self.pods.synced and self._pod(alloc) is None

    def beat(self, alloc_ids: list[str] | None = None) -> None:
        """The heartbeat into every live region (or those of `alloc_ids`); agent fields the container overwrote are
        put back (the agent is their only writer: a container that zeroes its own limits, or scribbles over its
        turns, gets them rewritten within one beat). Only the agent's own record of them counts
        (region.AgentBlock), and limits that differ from the allocation's are set from the allocation."""
        now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        for alloc_id in list(self.ledger.allocations) if alloc_ids is None else alloc_ids:
            alloc = self.ledger.allocations.get(alloc_id)
            if alloc is None:
                continue  # retired since the beat began
            region = self._region(alloc_id)
            if region is None:
                continue
            try:
                region.beat(now)
                changed = region.restore()
                if changed:
                    log.warning("region_restored", allocation=alloc_id, pod=alloc.ref(),
                                fields={f: found for f, (found, _) in changed.items()})
                if (region.memory_limit, region.compute_limit) != (alloc.memory_limit, alloc.compute_limit):
                    log.warning("region_limits_restored", allocation=alloc_id, pod=alloc.ref(),
                                found=[region.memory_limit, region.compute_limit],
                                limits=[alloc.memory_limit, alloc.compute_limit])
                    region.set_limits(alloc.memory_limit, alloc.compute_limit)
            except (OSError, RegionError, ValueError) as e:
                log.warning("region_write_failed", allocation=alloc_id, error=str(e))
                self._forget_region(alloc_id)

    async def run(self) -> None:
        try:
            while True:
                await self.once()
                self.kick.clear()
                try:
                    await asyncio.wait_for(self.kick.wait(), self.interval_s)
                except TimeoutError:
                    pass
        finally:
            self.close()

    async def run_heartbeat(self) -> None:
        while True:
            ids = list(self.ledger.allocations)
            for start in range(0, len(ids), RECORDS_PER_STEP):
                if start:
                    await asyncio.sleep(0)
                self.beat(ids[start:start + RECORDS_PER_STEP])
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    def close(self) -> None:
        for region in self._regions.values():
            region.close()
        self._regions.clear()
