"""The device plugin's admission: which container kubelet is admitting, which GPU, which device IDs. What is held
is the node's one ledger (alnair_agent/node/ledger.py), shared with the DRA front-end; this file books into it.

kubelet's GetPreferredAllocation and Allocate carry no pod identity. kubelet admits one pod at a time, each
container in pod order (init containers first), each resource of a container in random order. With an API server
the agent never guesses:
  - the pod being admitted is the earliest-bound pod on this node that kubelet has not admitted yet (no container
    statuses) and whose Alnair containers are not all allocated; alnair-scheduler's per-node lock makes it the
    only one (`alnair_agent.node.decision`);
  - the container is that pod's first container (in pod order) still missing this resource: each resource of a
    container is allocated exactly once, so this holds in every resource order;
  - its GPU is the one the extender decided (`ai.centaurus.io/placement`), validated against this agent's own
    ledger with the shared fit rule. A pod with no decision is refused with a message naming the fix, unless
    ALNAIR_PLACE_UNSCHEDULED lets the agent place it by ALNAIR_GPU_POLICY.
The first of a container's resources creates its ONE folder and region with the container's full limits; the
second names the same folder and limits. Every Allocate answer is backed by a record on disk before it returns.

Without an API server (single-tenant mode) there is no pod identity: each resource is placed as kubelet asks for
it and a container's memory and compute are paired by arrival (`PAIR_WINDOW_S`), only with a record this agent
process made: kubelet never continues an admission across an agent restart (the call after ours failed, and the
container's admission with it), so a half record found on disk is never the other half of a new call.

Units held: a record's device IDs, unless kubelet offers them as available again or the record's pod is gone,
finished or the container ended (kubelet's record and the pod win; the folder itself is removed later by the
reconciler, only once kubelet no longer reports the container).
"""

from __future__ import annotations

import asyncio
import copy
import errno
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import structlog

from alnair_agent.constants import DEVICE_ID_SEPARATOR, RESOURCE_COMPUTE, RESOURCE_MEMORY, RESOURCES
from alnair_agent.kube.pod_source import PodSource
from alnair_agent.kube.pods import ContainerRequest, PodInfo
from alnair_agent.kubelet import multigpu
from alnair_agent.kubelet.errors import AllocationError
from alnair_agent.node import edits, fit, mps_users
from alnair_agent.node.decision import Granted
from alnair_agent.node.inventory import UnknownDevice
from alnair_agent.node.ledger import Ledger
from alnair_agent.node.region import RegionError
from alnair_agent.node.workspace import Allocation, Workspace, new_allocation_id

log = structlog.get_logger(__name__)

# How long an admission call waits for the pod watch to show the pod kubelet is admitting (kubelet and the agent
# watch the same binding, so the agent's event can trail kubelet's call slightly). No lock is held meanwhile.
POD_WAIT_S = 2.0
# Without an API server, the other resource's Allocate for the same container follows within this window.
PAIR_WINDOW_S = 5.0
GPU_POLICY = {"binpack": fit.PACK, "spread": fit.SPREAD}
SCHEDULER_HINT = ("set spec.schedulerName to alnair-cost-saving or alnair-high-performance (alnair-scheduler "
                  "decides each container's GPU), or set ALNAIR_PLACE_UNSCHEDULED=true on the agent")


@dataclass
class ContainerAnswer:
    """What Allocate returns for one container."""

    envs: dict[str, str]
    mounts: list[tuple[str, str, bool]]  # (container_path, host_path, read_only)
    allocation: Allocation
    warning: str = ""  # for the pod's events: it is admitted, and may wait (node/mps_users.py)


@dataclass(frozen=True)
class _Target:
    """The container kubelet is admitting and the GPU(s) it goes on."""

    pod: PodInfo
    request: ContainerRequest
    gpus: tuple[str, ...]  # one, or alnair/vgpu-count of them in the order the container sees them
    existing: Allocation | None  # its record (its first GPU's), when its other resource came first

    @property
    def gpu_uuid(self) -> str:
        return self.gpus[0]


class Allocator:
    def __init__(
        self,
        ledger: Ledger,
        workspace: Workspace,
        policy: str,
        shim_dir: str,
        pods: PodSource | None = None,
        pod_wait_s: float = POD_WAIT_S,
        place_unscheduled: bool = False,
        node_name: str = "",
        mps: edits.MpsFolders | None = None,
    ) -> None:
        self.ledger = ledger
        self.inventory = ledger.inventory
        self.workspace = workspace
        self.policy = GPU_POLICY.get(policy, policy)
        if self.policy not in fit.POLICIES:
            raise ValueError(f"unknown GPU policy {policy!r}")
        self.shim_dir = shim_dir
        self.mps = mps
        self.pods = pods
        self.pod_wait_s = pod_wait_s
        self.place_unscheduled = place_unscheduled
        self.node_name = node_name
        # Called (pod, {container: Granted}) once every Alnair container of a pod is allocated.
        self.on_pod_allocated: Callable[[PodInfo, dict[str, Granted]], None] | None = None
        self._lock = asyncio.Lock()
        self._made_here: set[str] = set()  # records created by this process (unidentified pairing: _open_for)

    # -- the node report -------------------------------------------------------------------------------------
    def report(self) -> tuple[list[fit.Room], set[str]]:
        """For the node annotation: free units per healthy GPU, and the pods they subtract, each pod whole. A pod
        kubelet is still admitting (one Allocate per container and resource; the report may be set between two)
        also holds what it has yet to be allocated: the extender counts a pod the report names by the report alone,
        and the pod's confirmation, written at once, releases the node lock before the next report (rate-limited)
        shows the rest, so the extender would bind the next pod onto those units and the agent would refuse it."""
        rooms = self.ledger.rooms()
        waiting = self._not_yet_allocated()
        if waiting:  # never below 0: a report with a negative count is unreadable, the node then gets no pods
            rooms = [r._replace(memory_free=max(0, r.memory_free - waiting[(r.uuid, RESOURCE_MEMORY)]),
                                compute_free=max(0, r.compute_free - waiting[(r.uuid, RESOURCE_COMPUTE)]))
                     for r in rooms]
        return rooms, self.ledger.pods_held()

    def _not_yet_allocated(self) -> Counter[tuple[str, str]]:
        """(GPU, resource) -> units that the pods holding some units here are still to be allocated: each missing
        resource on its container's GPU (its record's, else alnair-scheduler's decision)."""
        out: Counter[tuple[str, str]] = Counter()
        if self.pods is None or not self.pods.synced:
            return out
        for uid, records in self._records_by_pod().items():
            pod = self.pods.get(uid)
            if pod is None or not any(self.ledger.live(a) for a in records.values()):
                continue
            decided = pod.decision.gpus if pod.decision is not None else {}
            for c in pod.containers:
                record = records.get(c.container)
                gpus = self._gpus_of(record) if record is not None else decided.get(c.container, ())
                for gpu in gpus:
                    for resource in self._missing(c, record):
                        out[(gpu, resource)] += c.units(resource) // max(1, len(gpus))
                    if record is None and c.memory_percent:  # held from its record's creation, on each GPU
                        out[(gpu, RESOURCE_MEMORY)] += c.memory_on(self._memory_units(gpu))
        return out

    def _memory_units(self, gpu_uuid: str) -> int:
        """The memory units a GPU of this node offers (0 for one it does not have)."""
        gpu = self.inventory.gpus.get(gpu_uuid)
        return gpu.units[RESOURCE_MEMORY] if gpu is not None else 0

    @staticmethod
    def _gpus_of(record: Allocation) -> tuple[str, ...]:
        return tuple(record.gpus) or (record.gpu_uuid,)

    def _parts(self, lead: Allocation) -> list[Allocation]:
        """The allocations of `lead`'s container, one per GPU in `part` order (`lead` alone for a one-GPU one)."""
        if not lead.gpus:
            return [lead]
        parts = [a for a in self.ledger.allocations.values() if a.claim is None and a.pod_uid == lead.pod_uid
                 and a.container == lead.container and a.gpus == lead.gpus]
        return sorted(parts, key=lambda a: a.part)

    def _release_freed(self, available: list[str]) -> None:
        """IDs kubelet offers as available are free in kubelet's record: any record still holding one is of a
        container that kubelet no longer has (kubelet's record wins); its units come back now."""
        owners = self.ledger.owner_of()
        for device_id in available:
            alloc = owners.get(device_id)
            if alloc is not None and alloc.id not in self.ledger.freed_by_kubelet:
                self.ledger.freed_by_kubelet.add(alloc.id)
                log.info("allocation_freed_by_kubelet", allocation=alloc.id, pod=alloc.ref(), device=device_id)

    # -- who is being admitted -------------------------------------------------------------------------------
    def _records_of(self, pod_uid: str) -> dict[str, Allocation]:
        """container -> its record (a multi-GPU container's first GPU's: its parts are made and completed together)."""
        return {a.container: a for a in self.ledger.allocations.values()
                if a.pod_uid == pod_uid and a.claim is None and a.part == 0}

    def _records_by_pod(self) -> dict[str, dict[str, Allocation]]:
        out: dict[str, dict[str, Allocation]] = {}
        for a in self.ledger.allocations.values():
            if a.pod_uid and a.claim is None and a.part == 0:  # DRA slices are no device plugin admission's
                out.setdefault(a.pod_uid, {})[a.container] = a
        return out

    @staticmethod
    def _missing(c: ContainerRequest, record: Allocation | None) -> list[str]:
        """Resources the container asks for that its record does not hold yet."""
        return [r for r in RESOURCES if c.units(r) > 0 and (record is None or r not in record.device_ids)]

    def _pending(self, by_pod: dict[str, dict[str, Allocation]]) -> list[PodInfo]:
        """Pods bound here that kubelet has not admitted yet, in bind order."""
        assert self.pods is not None
        out = []
        for pod in self.pods.pods():
            if pod.node_name != self.node_name and self.node_name:
                continue
            if not pod.live or pod.admitted or not pod.containers:
                continue
            records = by_pod.get(pod.uid, {})
            if all(not self._missing(c, records.get(c.container)) for c in pod.containers):
                continue
            out.append(pod)
        pods = self.pods
        return sorted(out, key=lambda p: (pods.bound_order(p.uid), p.created_at, p.namespace, p.name))

    def _next_container(self, pod: PodInfo, resource: str,
                        records: dict[str, Allocation] | None = None) -> ContainerRequest | None:
        records = self._records_of(pod.uid) if records is None else records
        for c in pod.containers:
            if resource in self._missing(c, records.get(c.container)):
                return c
        return None

    def _find(self, resource: str, count: int) -> tuple[PodInfo, ContainerRequest] | None:
        by_pod = self._records_by_pod()
        for pod in self._pending(by_pod):
            c = self._next_container(pod, resource, by_pod.get(pod.uid, {}))
            if c is not None and c.units(resource) == count:
                return pod, c
        return None

    def _describe_pending(self, resource: str, count: int) -> str:
        pending = self._pending(self._records_by_pod())
        if not pending:
            return (f"no pod bound to this node is waiting for admission with a container asking {count} {resource} "
                    "(the pod may have been deleted, or the agent's pod watch is behind)")
        parts = []
        for pod in pending[:5]:
            c = self._next_container(pod, resource)
            parts.append(f"{pod.namespace}/{pod.name} (next {resource}: "
                         f"{f'{c.container} asks {c.units(resource)}' if c else 'none'})")
        return (f"no pod waiting for admission has a container asking {count} {resource} next; waiting: "
                + ", ".join(parts))

    async def _identify(self, resource: str, count: int) -> tuple[PodInfo, ContainerRequest] | AllocationError:
        """The pod and container kubelet is admitting; waits (without the lock) for the watch to show it."""
        assert self.pods is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.pod_wait_s
        while True:
            since = self.pods.generation
            found = self._find(resource, count) if self.pods.synced else None
            if found is not None:
                return found
            remaining = deadline - loop.time()
            if remaining <= 0 or not await self.pods.changed(since, remaining):
                found = self._find(resource, count) if self.pods.synced else None
                if found is not None:
                    return found
                return AllocationError(grpc.StatusCode.FAILED_PRECONDITION,
                                       "cannot tell which pod kubelet is admitting: "
                                       + self._describe_pending(resource, count))

    def _gpu_for(self, pod: PodInfo, c: ContainerRequest, resource: str,
                 existing: Allocation | None) -> tuple[str, ...]:
        """The container's GPU(s): its record's, else the extender's decision, else (if allowed) the agent's
        choice."""
        if existing is not None:
            return self._gpus_of(existing)
        ref = f"pod {pod.namespace}/{pod.name} container {c.container!r}"
        if pod.decision_error:
            raise AllocationError(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"{ref}: its placement annotation is unreadable ({pod.decision_error})")
        decision = pod.decision
        if decision is not None:
            if self.node_name and decision.node != self.node_name:
                raise AllocationError(grpc.StatusCode.FAILED_PRECONDITION,
                                      f"{ref}: alnair-scheduler placed it on node {decision.node!r}, not this node "
                                      f"{self.node_name!r}")
            gpus = decision.gpus.get(c.container)
            if gpus is None:
                raise AllocationError(grpc.StatusCode.FAILED_PRECONDITION,
                                      f"{ref}: alnair-scheduler's placement names no GPU for this container")
            if len(gpus) != c.gpus:
                raise AllocationError(grpc.StatusCode.FAILED_PRECONDITION,
                                      f"{ref}: alnair-scheduler's placement names {len(gpus)} GPU(s); the container "
                                      f"asks for {c.gpus}")
            for gpu_uuid in gpus:
                gpu = self.inventory.gpus.get(gpu_uuid)
                if gpu is None:
                    raise AllocationError(grpc.StatusCode.FAILED_PRECONDITION,
                                          f"{ref}: alnair-scheduler placed it on GPU {gpu_uuid}, which is not on this "
                                          "node")
                if not gpu.healthy:
                    raise AllocationError(grpc.StatusCode.UNAVAILABLE,
                                          f"{ref}: alnair-scheduler placed it on GPU {gpu_uuid}, which is unhealthy")
            return gpus
        if not self.place_unscheduled:
            raise AllocationError(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"{ref} asks for Alnair resources but was not placed by alnair-scheduler "
                                  f"(spec.schedulerName is {pod.scheduler_name or 'default-scheduler'!r}): "
                                  + SCHEDULER_HINT)
        records = self._records_of(pod.uid)
        if any(n.kind == fit.KIND_INIT for n in pod.needs()) and records:
            return (next(iter(records.values())).gpu_uuid,)  # kubelet reuses init devices: one GPU per such pod
        placed = fit.place([c.need()], self.ledger.rooms(), self.policy)
        if not isinstance(placed, fit.Placement):
            raise AllocationError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{ref}: {placed.reason}")
        return tuple(placed.gpus[c.container])

    def _same_pod(self, device_ids: list[str], pod_uid: str) -> set[str]:
        """Of `device_ids`, those a live record of the same pod holds (kubelet reusing init containers' devices)."""
        owners = self.ledger.owner_of()
        return {i for i in device_ids if i in owners and owners[i].pod_uid == pod_uid}

    def _check_room(self, target: _Target, resource: str, handed_on: set[str]) -> None:
        """The shared fit rule against this agent's ledger: the GPU must have room for what is not held yet."""
        c = target.request
        compute = c.compute_units // c.gpus if target.existing is None or resource == RESOURCE_COMPUTE else 0
        rooms = {r.uuid: r for r in self.ledger.rooms(handed_on)}
        for gpu_uuid in target.gpus:  # a multi-GPU container: its slice on each of its GPUs
            room = rooms.get(gpu_uuid)
            # memory asked as a percent is that share of this GPU, held from the first resource on
            memory = (c.memory_on(room.memory_total if room is not None else 0) if c.memory_percent
                      else c.memory_units // c.gpus) if target.existing is None or resource == RESOURCE_MEMORY else 0
            if room is None or not room.fits(memory, compute):
                have = room.describe() if room is not None else f"GPU {gpu_uuid} is not available"
                raise AllocationError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                      f"pod {target.pod.namespace}/{target.pod.name} container {c.container!r} needs "
                                      f"{memory} memory + {compute} compute units on GPU {gpu_uuid}; {have}",
                                      pod=target.pod)

    async def _target(self, resource: str, count: int) -> _Target:
        found = await self._identify(resource, count)
        if isinstance(found, AllocationError):
            raise found
        pod, c = found
        existing = self._records_of(pod.uid).get(c.container)
        try:
            return _Target(pod, c, self._gpu_for(pod, c, resource, existing), existing)
        except AllocationError as e:
            e.pod = e.pod or pod
            raise

    # -- GetPreferredAllocation ------------------------------------------------------------------------------
    async def preferred(self, resource: str, available: list[str], must_include: list[str], size: int) -> list[str]:
        if size <= 0:
            raise AllocationError(grpc.StatusCode.INVALID_ARGUMENT, f"allocation size {size} for {resource} must be > 0")
        self._check([*available, *must_include], resource)
        if len(must_include) > size:
            raise AllocationError(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"must_include_deviceIDs names {len(must_include)} {resource} devices, more than "
                                  f"the allocation size {size}")
        if self.pods is None:
            async with self._lock:
                self._release_freed(available)
                open_alloc = self._open_for(resource, size)
                try:
                    gpu_uuid = open_alloc.gpu_uuid if open_alloc else self._choose_unidentified(resource, size)
                    return self._pick(resource, available, must_include, size, gpu_uuid)
                except AllocationError:
                    if open_alloc is not None:
                        # kubelet fails the whole admission when one resource cannot be had: the half-made
                        # allocation would only hold units that kubelet is about to free.
                        self._abandon(open_alloc, f"its {resource} cannot be placed on GPU {open_alloc.gpu_uuid}")
                    raise
        target = await self._target(resource, size)
        async with self._lock:
            self._release_freed(available)
            self._check_room(target, resource, self._same_pod(must_include, target.pod.uid))
            if len(target.gpus) > 1:
                return multigpu.pick_on_each(self._pick, resource, available, must_include, size, target.gpus)
            return self._pick(resource, available, must_include, size, target.gpu_uuid)

    def _pick(self, resource: str, available: list[str], must_include: list[str], size: int, gpu_uuid: str) -> list[str]:
        """must_include first (the v1beta1 contract: kubelet has already given them to the container), then free
        devices of the container's GPU."""
        held = self.ledger.held_ids()
        prefix = gpu_uuid + DEVICE_ID_SEPARATOR
        must = list(dict.fromkeys(must_include))
        off_gpu = [i for i in must if not i.startswith(prefix)]
        if off_gpu:
            raise AllocationError(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"kubelet requires device {off_gpu[0]} (reused from another container of the pod), "
                                  f"but this container's {resource} must come from GPU {gpu_uuid}")
        on_gpu = [i for i in available if i not in held and i.startswith(prefix) and i not in must]
        chosen = must + on_gpu[: size - len(must)]
        if len(chosen) < size:
            raise AllocationError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"GPU {gpu_uuid} has {len(must) + len(on_gpu)} {resource} units kubelet offers and the agent holds "
                f"free; the container needs {size} there",
            )
        return chosen

    def _abandon(self, alloc: Allocation, why: str) -> None:
        for part in self._parts(alloc) if alloc.part == 0 else [alloc]:  # a container's GPUs go together
            log.warning("allocation_abandoned", allocation=part.id, reason=why)
            self.workspace.remove(part.id)
            self.ledger.remove(part.id)
            self._made_here.discard(part.id)

    def _choose_unidentified(self, resource: str, size: int) -> str:
        rooms = self.ledger.rooms()
        placed = fit.place([fit.Need("container", size if resource == RESOURCE_MEMORY else 0,
                                     size if resource == RESOURCE_COMPUTE else 0)], rooms, self.policy)
        if not isinstance(placed, fit.Placement):
            free = "; ".join(r.describe() for r in rooms) or "no healthy GPU"
            raise AllocationError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  f"no healthy GPU has {size} {resource} units free for this container "
                                  f"(largest GPU offers {max((g.units[resource] for g in self.inventory.gpus.values()), default=0)}); {free}")
        return placed.gpus["container"][0]

    def _check(self, device_ids: list[str], resource: str) -> None:
        try:
            self.inventory.check(device_ids, resource)
        except UnknownDevice as e:
            raise AllocationError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None

    # -- Allocate -------------------------------------------------------------------------------------------
    async def allocate_all(self, resource: str, requests: list[list[str]]) -> list[ContainerAnswer]:
        """One Allocate call's container requests, all or nothing: when one is refused, what the earlier ones
        took is given back (kubelet admits none of them), records and folders as they were before the call."""
        # Only a call of several containers can need undoing (kubelet sends one per call in practice).
        before = {i: copy.deepcopy(a) for i, a in self.ledger.allocations.items()} if len(requests) > 1 else {}
        answers: list[ContainerAnswer] = []
        try:
            try:
                for device_ids in requests:
                    answers.append(await self.allocate(resource, device_ids))
            except OSError as e:  # a record that cannot be written (full or failing disk): refused clearly
                raise AllocationError(grpc.StatusCode.INTERNAL,
                                      f"cannot write allocation records under {self.workspace.root}: {e}") from e
        except BaseException:
            if answers:
                async with self._lock:
                    self._roll_back(before, [p.id for a in answers for p in self._parts(a.allocation)],
                                    f"a container of the same Allocate call for {resource} was refused")
            raise
        return answers

    def _roll_back(self, before: dict[str, Allocation], touched: list[str], why: str) -> None:
        """Undo what this call did to the records it answered with (and only those: another call may be under
        way): a record it created is abandoned, one it completed gets its earlier state back."""
        for alloc_id in dict.fromkeys(touched):
            alloc = self.ledger.allocations.get(alloc_id)
            if alloc is None:
                continue
            old = before.get(alloc_id)
            if old is None:
                self._abandon(alloc, why)
            elif old != alloc:
                limits_changed = (old.memory_limit, old.compute_limit) != (alloc.memory_limit, alloc.compute_limit)
                alloc.__dict__.update(copy.deepcopy(old.__dict__))
                try:
                    if limits_changed:
                        region = self.workspace.open_region(alloc_id)
                        try:
                            region.set_limits(alloc.memory_limit, alloc.compute_limit)
                        finally:
                            region.close()
                    self.workspace.save(alloc)
                except (OSError, RegionError) as e:
                    log.error("allocation_roll_back_incomplete", allocation=alloc_id, error=str(e))
                log.warning("allocation_rolled_back", allocation=alloc_id, reason=why)

    async def allocate(self, resource: str, device_ids: list[str]) -> ContainerAnswer:
        if not device_ids:
            raise AllocationError(grpc.StatusCode.INVALID_ARGUMENT, f"Allocate for {resource} names no device IDs")
        if len(set(device_ids)) != len(device_ids):
            raise AllocationError(grpc.StatusCode.INVALID_ARGUMENT, f"Allocate for {resource} repeats a device ID")
        self._check(device_ids, resource)
        gpus = {i.split(DEVICE_ID_SEPARATOR, 1)[0] for i in device_ids}
        if len(gpus) != 1 and self.pods is None:
            raise AllocationError(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"Allocate for {resource} spans GPUs {sorted(gpus)}; a container's units must "
                                  "come from one GPU (use GetPreferredAllocation)")
        if self.pods is None:
            async with self._lock:
                return self._allocate_unidentified(resource, device_ids, gpus.pop())
        target = await self._target(resource, len(device_ids))
        if len(target.gpus) > 1:
            async with self._lock:
                return self._allocate_parts(target, resource, device_ids)
        if len(gpus) != 1:
            raise AllocationError(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"Allocate for {resource} spans GPUs {sorted(gpus)}; a container's units must "
                                  "come from one GPU (use GetPreferredAllocation)")
        gpu_uuid = gpus.pop()
        async with self._lock:
            if target.gpu_uuid != gpu_uuid:
                raise AllocationError(grpc.StatusCode.FAILED_PRECONDITION,
                                      f"pod {target.pod.namespace}/{target.pod.name} container "
                                      f"{target.request.container!r} goes on GPU {target.gpu_uuid}; kubelet offers "
                                      f"{resource} devices of GPU {gpu_uuid}")
            reused = self._take_devices(device_ids, target.pod.uid)
            self._check_room(target, resource, set(reused))
            if target.existing is not None:
                alloc = self._complete(target.existing, resource, device_ids)
            else:
                alloc = self._create(gpu_uuid, resource, device_ids, target.pod, target.request)
            if reused:
                self._release(reused, keep=alloc.id)
            answer = ContainerAnswer(self._envs(alloc), self._mounts(alloc), alloc,
                                     self._mps_warning(target) if target.existing is None else "")
            log.info("allocated", allocation=alloc.id, resource=resource, units=len(device_ids), gpu=gpu_uuid,
                     pod=alloc.ref(), container=alloc.container)
            self._maybe_confirm(target.pod)
            return answer

    def _allocate_parts(self, target: _Target, resource: str, device_ids: list[str]) -> ContainerAnswer:
        """A container of several GPUs: kubelet's IDs split evenly over its GPUs, one allocation per GPU, created
        (its first resource) or completed (its second) together; all of them or none."""
        split = multigpu.split_ids(device_ids, target.gpus, resource, target.pod, target.request)
        self._take_devices(device_ids, target.pod.uid)
        self._check_room(target, resource, set())
        if target.existing is not None:
            parts = self._parts(target.existing)
            if tuple(p.gpu_uuid for p in parts) != target.gpus:
                raise AllocationError(grpc.StatusCode.INTERNAL,
                                      f"{target.existing.describe()}: its records name GPUs "
                                      f"{[p.gpu_uuid for p in parts]}, not {list(target.gpus)}")
            done: list[Allocation] = []
            try:
                for p in parts:
                    done.append(self._complete(p, resource, split[p.part]))
            except AllocationError:
                for p in done:  # the parts completed before the one that failed go back to one resource
                    p.device_ids.pop(resource, None)
                    self.workspace.save(p)
                raise
        else:
            parts = []
            try:
                for k, gpu_uuid in enumerate(target.gpus):
                    parts.append(self._create(gpu_uuid, resource, split[k], target.pod, target.request, k,
                                              list(target.gpus)))
            except AllocationError:
                for p in parts:
                    self._abandon(p, "another GPU of its container could not be set up")
                raise
        lead = parts[0]
        answer = ContainerAnswer(self._envs(lead), self._mounts(lead), lead,
                                 self._mps_warning(target) if target.existing is None else "")
        log.info("allocated", allocation=lead.id, resource=resource, units=len(device_ids), gpus=list(target.gpus),
                 allocations=[p.id for p in parts], pod=lead.ref(), container=lead.container)
        self._maybe_confirm(target.pod)
        return answer

    def _mps_warning(self, target: _Target) -> str:
        """Under MPS, why the container just admitted may wait for another user's containers on its GPUs ("" when
        its pods declare nothing that says so); said once, when its first resource is allocated."""
        if self.mps is None or self.pods is None:
            return ""
        me = mps_users.Tenant(f"{target.pod.namespace}/{target.pod.name}", target.request.container,
                              target.pod.user_of(target.request.container))
        for gpu in target.gpus:
            others = mps_users.tenants(gpu, self.ledger.allocations.values(), self.pods.get,
                                       lambda a: a.pod_uid == target.pod.uid and a.serves(me.container))
            why = mps_users.warn(gpu, me, others)
            if why is not None:
                return why
        return ""

    def _take_devices(self, device_ids: list[str], pod_uid: str) -> list[str]:
        """Check that no live container of another pod holds the devices; return those an ended container of the
        same pod holds (kubelet hands an init container's devices to the next container of the pod)."""
        owners = self.ledger.owner_of()
        reused = [i for i in device_ids if i in owners and pod_uid and owners[i].pod_uid == pod_uid]
        busy = sorted(i for i in device_ids if (i in owners and i not in reused) or i in self.ledger.external_held)
        if busy:
            holder = owners[busy[0]].describe() if busy[0] in owners else "a container kubelet reports"
            raise AllocationError(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"device ID {busy[0]} is still held by {holder}; refusing to double-book it")
        return reused

    def _maybe_confirm(self, pod: PodInfo) -> None:
        records = self._records_of(pod.uid)
        if any(self._missing(c, records.get(c.container)) for c in pod.containers):
            return
        granted = {name: Granted(a.gpu_uuid, a.id, a.memory_limit, a.compute_limit,
                                 tuple(a.gpus), tuple(p.id for p in self._parts(a)) if a.gpus else (),
                                 a.memory_percent,
                                 tuple(p.memory_limit for p in self._parts(a)) if a.gpus and a.memory_percent else ())
                   for name, a in records.items() if pod.request(name) is not None}
        log.info("pod_allocated", pod=f"{pod.namespace}/{pod.name}", containers=len(granted))
        if self.on_pod_allocated is not None:
            self.on_pod_allocated(pod, granted)

    def _allocate_unidentified(self, resource: str, device_ids: list[str], gpu_uuid: str) -> ContainerAnswer:
        open_alloc = self._open_for(resource, len(device_ids))
        self._take_devices(device_ids, "")
        if open_alloc is not None and open_alloc.gpu_uuid != gpu_uuid:
            raise AllocationError(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"{open_alloc.describe()} holds its other resource on GPU {open_alloc.gpu_uuid}; "
                                  f"{resource} devices on {gpu_uuid} would split it across GPUs")
        if open_alloc is not None:
            alloc = self._complete(open_alloc, resource, device_ids)
        else:
            alloc = self._create(gpu_uuid, resource, device_ids, None, None)
        log.info("allocated", allocation=alloc.id, resource=resource, units=len(device_ids), gpu=gpu_uuid,
                 pod=None, container=None)
        return ContainerAnswer(self._envs(alloc), self._mounts(alloc), alloc)

    def _open_for(self, resource: str, count: int) -> Allocation | None:
        """Without pod identity: the newest unfinished allocation of the last PAIR_WINDOW_S lacking `resource`."""
        now = time.time()
        for alloc in sorted(self.ledger.allocations.values(), key=lambda a: a.created_at, reverse=True):
            if (not alloc.identified and alloc.claim is None and not alloc.device_ids.get(resource)
                    and now - alloc.created_at <= PAIR_WINDOW_S and alloc.id in self._made_here):
                return alloc
        return None

    def _release(self, device_ids: list[str], keep: str) -> None:
        """Take `device_ids` out of every record but `keep` (they were handed on within the pod)."""
        owners = {i: a for a in self.ledger.allocations.values() if a.id != keep for i in a.all_ids()}
        for alloc in {owners[i].id: owners[i] for i in device_ids if i in owners}.values():
            for resource, ids in alloc.device_ids.items():
                alloc.device_ids[resource] = [i for i in ids if i not in device_ids]
            self.workspace.save(alloc)
            log.info("devices_reused_within_pod", allocation=alloc.id, container=alloc.container, devices=len(device_ids))

    def _limits(self, alloc: Allocation) -> tuple[int, int]:
        mem_units = max(alloc.wanted.get(RESOURCE_MEMORY, 0), len(alloc.device_ids.get(RESOURCE_MEMORY, [])))
        compute = max(alloc.wanted.get(RESOURCE_COMPUTE, 0), len(alloc.device_ids.get(RESOURCE_COMPUTE, [])))
        return edits.limits(mem_units, compute, self.inventory.memory_unit_bytes)

    def _create(self, gpu_uuid: str, resource: str, device_ids: list[str], pod: PodInfo | None,
                c: ContainerRequest | None, part: int = 0, gpus: list[str] | None = None) -> Allocation:
        # per GPU: a multi-GPU container's allocation on one of its GPUs holds 1/N of its units
        wanted = {r: c.units(r) // c.gpus for r in RESOURCES} if c is not None else {resource: len(device_ids)}
        if c is not None and c.memory_percent:  # that share of this GPU's memory units
            wanted[RESOURCE_MEMORY] = c.memory_on(self._memory_units(gpu_uuid))
        alloc = Allocation(
            id=new_allocation_id(), gpu_uuid=gpu_uuid, device_ids={resource: list(device_ids)},
            wanted={r: n for r, n in wanted.items() if n}, memory_limit=0, compute_limit=0,
            namespace=pod.namespace if pod else "", pod_name=pod.name if pod else "",
            pod_uid=pod.uid if pod else "", container=c.container if c else "", part=part, gpus=gpus or [],
            memory_percent=c.memory_percent if c is not None else 0,
        )
        alloc.memory_limit, alloc.compute_limit = self._limits(alloc)
        try:
            region = self.workspace.create(alloc)
        except OSError as e:
            self.workspace.remove(alloc.id)
            # A full workspace filesystem is a refusal kubelet retries, not an agent fault.
            code = (grpc.StatusCode.RESOURCE_EXHAUSTED if e.errno in (errno.ENOSPC, errno.EDQUOT)
                    else grpc.StatusCode.INTERNAL)
            raise AllocationError(code, f"cannot create workspace for {alloc.describe()} under "
                                        f"{self.workspace.root}: {e}") from e
        region.close()
        self.ledger.add(alloc)
        self._made_here.intersection_update(self.ledger.allocations)  # forget records retired elsewhere meanwhile
        self._made_here.add(alloc.id)
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
        return self._edits(alloc).envs

    def _mounts(self, alloc: Allocation) -> list[tuple[str, str, bool]]:
        return self._edits(alloc).mounts

    def _edits(self, alloc: Allocation) -> edits.ContainerEdits:
        if alloc.gpus:
            parts = self._parts(alloc)
            return edits.group_edits(parts, [self.workspace.container_folder(p.id) for p in parts], self.shim_dir,
                                     self.mps)
        return edits.container_edits(alloc, self.workspace.container_folder(alloc.id), self.shim_dir, self.mps)
