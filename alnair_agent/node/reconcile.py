"""Keeps the allocator's records true to kubelet and the pods: restart recovery, ended containers, heartbeats.

- kubelet's pod-resources API is the authority on which container holds which device IDs: IDs it reports that
  no record covers are held (never offered again), and an unidentified record learns its pod from it.
- A container has ended when its pod says so (terminated, or the pod is gone), or, without an API server, when
  kubelet no longer reports its devices. Its last figures are written to the pod, and only then is its
  workspace removed. A workspace whose devices kubelet still reports for a live container is never removed.
- The agent's heartbeat goes into every live region.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import structlog

from alnair_agent import constants as C
from alnair_agent.node.allocator import Allocator
from alnair_agent.kubelet.podresources import DeviceAssignment
from alnair_agent.kube.pods import PodInfo, container_ended
from alnair_agent.node.region import Region, RegionError
from alnair_agent.node.workspace import Allocation, Workspace

log = structlog.get_logger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
# A fresh allocation is not yet visible in pod-resources (kubelet records it as the container is created):
# only after this long may its absence there mean that the container is gone.
UNSEEN_GRACE_S = 30.0


class PodStates(Protocol):
    """What the reconciler needs of the pod watch (alnair_agent.kube.podwatch.PodWatch)."""

    @property
    def synced(self) -> bool: ...

    def get(self, uid: str) -> PodInfo | None: ...

    def find(self, namespace: str, name: str) -> PodInfo | None: ...


class AnnotationSink(Protocol):
    def set_pod(self, namespace: str, name: str, annotations: dict[str, str | None]) -> None: ...

    def set_node(self, annotations: dict[str, str | None]) -> None: ...

    async def flush(self, timeout: float) -> bool: ...

    def forget_pod(self, namespace: str, name: str) -> None: ...


def node_gpu_devices(allocator: Allocator) -> dict[str, object]:
    """The node annotation the scheduler extender reads: each GPU's units, free units and health."""
    inventory = allocator.inventory
    rooms = {room.uuid: room for room in allocator.rooms()}
    gpus = []
    for gpu in inventory.gpus.values():
        room = rooms.get(gpu.uuid)
        gpus.append({
            "uuid": gpu.uuid, "index": gpu.info.index, "name": gpu.info.name, "healthy": gpu.healthy,
            "memoryUnits": gpu.units[C.RESOURCE_MEMORY],
            "memoryUnitsFree": room.free[C.RESOURCE_MEMORY] if room else 0,
            "computeUnits": gpu.units[C.RESOURCE_COMPUTE],
            "computeUnitsFree": room.free[C.RESOURCE_COMPUTE] if room else 0,
        })
    return {"memoryUnitMiB": inventory.memory_unit_bytes >> 20, "gpus": gpus}


class UsageSink(Protocol):
    """What the reconciler needs of the profiler (alnair_agent.profiler.service.Profiler)."""

    def seen(self, alloc: Allocation) -> None: ...

    async def final(self, alloc: Allocation, timeout: float = 10.0) -> bool: ...

    def forget(self, alloc: Allocation) -> None: ...


class Reconciler:
    def __init__(
        self,
        allocator: Allocator,
        workspace: Workspace,
        list_held: Callable[[], Awaitable[list[DeviceAssignment]]] | None,
        pods: PodStates | None,
        annotations: AnnotationSink | None,
        interval_s: float,
        unseen_grace_s: float = UNSEEN_GRACE_S,
        usage: UsageSink | None = None,
    ) -> None:
        self.allocator = allocator
        self.workspace = workspace
        self.list_held = list_held
        self.pods = pods
        self.annotations = annotations
        self.interval_s = interval_s
        self.unseen_grace_s = unseen_grace_s
        self.usage = usage
        self._regions: dict[str, Region] = {}
        self.kick = asyncio.Event()

    def _forget_region(self, alloc_id: str) -> None:
        region = self._regions.pop(alloc_id, None)
        if region is not None:
            region.close()

    def _region(self, alloc_id: str) -> Region | None:
        region = self._regions.get(alloc_id)
        if region is None:
            try:
                region = self.workspace.open_region(alloc_id)
            except RegionError as e:
                log.warning("region_unreadable", allocation=alloc_id, error=str(e))
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

    async def once(self) -> None:
        held = await self._held()
        by_id: dict[str, DeviceAssignment] = {}
        if held is not None:
            ours = self.allocator.recorded_ids()
            by_id = {i: h for h in held if h.resource in C.RESOURCES for i in h.device_ids}
            external = {i for i in by_id if i not in ours}
            if external != self.allocator.external_held:
                log.info("pod_resources_external_devices", count=len(external))
                self.allocator.external_held = external
            self._learn_identities(by_id)
        for alloc_id in [i for i in self._regions if i not in self.allocator.allocations]:
            self._forget_region(alloc_id)  # abandoned by the allocator
        now = time.time()
        for alloc in list(self.allocator.allocations.values()):
            if self._ended(alloc, by_id if held is not None else None, now):
                await self._retire(alloc)
            elif self.usage is not None and alloc.identified:
                self.usage.seen(alloc)
        if self.annotations is not None:
            self.annotations.set_node({C.NODE_GPU_DEVICES: json.dumps(node_gpu_devices(self.allocator), sort_keys=True)})

    def _learn_identities(self, by_id: dict[str, DeviceAssignment]) -> None:
        for alloc in self.allocator.allocations.values():
            if alloc.identified:
                continue
            owner = next((by_id[i] for i in alloc.all_ids() if i in by_id), None)
            if owner is not None:
                alloc.namespace, alloc.pod_name, alloc.container = owner.namespace, owner.pod, owner.container
                self.workspace.save(alloc)
                log.info("allocation_identified", allocation=alloc.id, pod=f"{owner.namespace}/{owner.pod}",
                         container=owner.container)

    def _ended(self, alloc: Allocation, by_id: dict[str, DeviceAssignment] | None, now: float) -> bool:
        in_use = by_id is not None and any(i in by_id for i in alloc.all_ids())
        if self.pods is not None and self.pods.synced and alloc.identified:
            return container_ended(self._pod(alloc), alloc.container)
        if by_id is None:
            return False  # no authority to ask: keep it
        return not in_use and now - alloc.created_at > self.unseen_grace_s

    async def _retire(self, alloc: Allocation) -> None:
        if self.usage is not None and alloc.identified:
            if not await self.usage.final(alloc, timeout=10.0):
                log.warning("allocation_final_figures_pending", allocation=alloc.id)
                return  # keep the workspace until the figures are written; retried next round
            self.usage.forget(alloc)
        self._forget_region(alloc.id)
        self.workspace.remove(alloc.id)
        self.allocator.remove(alloc.id)
        if self.annotations is not None and alloc.identified and self._pod_gone(alloc):
            # A later pod of the same name (StatefulSet) must get its annotations written afresh.
            self.annotations.forget_pod(alloc.namespace, alloc.pod_name)
        log.info("allocation_ended", allocation=alloc.id, pod=f"{alloc.namespace}/{alloc.pod_name}" if alloc.identified else None,
                 container=alloc.container or None)

    def _pod(self, alloc: Allocation) -> PodInfo | None:
        """The allocation's pod as the watch knows it (by uid; by name for one identified from pod-resources)."""
        assert self.pods is not None
        return self.pods.get(alloc.pod_uid) if alloc.pod_uid else self.pods.find(alloc.namespace, alloc.pod_name)

    def _pod_gone(self, alloc: Allocation) -> bool:
        return self.pods is not None and self.pods.synced and self._pod(alloc) is None

    def beat(self) -> None:
        now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        for alloc_id in list(self.allocator.allocations):
            region = self._region(alloc_id)
            if region is not None:
                region.beat(now)

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
            self.beat()
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    def close(self) -> None:
        for region in self._regions.values():
            region.close()
        self._regions.clear()
