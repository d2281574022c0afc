"""The node's one ledger: every allocation record, whichever front-end made it, and what they leave free.

Both front-ends book units here, through the same calls: the device plugin's admission
(alnair_agent/kubelet/admission.py) and the DRA front-end's prepare (alnair_agent/dra/prepare.py) `add` a record once
its folder and region are on disk and `remove` it when retired; they, the node report and the extender's view all
count free units by `rooms`/`room`, from the records every time. The reconciler, profiler and dispatcher read the
records (`allocations`) and never write them.

A record holds its units while it is `live`: a device plugin container's until kubelet frees its devices or its pod
or container ends (kubelet's record and the pod win); a DRA claim's slice until the DRA front-end retires it.
"""

from __future__ import annotations

from collections import Counter

from alnair_agent.constants import RESOURCE_COMPUTE, RESOURCE_MEMORY
from alnair_agent.kube.pod_source import PodSource
from alnair_agent.node import fit
from alnair_agent.node.inventory import Gpu, Inventory
from alnair_agent.node.workspace import Allocation


class Ledger:
    def __init__(self, inventory: Inventory, pods: PodSource | None = None) -> None:
        self.inventory = inventory
        self.pods = pods
        # The records: allocation id -> record.
        self.allocations: dict[str, Allocation] = {}
        # Device IDs kubelet reports held (pod-resources) that no record of ours covers: never offered again.
        self.external_held: set[str] = set()
        # Records whose devices kubelet offered as available again: it freed them (the container is gone).
        self.freed_by_kubelet: set[str] = set()

    @property
    def external_held(self) -> set[str]:
        return self._external_held

    @external_held.setter
    def external_held(self, ids: set[str]) -> None:
        self._external_held = set(ids)
        self._external_used = Counter(filter(None, map(Inventory.owner, self._external_held)))

    def restore(self, allocations: list[Allocation]) -> None:
        for alloc in allocations:
            self.allocations[alloc.id] = alloc

    def recorded_ids(self) -> set[str]:
        """Device IDs our allocation records hold (live or not)."""
        return {i for alloc in self.allocations.values() for i in alloc.all_ids()}

    def live(self, alloc: Allocation) -> bool:
        """Whether the record's container may still run: kubelet has not freed its devices, and (with an API
        server) its pod exists, is not finished or being deleted, and the container has not ended. A DRA claim's
        slice is live until the DRA front-end retires it (kubelet unprepares the claim)."""
        if alloc.claim is not None:
            return True
        if alloc.id in self.freed_by_kubelet:
            return False
        if self.pods is None or not self.pods.synced or not alloc.pod_uid:
            return True
        pod = self.pods.get(alloc.pod_uid)
        return pod is not None and pod.live and not pod.container_ended(alloc.container)

    def held_ids(self) -> set[str]:
        """Device IDs not to hand out: those of live records, and those kubelet reports that no record covers."""
        return {i for a in self.allocations.values() if self.live(a) for i in a.all_ids()} | self.external_held

    def owner_of(self) -> dict[str, Allocation]:
        """Device ID -> the live record holding it."""
        return {i: a for a in self.allocations.values() if self.live(a) for i in a.all_ids()}

    def rooms(self, ignore: frozenset[str] | set[str] = frozenset()) -> list[fit.Room]:
        """Free units per healthy GPU: offered minus held (minus `ignore`: devices being handed on within a pod).
        A record's devices are all on its GPU (checked at Allocate), so units are counted per record; a DRA claim's
        slice holds the units it consumed (one ledger for both front-ends)."""
        used = self._used(None, ignore)
        return [self._room(gpu, used) for gpu in self.inventory.gpus.values() if gpu.healthy]

    def room(self, gpu_uuid: str) -> fit.Room | None:
        """`rooms()`'s entry for one GPU (None when it is unknown or unhealthy), counting only that GPU's records:
        the DRA prepare asks for one GPU per claim result. Counted from the records every time, never kept as a
        running total that a record changed elsewhere could leave wrong (a wrong total double-books)."""
        gpu = self.inventory.gpus.get(gpu_uuid)
        if gpu is None or not gpu.healthy:
            return None
        return self._room(gpu, self._used(gpu_uuid))

    def _used(self, gpu_uuid: str | None, ignore: frozenset[str] | set[str] = frozenset()) -> Counter[tuple[str, str]]:
        """(GPU, resource) -> units held, over every GPU or only `gpu_uuid`'s records."""
        used = Counter(self._external_used)
        for a in self.allocations.values():
            if gpu_uuid is not None and a.gpu_uuid != gpu_uuid:
                continue
            if a.claim is not None:
                for r, n in a.wanted.items():
                    used[(a.gpu_uuid, r)] += n
            elif self.live(a):
                for r, ids in a.device_ids.items():
                    used[(a.gpu_uuid, r)] += len(ids) - (len(ignore.intersection(ids)) if ignore else 0)
                if a.memory_percent:  # memory as a percent: held by the record itself, no device IDs count it
                    used[(a.gpu_uuid, RESOURCE_MEMORY)] += a.wanted.get(RESOURCE_MEMORY, 0)
        return used

    @staticmethod
    def _room(gpu: Gpu, used: Counter[tuple[str, str]]) -> fit.Room:
        return fit.Room(gpu.uuid, gpu.info.index,
                        gpu.units[RESOURCE_MEMORY] - used[(gpu.uuid, RESOURCE_MEMORY)],
                        gpu.units[RESOURCE_COMPUTE] - used[(gpu.uuid, RESOURCE_COMPUTE)],
                        gpu.units[RESOURCE_MEMORY], gpu.units[RESOURCE_COMPUTE])

    def pods_held(self) -> set[str]:
        """UIDs of the pods whose units the free counts subtract (for the node annotation)."""
        return {a.pod_uid for a in self.allocations.values() if a.pod_uid and a.claim is None and self.live(a)}

    def add(self, alloc: Allocation) -> None:
        """A record made by a front-end, its folder and region already on disk."""
        self.allocations[alloc.id] = alloc

    def remove(self, alloc_id: str) -> Allocation | None:
        self.freed_by_kubelet.discard(alloc_id)
        return self.allocations.pop(alloc_id, None)
