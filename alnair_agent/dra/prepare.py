"""NodePrepareResources and NodeUnprepareResources carried out: claims' slices booked in the node's one ledger
(alnair_agent/node/ledger.py). Reading and checking a claim is claims.py; spares made ahead, spares.py; specs rebuilt
at start and orphans retired, cleanup.py.

kubelet names a claim (namespace, name, UID); its allocation (which device, how much of each capacity) is on the
ResourceClaim, read from the API server. Each allocation result of Alnair's driver becomes one allocation record
with its folder, region and limits, exactly as a device plugin container's (the ledger's records, counted by the
same rooms, served by the same reconciler heartbeat, dispatcher and profiler). Every container using a result shares
its slice: one region, one set of limits. Results a container takes together (groups.py: a request of `count: N`,
or several requests a container names) are a group of GPUs, like a device plugin container of `alnair/vgpu-count`:
one record per GPU (`Allocation.gpus`, `part`, in GPU index order), each GPU's own limits in its region. The claim
gets one CDI spec with one device per group, whose edits are the device plugin's (node/edits.py).

- Checked, not trusted: the result must name this node's pool and a published GPU, and its consumed capacity must
  fit the request policy and the agent's own ledger (the GPU's units less every other record on it, whichever
  front-end made it); a group's GPUs must be distinct. A claim that fails is refused whole, naming what was wrong;
  nothing already held changes and nothing of it is left made.
- Idempotent: kubelet retries. A claim already prepared gets the same devices (its spec rewritten if missing).
- Restart safe: records and specs are on disk before the answer; at start the specs are rebuilt from the records,
  and specs of claims without records are removed.
- Unprepare retires a claim's records after the final usage write (kubelet calls again while it fails); an orphan
  (cleanup.py) is retired the same way. Nothing of a live claim is removed.
"""

from __future__ import annotations

import asyncio
import errno
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import structlog

from alnair_agent.constants import DRA_DRIVER, RESOURCE_COMPUTE, RESOURCE_MEMORY
from alnair_agent.dra import groups
from alnair_agent.dra.cdi import CdiError, CdiWriter, device_id
from alnair_agent.dra.claims import (
    ClaimReader,
    ClaimRef,
    ClaimResult,
    ClaimSource,
    PreparedDevice,
    PrepareError,
    share_key,
)
from alnair_agent.dra.spares import SparePool
from alnair_agent.kube.events import EventSink
from alnair_agent.kube.pod_source import PodSource
from alnair_agent.kube.pods import PodInfo
from alnair_agent.node import edits, mps_users
from alnair_agent.node.ledger import Ledger
from alnair_agent.node.region import RegionError
from alnair_agent.node.workspace import Allocation, ClaimShare, Workspace, new_allocation_id
from alnair_agent.profiler.sink import UsageSink

log = structlog.get_logger(__name__)

# Unprepare waits at most this long for a claim's final usage figures (an API outage must not hold kubelet's call:
# the claim is refused, kubelet calls again, the folders stay meanwhile).
FINAL_FLUSH_S = 2.0
# A claim of several Alnair requests is grouped by what its pod's containers name: a prepare waits this long for the
# pod watch to show the pod (kubelet and the watch learn of it at about the same time) before refusing (kubelet retries)
POD_WAIT_S = 2.0


@dataclass(frozen=True)
class Placement:
    """Where a result goes among the GPUs a container takes together: its group's key, its position, the group's GPUs
    (empty for a group of one GPU, as a one-GPU container's record)."""

    group: str
    part: int
    gpus: tuple[str, ...]

    @classmethod
    def of(cls, g: groups.Group) -> dict[tuple[str, str, str, str], "Placement"]:
        gpus = tuple(r.gpu.uuid for r in g.results) if len(g.results) > 1 else ()
        return {share_key(r.share): cls(g.key, k if gpus else 0, gpus) for k, r in enumerate(g.results)}


class ClaimPreparer:
    def __init__(self, ledger: Ledger, workspace: Workspace, cdi: CdiWriter, claims: ClaimSource,
                 node_name: str, shim_dir: str, usage: UsageSink | None = None, pods: PodSource | None = None,
                 accept_new: bool = True, mps: edits.MpsFolders | None = None,
                 events: EventSink | None = None) -> None:
        self.ledger = ledger
        self.inventory = ledger.inventory
        self.workspace = workspace
        self.cdi = cdi
        self.reader = ClaimReader(claims, node_name, ledger.inventory)
        self.node_name = node_name
        self.shim_dir = shim_dir
        self.mps = mps
        self.events = events
        self.usage = usage
        self.pods = pods
        # False on a node whose GPUs the device plugin offers: only claims prepared before the switch are served
        # (re-prepared and unprepared), so no GPU is offered by both front-ends.
        self.accept_new = accept_new
        self._lock = asyncio.Lock()
        # Claim UID -> its records' allocation ids, and the records whose containers are not named yet: a prepare
        # touches its own claim's records only, never a scan of every record on the node. Only this preparer makes
        # and retires claim records (after the ledger's restore, which comes first); lookups still check the
        # ledger, which stays the one truth of what is held.
        self._by_claim: dict[str, set[str]] = {}
        self._unnamed: set[str] = set()
        self.spares = SparePool(workspace, cdi)
        for alloc in self.records():
            self._index(alloc)

    # -- the records -----------------------------------------------------------------------------------------
    def records(self, claim_uid: str | None = None) -> list[Allocation]:
        if claim_uid is not None:
            held = self.ledger.allocations
            return [a for i in self._by_claim.get(claim_uid, ()) if (a := held.get(i)) is not None
                    and a.claim is not None and a.claim.uid == claim_uid]
        return [a for a in self.ledger.allocations.values() if a.claim is not None]

    def _index(self, alloc: Allocation) -> None:
        assert alloc.claim is not None
        self._by_claim.setdefault(alloc.claim.uid, set()).add(alloc.id)
        if not alloc.container:
            self._unnamed.add(alloc.id)

    def _unindex(self, alloc: Allocation) -> None:
        self._unnamed.discard(alloc.id)
        if alloc.claim is not None and (ids := self._by_claim.get(alloc.claim.uid)) is not None:
            ids.discard(alloc.id)
            if not ids:
                del self._by_claim[alloc.claim.uid]

    def claim_uids(self) -> set[str]:
        return {a.claim.uid for a in self.records() if a.claim is not None}

    def _groups_of(self, claim_uid: str) -> list[list[Allocation]]:
        """The claim's records by the group of GPUs a container takes together, each in its GPUs' order (a record of
        one GPU alone), the groups in the order they were made."""
        out: dict[tuple[str, tuple[str, ...]], list[Allocation]] = {}
        for a in sorted(self.records(claim_uid), key=lambda r: r.created_at):
            assert a.claim is not None
            out.setdefault((a.claim.group, tuple(a.gpus)) if a.gpus else (a.id, ()), []).append(a)
        return [sorted(parts, key=lambda a: a.part) for parts in out.values()]

    def _edits(self, parts: list[Allocation]) -> edits.ContainerEdits:
        folders = [self.workspace.container_folder(a.id) for a in parts]
        if len(parts) == 1 and not parts[0].gpus:
            return edits.container_edits(parts[0], folders[0], self.shim_dir, self.mps)
        return edits.group_edits(parts, folders, self.shim_dir, self.mps)

    def _write_spec(self, claim_uid: str) -> None:
        """The claim's CDI spec: one device per group, named by its first GPU's allocation id."""
        found = self._groups_of(claim_uid)
        if found:
            spare = self.spares.take_spec()
            self.cdi.write(claim_uid, [(parts[0].id, self._edits(parts)) for parts in found], spare)
        else:
            self.cdi.remove(claim_uid)

    def _devices(self, claim_uid: str) -> list[PreparedDevice]:
        """Every result as a device of the answer, a group's CDI device on its first (a container naming a request
        of the group gets every device of it: the group's CDI device once)."""
        out = []
        for parts in self._groups_of(claim_uid):
            for k, a in enumerate(parts):
                assert a.claim is not None
                out.append(PreparedDevice(groups.main_request(a.claim.request), a.claim.pool, a.claim.device,
                                          (device_id(parts[0].id),) if k == 0 else ()))
        return out

    async def _await_pod(self, ref: ClaimRef, claim: Mapping[str, Any], results: list[ClaimResult]) -> None:
        """A claim of several Alnair requests, not all prepared: wait (POD_WAIT_S at most) until the watch shows a
        pod it is reserved for, whose containers say how its results are grouped."""
        if self.pods is None or len(groups.requests_of(results)) < 2:
            return
        held = {share_key(a.claim) for a in self.records(ref.uid) if a.claim is not None}
        if all(share_key(r.share) in held for r in results):
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + POD_WAIT_S
        while not self._shown(claim) and loop.time() < deadline:
            await self.pods.changed(self.pods.generation, timeout=max(0.0, deadline - loop.time()))

    def _shown(self, claim: Mapping[str, Any]) -> list[PodInfo]:
        """The pods the claim is reserved for that the watch shows."""
        if self.pods is None or not self.pods.synced:
            return []
        return [p for _, uid in self.reader.consumers(claim) if uid and (p := self.pods.get(uid)) is not None]

    def _placements(self, ref: ClaimRef, claim: Mapping[str, Any],
                    results: list[ClaimResult]) -> dict[tuple[str, str, str, str], Placement]:
        """Each result's place among the GPUs a container takes together (groups.py); PrepareError when they cannot
        be grouped, or when the pod that says how is not shown yet."""
        requests = groups.requests_of(results)
        named: list[groups.View] = []
        if len(requests) > 1 and self.pods is not None:
            shown = self._shown(claim)
            if not shown:
                pods = ", ".join(f"{ref.namespace}/{name}" for name, _ in self.reader.consumers(claim)) or "none"
                raise PrepareError(f"{ref.describe()} has {len(requests)} requests of {DRA_DRIVER} "
                                   f"({', '.join(requests)}): which of them a container takes together is in the spec "
                                   f"of the pod it is reserved for ({pods}), which the agent's pod watch does not show "
                                   "yet; kubelet calls again")
            named = groups.views(ref.name, shown, requests)
        out: dict[tuple[str, str, str, str], Placement] = {}
        for g in groups.group(ref, results, named):
            out.update(Placement.of(g))
        return out

    def _place(self, alloc: Allocation, placement: Placement) -> None:
        """A record held from before (a prepare cut short), placed as this prepare groups the claim."""
        assert alloc.claim is not None
        if (alloc.claim.group, alloc.part, tuple(alloc.gpus)) == (placement.group, placement.part, placement.gpus):
            return
        alloc.claim = replace(alloc.claim, group=placement.group)
        alloc.part, alloc.gpus = placement.part, list(placement.gpus)
        try:
            self.workspace.save(alloc)
        except OSError as e:
            log.warning("allocation_record_write_failed", allocation=alloc.id, error=str(e))

    # -- NodePrepareResources --------------------------------------------------------------------------------
    async def prepare(self, ref: ClaimRef) -> list[PreparedDevice]:
        started = time.perf_counter()
        claim = await self.reader.read(ref)
        read_s = time.perf_counter() - started
        results = self.reader.results(ref, claim)
        pod_name, pod_uid = self.reader.consumer(claim)
        await self._await_pod(ref, claim, results)
        async with self._lock:
            held = {share_key(a.claim): a for a in self.records(ref.uid) if a.claim is not None}
            wanted = {share_key(r.share) for r in results}
            if not self.accept_new and any(share_key(r.share) not in held for r in results):
                raise PrepareError(f"{ref.describe()}: this node's GPUs are offered by the device plugin "
                                   "(ALNAIR_FRONTEND); it prepares only claims it prepared before the switch")
            # Records of an earlier allocation of the same claim (deallocated and allocated again while the agent
            # missed the unprepare): that allocation is over, and its units must not count against this one.
            stale = [a for key, a in held.items() if key not in wanted]
            for alloc in stale:
                log.warning("dra_stale_result_removed", allocation=alloc.id, claim=f"{ref.namespace}/{ref.name}")
                self._drop(alloc)
            created: list[Allocation] = []
            try:
                if any(share_key(r.share) not in held for r in results):
                    # grouped (and every group checked) before anything is made: a claim refused leaves nothing
                    placements = self._placements(ref, claim, results)
                    for r in results:
                        if share_key(r.share) not in held:
                            created.append(self._create(r, pod_name, pod_uid, placements[share_key(r.share)]))
                    for key, alloc in held.items():
                        if key in placements:
                            self._place(alloc, placements[key])
                self._write_spec(ref.uid)
            except (PrepareError, OSError, RegionError) as e:
                for alloc in created:  # all or nothing: what this call made goes, what was held stays
                    self._drop(alloc)
                self.write_spec_quietly(ref.uid)
                if isinstance(e, PrepareError):
                    raise
                raise PrepareError(f"{ref.describe()}: cannot write its slice under {self.workspace.root} or its CDI "
                                   f"spec under {self.cdi.folder}: {e}") from e
            self._learn(self.records(ref.uid))  # records held from before, whose pod the watch now shows
            devices = self._devices(ref.uid)
            warnings = [(a, why) for a in created if (why := self._mps_warning(a))]
        for alloc, why in warnings:
            if self.events is not None:
                self.events.pod_warning(alloc.namespace, alloc.pod_name, alloc.pod_uid, mps_users.REASON_MPS_USER, why)
        # the times: what the API server's answer took, and the whole prepare as the agent saw it
        log.info("dra_claim_prepared", claim=f"{ref.namespace}/{ref.name}", uid=ref.uid, devices=len(devices),
                 new=len(created), read_ms=round(read_s * 1e3, 2),
                 ms=round((time.perf_counter() - started) * 1e3, 2))
        return devices

    def _create(self, r: ClaimResult, pod_name: str, pod_uid: str, placement: Placement) -> Allocation:
        if not r.gpu.healthy:  # a slice already held stays where it is; a new one never goes on a failing GPU
            raise PrepareError(f"{r.share.describe()}: GPU {r.gpu.uuid} is unhealthy")
        unit = self.inventory.memory_unit_bytes
        memory_units, compute_units = r.consumed.units(unit)
        room = self.ledger.room(r.gpu.uuid)
        if room is None or not room.fits(memory_units, compute_units):
            have = room.describe() if room is not None else f"GPU {r.gpu.uuid} is not available"
            raise PrepareError(f"{r.share.describe()} consumes {r.consumed.memory_bytes} bytes of memory "
                               f"({memory_units} units) and {compute_units} % compute, more than GPU {r.gpu.uuid} has "
                               f"free in the agent's ledger: {have}")
        wanted = {k: v for k, v in ((RESOURCE_MEMORY, memory_units), (RESOURCE_COMPUTE, compute_units)) if v}
        memory_limit, compute_limit = edits.limits(memory_units, compute_units, unit)
        share: ClaimShare = replace(r.share, group=placement.group)
        alloc = Allocation(id=new_allocation_id(), gpu_uuid=r.gpu.uuid, device_ids={}, wanted=wanted,
                           memory_limit=memory_limit, compute_limit=compute_limit, namespace=r.share.namespace,
                           pod_name=pod_name, pod_uid=pod_uid, claim=share, part=placement.part,
                           gpus=list(placement.gpus))
        # Its containers named now when the watch shows the pod: the record is then written once, complete.
        alloc.container = self._containers(alloc)
        spare = self.spares.take_folder()
        try:
            region = self.workspace.create(alloc, spare)
        except OSError as e:
            self.workspace.remove(alloc.id)
            full = " (the workspace filesystem is full)" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
            raise PrepareError(f"{r.share.describe()}: cannot create its slice under {self.workspace.root}{full}: "
                               f"{e}") from e
        region.close()
        self.ledger.add(alloc)
        self._index(alloc)
        log.info("dra_slice_created", allocation=alloc.id, claim=f"{r.share.namespace}/{r.share.name}",
                 request=r.share.request, gpu=r.gpu.uuid, memory_limit=memory_limit, compute_limit=compute_limit)
        return alloc

    def _mps_warning(self, alloc: Allocation) -> str:
        """Under MPS, why a new slice's containers may wait for another user's on its GPU (node/mps_users.py); ""
        when nothing their pods declare says so, or its containers are not named yet (the pod not shown)."""
        if self.mps is None or self.pods is None or not alloc.container:
            return ""
        pod = self.pods.get(alloc.pod_uid)
        if pod is None:
            return ""
        on_gpu = mps_users.tenants(alloc.gpu_uuid, self.ledger.allocations.values(), self.pods.get, lambda a: False)
        for c in alloc.container.split(","):
            me = mps_users.Tenant(f"{pod.namespace}/{pod.name}", c, pod.user_of(c))
            why = mps_users.warn(alloc.gpu_uuid, me, [t for t in on_gpu if t != me])
            if why is not None:
                return why
        return ""

    def _drop(self, alloc: Allocation) -> None:
        self.workspace.remove(alloc.id)
        self.ledger.remove(alloc.id)
        self._unindex(alloc)

    def write_spec_quietly(self, claim_uid: str) -> None:
        try:
            self._write_spec(claim_uid)
        except OSError as e:
            log.error("dra_cdi_spec_unwritable", claim_uid=claim_uid, error=str(e))

    # -- NodeUnprepareResources ------------------------------------------------------------------------------
    async def unprepare(self, ref: ClaimRef) -> None:
        """Retire the claim's slices (the final usage write first); a claim not prepared here is already done."""
        records = self.records(ref.uid)
        if not records:
            self._remove_spec(ref.uid)
            return
        await self.retire(ref.uid, records, why="unprepared")

    def _remove_spec(self, claim_uid: str) -> None:
        try:
            self.cdi.remove(claim_uid)
        except CdiError as e:
            raise PrepareError(f"claim {claim_uid}: {e.strerror}") from None

    async def retire(self, claim_uid: str, records: list[Allocation], why: str) -> None:
        # The spec goes first: no container started from now on can name these devices.
        self._remove_spec(claim_uid)
        for alloc in records:
            if self.usage is not None and alloc.identified and alloc.container:
                if not await self.usage.final(alloc, timeout=FINAL_FLUSH_S):
                    self.write_spec_quietly(claim_uid)
                    raise PrepareError(f"claim {alloc.claim.describe() if alloc.claim else claim_uid}: its final "
                                       "usage figures are not written yet (API server unreachable?); kept until they "
                                       "are")
        async with self._lock:
            for alloc in records:
                if self.usage is not None:
                    self.usage.forget(alloc)
                self._drop(alloc)
                log.info("dra_slice_removed", allocation=alloc.id, claim_uid=claim_uid, reason=why)

    # -- restarts and housekeeping ---------------------------------------------------------------------------
    def _containers(self, alloc: Allocation) -> str:
        """The slice's containers as its pod names them ("" while the watch does not show the pod)."""
        if self.pods is None or not self.pods.synced or not alloc.pod_uid or alloc.claim is None:
            return ""
        pod = self.pods.get(alloc.pod_uid)
        return ",".join(pod.claim_containers(alloc.claim.name, alloc.claim.request)) if pod is not None else ""

    def learn_containers(self) -> None:
        """Name each slice's containers from its pod (the pod watch may show the pod after kubelet's prepare). A pod's
        containers and their claims cannot change (the spec is immutable): a slice named once is done, so only
        the slices not named yet are looked at."""
        held = self.ledger.allocations
        self._learn([a for i in list(self._unnamed) if (a := held.get(i)) is not None])
        self._unnamed.intersection_update(held)  # retired meanwhile (by nothing but this preparer, but be exact)

    def _learn(self, records: list[Allocation]) -> None:
        for alloc in records:
            if alloc.container:
                self._unnamed.discard(alloc.id)
                continue
            names = self._containers(alloc)
            if names:
                alloc.container = names
                self._unnamed.discard(alloc.id)
                try:
                    self.workspace.save(alloc)
                except OSError as e:
                    log.warning("allocation_record_write_failed", allocation=alloc.id, error=str(e))
