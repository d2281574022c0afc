"""Allocation policy behind the device plugin: who is being admitted, which GPU, which device IDs.

kubelet's GetPreferredAllocation and Allocate carry no pod identity and come once per resource. The allocator
tells which pending container is being admitted (DESIGN: match by requested amounts, ties to the earliest
scheduled), picks ONE GPU that fits the container's memory AND compute by the node policy, and steers both
resources' device IDs to it. Every Allocate answer is backed by a record on disk before it is returned.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Protocol

import grpc
import structlog

from alnair_agent.constants import (
    CONTAINER_REGION_PATH,
    CONTAINER_RUN_DIR,
    CONTAINER_SHIM_DIR,
    CONTAINER_SHIM_PATH,
    DEVICE_ID_SEPARATOR,
    ENV_ALLOCATION_ID,
    ENV_COMPUTE_LIMIT,
    ENV_LD_PRELOAD,
    ENV_MEMORY_LIMIT,
    ENV_REGION,
    ENV_VISIBLE_DEVICES,
    RESOURCE_COMPUTE,
    RESOURCE_MEMORY,
    RESOURCES,
)
from alnair_agent.node.inventory import Inventory, UnknownDevice
from alnair_agent.node.fit import GpuRoom, choose_gpu
from alnair_agent.kube.pods import ContainerRequest
from alnair_agent.node.region import RegionError
from alnair_agent.node.workspace import Allocation, Workspace, new_allocation_id

log = structlog.get_logger(__name__)

# How long Allocate waits for the pod watch to show the pod being admitted (kubelet and our watch see the
# binding at about the same time, so the event can trail kubelet's call slightly).
POD_WAIT_S = 2.0
# Without pod identity (ALNAIR_KUBERNETES=off or no matching pod), the other resource's Allocate for the same
# container follows within this window; an unfinished unidentified allocation older than this is not paired.
PAIR_WINDOW_S = 5.0


class AllocationError(Exception):
    """Refusal to kubelet: a gRPC status code and a message naming what was wrong."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class PodSource(Protocol):
    """What the allocator needs of the pod watch (alnair_agent.kube.podwatch.PodWatch)."""

    async def wait_for_match(self, resource: str, count: int, taken: Collection[tuple[str, str]],
                             timeout: float) -> ContainerRequest | None:
        """The pending container asking `count` of `resource`, not in `taken` ((pod_uid, container))."""
        ...


def _wants(who: ContainerRequest) -> dict[str, int]:
    return {r: who.units(r) for r in RESOURCES}


@dataclass
class ContainerAnswer:
    """What Allocate returns for one container."""

    envs: dict[str, str]
    mounts: list[tuple[str, str, bool]]  # (container_path, host_path, read_only)
    allocation: Allocation


@dataclass
class _Decision:
    """GetPreferredAllocation's choice, remembered so the Allocate that follows lands on the same container."""

    resource: str
    ids: frozenset[str]
    gpu_uuid: str
    who: ContainerRequest | None
    open_id: str | None
    at: float = field(default_factory=time.monotonic)


class Allocator:
    def __init__(
        self,
        inventory: Inventory,
        workspace: Workspace,
        policy: str,
        shim_dir: str,
        pods: PodSource | None = None,
        pod_wait_s: float = POD_WAIT_S,
    ) -> None:
        self.inventory = inventory
        self.workspace = workspace
        self.policy = policy
        self.shim_dir = shim_dir
        self.pods = pods
        self.pod_wait_s = pod_wait_s
        self.allocations: dict[str, Allocation] = {}
        # Device IDs kubelet reports held (pod-resources) that no record of ours covers: never offered again.
        self.external_held: set[str] = set()
        self._decisions: list[_Decision] = []
        self._lock = asyncio.Lock()

    # -- state -----------------------------------------------------------------------------------------------
    def restore(self, allocations: list[Allocation]) -> None:
        for alloc in allocations:
            self.allocations[alloc.id] = alloc

    def recorded_ids(self) -> set[str]:
        """Device IDs our allocation records hold."""
        return {i for alloc in self.allocations.values() for i in alloc.all_ids()}

    def held_ids(self) -> set[str]:
        return self.recorded_ids() | self.external_held

    def _owner_of(self) -> dict[str, Allocation]:
        return {i: a for a in self.allocations.values() for i in a.all_ids()}

    def rooms(self, available: dict[str, set[str]] | None = None) -> list[GpuRoom]:
        """Free units per healthy GPU: offered minus held; for a resource in `available`, kubelet's view too."""
        held = self.held_ids()
        used: Counter[tuple[str, str]] = Counter(filter(None, map(Inventory.owner, held)))
        offered: Counter[tuple[str, str]] = Counter()
        for resource, ids in (available or {}).items():
            offered.update(o for o in map(Inventory.owner, ids - held) if o is not None and o[1] == resource)
        rooms = []
        for gpu in self.inventory.gpus.values():
            if not gpu.healthy:
                continue
            free = {}
            for r in RESOURCES:
                mine = gpu.units[r] - used[(gpu.uuid, r)]
                free[r] = min(mine, offered[(gpu.uuid, r)]) if available and r in available else mine
            rooms.append(GpuRoom(gpu.uuid, gpu.info.index, free, dict(gpu.units)))
        return rooms

    def remove(self, alloc_id: str) -> Allocation | None:
        return self.allocations.pop(alloc_id, None)

    # -- who is being admitted -------------------------------------------------------------------------------
    def _open_for(self, resource: str, count: int) -> Allocation | None:
        """The newest allocation still missing `resource` that this request completes."""
        now = time.time()
        for alloc in sorted(self.allocations.values(), key=lambda a: a.created_at, reverse=True):
            if alloc.device_ids.get(resource):
                continue
            if alloc.identified:
                if alloc.wanted.get(resource, 0) == count:
                    return alloc
            elif now - alloc.created_at <= PAIR_WINDOW_S:
                return alloc
        return None

    def _taken(self, resource: str) -> set[tuple[str, str]]:
        return {(a.pod_uid, a.container) for a in self.allocations.values() if a.identified and a.device_ids.get(resource)}

    async def _identify(self, resource: str, count: int) -> tuple[Allocation | None, ContainerRequest | None]:
        open_alloc = self._open_for(resource, count)
        if open_alloc is not None or self.pods is None:
            return open_alloc, None
        who = await self.pods.wait_for_match(resource, count, self._taken(resource), self.pod_wait_s)
        if who is None:
            log.warning("allocate_pod_unknown", resource=resource, units=count,
                        hint="no pending pod on this node asks for this amount; allocating without pod identity")
        return None, who

    # -- GetPreferredAllocation ------------------------------------------------------------------------------
    async def preferred(self, resource: str, available: list[str], must_include: list[str], size: int) -> list[str]:
        async with self._lock:
            return await self._preferred(resource, available, must_include, size)

    async def _preferred(self, resource: str, available: list[str], must_include: list[str], size: int) -> list[str]:
        if size <= 0:
            raise AllocationError(grpc.StatusCode.INVALID_ARGUMENT, f"allocation size {size} for {resource} must be > 0")
        self._check([*available, *must_include], resource)
        open_alloc, who = await self._identify(resource, size)
        try:
            return self._prefer_on_gpu(resource, available, must_include, size, open_alloc, who)
        except AllocationError:
            if open_alloc is not None:
                # kubelet fails the whole admission when one resource cannot be had: the half-made allocation
                # would only hold units that kubelet is about to free.
                self._abandon(open_alloc, f"its {resource} cannot be placed on GPU {open_alloc.gpu_uuid}")
            raise

    def _prefer_on_gpu(self, resource: str, available: list[str], must_include: list[str], size: int,
                       open_alloc: Allocation | None, who: ContainerRequest | None) -> list[str]:
        if open_alloc is not None:
            gpu_uuid = open_alloc.gpu_uuid
        else:
            need = _wants(who) if who is not None else {resource: size}
            gpu_uuid = self._choose(resource, set(available), need)
        held = self.held_ids()
        on_gpu = [i for i in available if i not in held and i.startswith(gpu_uuid + DEVICE_ID_SEPARATOR)]
        must = [i for i in must_include if i in on_gpu]
        chosen = must + [i for i in on_gpu if i not in must][: max(0, size - len(must))]
        if len(chosen) < size:
            raise AllocationError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"GPU {gpu_uuid} has {len(on_gpu)} free {resource} units; the container needs {size} on the same GPU "
                "as its other resource",
            )
        self._decisions = [d for d in self._decisions if time.monotonic() - d.at < 60.0]
        self._decisions.append(_Decision(resource, frozenset(chosen), gpu_uuid, who,
                                         open_alloc.id if open_alloc else None))
        return chosen

    def _choose(self, resource: str, available: set[str], need: dict[str, int]) -> str:
        room = choose_gpu(self.rooms({resource: available}), need, self.policy)
        if room is None:
            biggest = {r: max((g.units[r] for g in self.inventory.gpus.values()), default=0) for r in RESOURCES}
            what = ", ".join(f"{n} {r}" for r, n in need.items() if n)
            if any(need.get(r, 0) > biggest[r] for r in RESOURCES):
                sizes = ", ".join(f"{biggest[r]} {r}" for r in RESOURCES)
                raise AllocationError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                      f"request of {what} is larger than any single GPU on this node "
                                      f"(largest offers {sizes}); memory and compute must come from one GPU")
            raise AllocationError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  f"no healthy GPU has {what} free at once; memory and compute must come from one GPU")
        return room.uuid

    def _check(self, device_ids: list[str], resource: str) -> None:
        try:
            self.inventory.check(device_ids, resource)
        except UnknownDevice as e:
            raise AllocationError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None

    # -- Allocate -------------------------------------------------------------------------------------------
    async def allocate(self, resource: str, device_ids: list[str]) -> ContainerAnswer:
        async with self._lock:
            return await self._allocate(resource, device_ids)

    async def _allocate(self, resource: str, device_ids: list[str]) -> ContainerAnswer:
        if not device_ids:
            raise AllocationError(grpc.StatusCode.INVALID_ARGUMENT, f"Allocate for {resource} names no device IDs")
        if len(set(device_ids)) != len(device_ids):
            raise AllocationError(grpc.StatusCode.INVALID_ARGUMENT, f"Allocate for {resource} repeats a device ID")
        self._check(device_ids, resource)
        gpus = {i.split(DEVICE_ID_SEPARATOR, 1)[0] for i in device_ids}
        if len(gpus) != 1:
            raise AllocationError(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"Allocate for {resource} spans GPUs {sorted(gpus)}; a container's units must "
                                  "come from one GPU (use GetPreferredAllocation)")
        gpu_uuid = gpus.pop()
        decision = self._take_decision(resource, device_ids)
        if decision is not None:
            open_alloc = self.allocations.get(decision.open_id) if decision.open_id else None
            who = decision.who
        else:
            open_alloc, who = await self._identify(resource, len(device_ids))
        pod_uid = open_alloc.pod_uid if open_alloc is not None else (who.pod_uid if who is not None else "")
        owners = self._owner_of()
        reused = [i for i in device_ids if i in owners and pod_uid and owners[i].pod_uid == pod_uid
                  and owners[i] is not open_alloc]
        busy = sorted(i for i in device_ids if (i in owners and i not in reused) or i in self.external_held)
        if busy:
            holder = owners[busy[0]].describe() if busy[0] in owners else "a container kubelet reports"
            raise AllocationError(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"device ID {busy[0]} is still held by {holder}; refusing to double-book it")
        if open_alloc is not None and open_alloc.gpu_uuid != gpu_uuid:
            raise AllocationError(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"{open_alloc.describe()} holds its other resource on GPU {open_alloc.gpu_uuid}; "
                                  f"{resource} devices on {gpu_uuid} would split it across GPUs")
        if open_alloc is not None:
            alloc = self._complete(open_alloc, resource, device_ids)
        else:
            alloc = self._create(gpu_uuid, resource, device_ids, who)
        if reused:
            # kubelet hands an ended init container's devices to the next container of the same pod.
            self._release(reused, owners)
        log.info("allocated", allocation=alloc.id, resource=resource, units=len(device_ids), gpu=gpu_uuid,
                 pod=f"{alloc.namespace}/{alloc.pod_name}" if alloc.identified else None,
                 container=alloc.container or None)
        return ContainerAnswer(self._envs(alloc), self._mounts(alloc), alloc)

    def _release(self, device_ids: list[str], owners: dict[str, Allocation]) -> None:
        for alloc in {owners[i].id: owners[i] for i in device_ids}.values():
            for resource, ids in alloc.device_ids.items():
                alloc.device_ids[resource] = [i for i in ids if i not in device_ids]
            self.workspace.save(alloc)
            log.info("devices_reused_within_pod", allocation=alloc.id, container=alloc.container, devices=len(device_ids))

    def _abandon(self, alloc: Allocation, why: str) -> None:
        log.warning("allocation_abandoned", allocation=alloc.id, reason=why)
        self.workspace.remove(alloc.id)
        self.remove(alloc.id)

    def _take_decision(self, resource: str, device_ids: list[str]) -> _Decision | None:
        ids = frozenset(device_ids)
        for d in self._decisions:
            if d.resource == resource and d.ids == ids:
                self._decisions.remove(d)
                return d
        return None

    def _limits(self, alloc: Allocation) -> tuple[int, int]:
        mem_units = max(alloc.wanted.get(RESOURCE_MEMORY, 0), len(alloc.device_ids.get(RESOURCE_MEMORY, [])))
        compute = max(alloc.wanted.get(RESOURCE_COMPUTE, 0), len(alloc.device_ids.get(RESOURCE_COMPUTE, [])))
        # A cap of the whole GPU is no cap: the shim then stays out of the launch path.
        return mem_units * self.inventory.memory_unit_bytes, (compute if 0 < compute < 100 else 0)

    def _create(self, gpu_uuid: str, resource: str, device_ids: list[str], who: ContainerRequest | None) -> Allocation:
        wanted = _wants(who) if who is not None else {resource: len(device_ids)}
        alloc = Allocation(
            id=new_allocation_id(), gpu_uuid=gpu_uuid, device_ids={resource: list(device_ids)},
            wanted={r: n for r, n in wanted.items() if n}, memory_limit=0, compute_limit=0,
            namespace=who.namespace if who else "", pod_name=who.pod_name if who else "",
            pod_uid=who.pod_uid if who else "", container=who.container if who else "",
        )
        alloc.memory_limit, alloc.compute_limit = self._limits(alloc)
        try:
            region = self.workspace.create(alloc)
        except OSError as e:
            raise AllocationError(grpc.StatusCode.INTERNAL,
                                  f"cannot create workspace for {alloc.describe()} under {self.workspace.root}: {e}") from e
        region.close()
        self.allocations[alloc.id] = alloc
        return alloc

    def _complete(self, alloc: Allocation, resource: str, device_ids: list[str]) -> Allocation:
        alloc.device_ids[resource] = list(device_ids)
        alloc.wanted.setdefault(resource, len(device_ids))
        memory_limit, compute_limit = self._limits(alloc)
        try:
            if (memory_limit, compute_limit) != (alloc.memory_limit, alloc.compute_limit):
                region = self.workspace.open_region(alloc.id)
                try:
                    region.set_limits(memory_limit, compute_limit)
                finally:
                    region.close()
                alloc.memory_limit, alloc.compute_limit = memory_limit, compute_limit
            self.workspace.save(alloc)
        except (OSError, RegionError) as e:
            alloc.device_ids.pop(resource, None)
            raise AllocationError(grpc.StatusCode.INTERNAL, f"cannot update {alloc.describe()}: {e}") from e
        return alloc

    def _envs(self, alloc: Allocation) -> dict[str, str]:
        envs = {
            ENV_VISIBLE_DEVICES: alloc.gpu_uuid,
            ENV_LD_PRELOAD: CONTAINER_SHIM_PATH,
            ENV_REGION: CONTAINER_REGION_PATH,
            ENV_ALLOCATION_ID: alloc.id,
        }
        # kubelet merges the two resources' answers first-wins per variable: name a limit only once it is
        # known, so the answers never disagree (the region carries the final limits either way).
        if RESOURCE_MEMORY in alloc.wanted:
            envs[ENV_MEMORY_LIMIT] = str(alloc.memory_limit)
        if RESOURCE_COMPUTE in alloc.wanted:
            envs[ENV_COMPUTE_LIMIT] = str(alloc.compute_limit)
        return envs

    def _mounts(self, alloc: Allocation) -> list[tuple[str, str, bool]]:
        return [
            (CONTAINER_RUN_DIR, str(self.workspace.container_folder(alloc.id)), False),
            (CONTAINER_SHIM_DIR, self.shim_dir, True),
        ]
