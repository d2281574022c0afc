"""Prepared claims in the agent's one ledger: NodePrepareResources and NodeUnprepareResources carried out.

kubelet names a claim (namespace, name, UID); its allocation (which device, how much of each capacity) is on the
ResourceClaim, read from the API server. Each allocation result of Alnair's driver becomes one allocation record
with its folder, region and limits, exactly as a device plugin container's (the allocator's records, counted by the
same rooms, served by the same reconciler heartbeat, dispatcher and profiler), and the claim gets one CDI spec with
one device per result. Every container using a result shares its slice: one region, one set of limits.

- Checked, not trusted: the result must name this node's pool and a published GPU, and its consumed capacity must
  fit the request policy and the agent's own ledger (the GPU's units less every other record on it, whichever
  front-end made it). A claim that fails is refused whole, naming what was wrong; nothing already held changes.
- Idempotent: kubelet retries. A claim already prepared gets the same devices (its spec rewritten if missing).
- Restart safe: records and specs are on disk before the answer; at start the specs are rebuilt from the records,
  and specs of claims without records are removed.
- Unprepare retires a claim's records after the final usage write (kubelet calls again while it fails); a record
  whose claim is gone from the API server and from kubelet's pod-resources (an unprepare missed while the agent
  was down and kubelet lost its own record) is retired the same way. Nothing of a live claim is removed.
"""

from __future__ import annotations

import asyncio
import errno
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from alnair_agent.constants import DRA_DRIVER, RESOURCE_COMPUTE, RESOURCE_MEMORY
from alnair_agent.dra import capacity
from alnair_agent.dra.cdi import CdiError, CdiWriter, device_id
from alnair_agent.kube.pods import PodInfo
from alnair_agent.node import edits
from alnair_agent.node.allocator import Allocator
from alnair_agent.node.inventory import Gpu
from alnair_agent.node.region import RegionError
from alnair_agent.node.workspace import Allocation, ClaimShare, Spare, Workspace, new_allocation_id

log = structlog.get_logger(__name__)

# Unprepare waits at most this long for a claim's final usage figures (an API outage must not hold kubelet's call:
# the claim is refused, kubelet calls again, the folders stay meanwhile).
FINAL_FLUSH_S = 2.0
# Slice folders and spec files made ahead, in a worker thread, for prepares to take (`Workspace.make_spare`,
# `CdiWriter.make_spare`): a burst of more prepares than this makes the rest as before, in the call.
SPARES = 4
SPARE_RETRY_S = 5.0  # after a spare could not be made (a full disk): the prepares make their own meanwhile


class PrepareError(Exception):
    """A claim cannot be prepared or unprepared; the message (kubelet shows it on the pod) names what was wrong."""


class ClaimUnavailable(Exception):
    """The API server did not answer for a claim (outage, timeout, forbidden): neither present nor absent."""


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    uid: str
    name: str

    def describe(self) -> str:
        return f"ResourceClaim {self.namespace}/{self.name} (uid {self.uid})"


@dataclass(frozen=True)
class PreparedDevice:
    """One device of a prepared claim, as NodePrepareResources returns it."""

    request: str
    pool: str
    device: str
    cdi_ids: tuple[str, ...]


class ClaimSource(Protocol):
    async def get_claim(self, namespace: str, name: str) -> Mapping[str, Any] | None: ...


class UsageSink(Protocol):
    async def final(self, alloc: Allocation, timeout: float = 10.0) -> bool: ...

    def forget(self, alloc: Allocation) -> None: ...


class PodLookup(Protocol):
    @property
    def synced(self) -> bool: ...

    def get(self, uid: str) -> PodInfo | None: ...


@dataclass(frozen=True)
class _Result:
    """One allocation result of our driver, checked."""

    share: ClaimShare
    gpu: Gpu
    consumed: capacity.Consumed


def _str(value: object) -> str:
    return value if isinstance(value, str) else ""


def _key(share: ClaimShare) -> tuple[str, str, str, str]:
    return (share.request, share.pool, share.device, share.share_id)


class DraLedger:
    def __init__(self, allocator: Allocator, workspace: Workspace, cdi: CdiWriter, claims: ClaimSource,
                 node_name: str, shim_dir: str, usage: UsageSink | None = None, pods: PodLookup | None = None,
                 accept_new: bool = True) -> None:
        self.allocator = allocator
        self.inventory = allocator.inventory
        self.workspace = workspace
        self.cdi = cdi
        self.claims = claims
        self.node_name = node_name
        self.pool = capacity.pool_name(node_name)
        self.shim_dir = shim_dir
        self.usage = usage
        self.pods = pods
        # False on a node whose GPUs the device plugin offers: only claims prepared before the switch are served
        # (re-prepared and unprepared), so no GPU is offered by both front-ends.
        self.accept_new = accept_new
        self._lock = asyncio.Lock()
        # Claim UID -> its records' allocation ids, and the records whose containers are not named yet: a prepare
        # touches its own claim's records only, never a scan of every record on the node. Only this ledger makes
        # and retires claim records (after the allocator's restore, which comes first); lookups still check the
        # allocator, which stays the one truth of what is held.
        self._by_claim: dict[str, set[str]] = {}
        self._unnamed: set[str] = set()
        self._spares: list[Spare] = []
        self._spec_spares: list[str] = []
        self._spare_taken = asyncio.Event()
        for alloc in self.records():
            self._index(alloc)

    # -- the records -----------------------------------------------------------------------------------------
    def records(self, claim_uid: str | None = None) -> list[Allocation]:
        if claim_uid is not None:
            held = self.allocator.allocations
            return [a for i in self._by_claim.get(claim_uid, ()) if (a := held.get(i)) is not None
                    and a.claim is not None and a.claim.uid == claim_uid]
        return [a for a in self.allocator.allocations.values() if a.claim is not None]

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

    def _gpus_by_device(self) -> dict[str, Gpu]:
        return {capacity.device_name(g.info.index): g for g in self.inventory.gpus.values()}

    def _edits(self, alloc: Allocation) -> edits.ContainerEdits:
        return edits.container_edits(alloc, self.workspace.container_folder(alloc.id), self.shim_dir)

    def _write_spec(self, claim_uid: str) -> None:
        records = sorted(self.records(claim_uid), key=lambda a: a.created_at)
        if records:
            spare = self._spec_spares.pop() if self._spec_spares else None
            if spare is not None:
                self._spare_taken.set()
            self.cdi.write(claim_uid, [(a.id, self._edits(a)) for a in records], spare)
        else:
            self.cdi.remove(claim_uid)

    def _devices(self, claim_uid: str) -> list[PreparedDevice]:
        out = []
        for a in sorted(self.records(claim_uid), key=lambda r: r.created_at):
            assert a.claim is not None
            out.append(PreparedDevice(a.claim.request, a.claim.pool, a.claim.device, (device_id(a.id),)))
        return out

    # -- checking a claim ------------------------------------------------------------------------------------
    async def _read(self, ref: ClaimRef) -> Mapping[str, Any]:
        try:
            claim = await self.claims.get_claim(ref.namespace, ref.name)
        except ClaimUnavailable as e:
            raise PrepareError(f"cannot read {ref.describe()} from the API server: {e}") from None
        if claim is None:
            raise PrepareError(f"{ref.describe()} does not exist")
        self._check_uid(ref, claim)
        return claim

    @staticmethod
    def _check_uid(ref: ClaimRef, claim: Mapping[str, Any]) -> None:
        meta = claim.get("metadata")
        uid = _str(meta.get("uid")) if isinstance(meta, Mapping) else ""
        if uid != ref.uid:
            raise PrepareError(f"{ref.describe()}: the claim of that name has uid {uid or '(none)'} (deleted and "
                               "created again?)")

    def _results(self, ref: ClaimRef, claim: Mapping[str, Any]) -> list[_Result]:
        """Our driver's allocation results of the claim, each checked; PrepareError naming the first bad one."""
        status = claim.get("status") if isinstance(claim.get("status"), Mapping) else {}
        allocation = status.get("allocation") if isinstance(status, Mapping) else None
        if not isinstance(allocation, Mapping):
            raise PrepareError(f"{ref.describe()} is not allocated (no status.allocation)")
        devices = allocation.get("devices") if isinstance(allocation.get("devices"), Mapping) else {}
        raw = devices.get("results") if isinstance(devices, Mapping) else None
        if not isinstance(raw, list):
            raise PrepareError(f"{ref.describe()}: status.allocation.devices.results is not a list")
        by_device = self._gpus_by_device()
        out: list[_Result] = []
        for i, r in enumerate(raw):
            if not isinstance(r, Mapping):
                raise PrepareError(f"{ref.describe()}: allocation result {i} is not an object")
            if r.get("driver") != DRA_DRIVER:
                continue  # another driver's device: its own plugin prepares it
            what = f"{ref.describe()} result {i} (request {_str(r.get('request'))!r})"
            request, pool, device = _str(r.get("request")), _str(r.get("pool")), _str(r.get("device"))
            if not request or not device:
                raise PrepareError(f"{what}: names no request or no device")
            if r.get("adminAccess") is True:
                raise PrepareError(f"{what}: adminAccess is not supported by {DRA_DRIVER} (a slice needs limits)")
            if pool != self.pool:
                raise PrepareError(f"{what}: pool {pool!r} is not this node's pool {self.pool!r}")
            gpu = by_device.get(device)
            if gpu is None:
                raise PrepareError(f"{what}: device {device!r} is not published by this node (pool {self.pool!r} has "
                                   f"{', '.join(sorted(by_device)) or 'no devices'})")
            try:
                consumed = capacity.consumed_of(r.get("consumedCapacity"), gpu, self.inventory.memory_unit_bytes)
            except capacity.CapacityError as e:
                raise PrepareError(f"{what}: {e}") from None
            if not consumed.memory_bytes and not consumed.compute_percent:
                # Both default to 0: such a slice would have no limit and hold nothing in the ledger.
                raise PrepareError(f"{what}: the request asks for neither memory nor compute; ask for at least one "
                                   "(capacity.requests memory and/or compute)")
            share_id = r.get("shareID")
            share = ClaimShare(ref.namespace, ref.name, ref.uid, request, pool, device,
                               share_id if isinstance(share_id, str) else "")
            out.append(_Result(share, gpu, consumed))
        keys = [_key(x.share) for x in out]
        if len(set(keys)) != len(keys):
            raise PrepareError(f"{ref.describe()}: two allocation results name the same request, device and share")
        return out

    @staticmethod
    def _consumer(claim: Mapping[str, Any]) -> tuple[str, str]:
        """(pod name, pod UID) of the first pod the claim is reserved for ("" when none)."""
        status = claim.get("status") if isinstance(claim.get("status"), Mapping) else {}
        for entry in (status.get("reservedFor") if isinstance(status, Mapping) else None) or []:
            if isinstance(entry, Mapping) and entry.get("resource") == "pods" and not entry.get("apiGroup"):
                return _str(entry.get("name")), _str(entry.get("uid"))
        return "", ""

    # -- NodePrepareResources --------------------------------------------------------------------------------
    async def prepare(self, ref: ClaimRef) -> list[PreparedDevice]:
        started = time.perf_counter()
        claim = await self._read(ref)
        read_s = time.perf_counter() - started
        results = self._results(ref, claim)
        pod_name, pod_uid = self._consumer(claim)
        async with self._lock:
            held = {_key(a.claim): a for a in self.records(ref.uid) if a.claim is not None}
            wanted = {_key(r.share) for r in results}
            if not self.accept_new and any(_key(r.share) not in held for r in results):
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
                for r in results:
                    if _key(r.share) not in held:
                        created.append(self._create(r, pod_name, pod_uid))
                self._write_spec(ref.uid)
            except (PrepareError, OSError, RegionError) as e:
                for alloc in created:  # all or nothing: what this call made goes, what was held stays
                    self._drop(alloc)
                self._write_spec_quietly(ref.uid)
                if isinstance(e, PrepareError):
                    raise
                raise PrepareError(f"{ref.describe()}: cannot write its slice under {self.workspace.root} or its CDI "
                                   f"spec under {self.cdi.folder}: {e}") from e
            self._learn(self.records(ref.uid))  # records held from before, whose pod the watch now shows
            devices = self._devices(ref.uid)
        # the times: what the API server's answer took, and the whole prepare as the agent saw it
        log.info("dra_claim_prepared", claim=f"{ref.namespace}/{ref.name}", uid=ref.uid, devices=len(devices),
                 new=len(created), read_ms=round(read_s * 1e3, 2),
                 ms=round((time.perf_counter() - started) * 1e3, 2))
        return devices

    def _create(self, r: _Result, pod_name: str, pod_uid: str) -> Allocation:
        if not r.gpu.healthy:  # a slice already held stays where it is; a new one never goes on a failing GPU
            raise PrepareError(f"{r.share.describe()}: GPU {r.gpu.uuid} is unhealthy")
        unit = self.inventory.memory_unit_bytes
        memory_units, compute_units = r.consumed.units(unit)
        room = self.allocator.room(r.gpu.uuid)
        if room is None or not room.fits(memory_units, compute_units):
            have = room.describe() if room is not None else f"GPU {r.gpu.uuid} is not available"
            raise PrepareError(f"{r.share.describe()} consumes {r.consumed.memory_bytes} bytes of memory "
                               f"({memory_units} units) and {compute_units} % compute, more than GPU {r.gpu.uuid} has "
                               f"free in the agent's ledger: {have}")
        wanted = {k: v for k, v in ((RESOURCE_MEMORY, memory_units), (RESOURCE_COMPUTE, compute_units)) if v}
        memory_limit, compute_limit = edits.limits(memory_units, compute_units, unit)
        alloc = Allocation(id=new_allocation_id(), gpu_uuid=r.gpu.uuid, device_ids={}, wanted=wanted,
                           memory_limit=memory_limit, compute_limit=compute_limit, namespace=r.share.namespace,
                           pod_name=pod_name, pod_uid=pod_uid, claim=r.share)
        # Its containers named now when the watch shows the pod: the record is then written once, complete.
        alloc.container = self._containers(alloc)
        spare = self._spares.pop() if self._spares else None
        if spare is not None:
            self._spare_taken.set()
        try:
            region = self.workspace.create(alloc, spare)
        except OSError as e:
            self.workspace.remove(alloc.id)
            full = " (the workspace filesystem is full)" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
            raise PrepareError(f"{r.share.describe()}: cannot create its slice under {self.workspace.root}{full}: "
                               f"{e}") from e
        region.close()
        self.allocator.allocations[alloc.id] = alloc
        self._index(alloc)
        log.info("dra_slice_created", allocation=alloc.id, claim=f"{r.share.namespace}/{r.share.name}",
                 request=r.share.request, gpu=r.gpu.uuid, memory_limit=memory_limit, compute_limit=compute_limit)
        return alloc

    def _drop(self, alloc: Allocation) -> None:
        self.workspace.remove(alloc.id)
        self.allocator.remove(alloc.id)
        self._unindex(alloc)

    def _write_spec_quietly(self, claim_uid: str) -> None:
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
        await self._retire(ref.uid, records, why="unprepared")

    def _remove_spec(self, claim_uid: str) -> None:
        try:
            self.cdi.remove(claim_uid)
        except CdiError as e:
            raise PrepareError(f"claim {claim_uid}: {e.strerror}") from None

    async def _retire(self, claim_uid: str, records: list[Allocation], why: str) -> None:
        # The spec goes first: no container started from now on can name these devices.
        self._remove_spec(claim_uid)
        for alloc in records:
            if self.usage is not None and alloc.identified and alloc.container:
                if not await self.usage.final(alloc, timeout=FINAL_FLUSH_S):
                    self._write_spec_quietly(claim_uid)
                    raise PrepareError(f"claim {alloc.claim.describe() if alloc.claim else claim_uid}: its final "
                                       "usage figures are not written yet (API server unreachable?); kept until they "
                                       "are")
        async with self._lock:
            for alloc in records:
                if self.usage is not None:
                    self.usage.forget(alloc)
                self._drop(alloc)
                log.info("dra_slice_removed", allocation=alloc.id, claim_uid=claim_uid, reason=why)

    # -- spares ----------------------------------------------------------------------------------------------
    def _make_spares(self, folder: bool, spec: bool) -> tuple[Spare | None, str | None, OSError | None]:
        """In a worker thread: a slice folder and/or a spec file made ahead (each touches only its own new files;
        nothing of the ledger's), with the error that stopped it, if any: what was made is kept all the same."""
        made: Spare | None = None
        try:
            if folder:
                made = self.workspace.make_spare()
            return made, self.cdi.make_spare() if spec else None, None
        except OSError as e:
            return made, None, e

    async def keep_spares(self) -> None:
        """Service: SPARES slice folders and spec files made ahead, in a worker thread (its file calls never hold
        the event loop), made again as prepares take them. Stopped, it waits for the ones being made and removes
        them all."""
        making: asyncio.Future[tuple[Spare | None, str | None, OSError | None]] | None = None
        failing = ""
        try:
            while True:
                folder, spec = len(self._spares) < SPARES, len(self._spec_spares) < SPARES
                if not folder and not spec:
                    self._spare_taken.clear()
                    await self._spare_taken.wait()
                    continue
                making = asyncio.ensure_future(asyncio.to_thread(self._make_spares, folder, spec))
                error = self._keep(await asyncio.shield(making))
                if error is None:
                    failing = ""
                    continue
                if str(error) != failing:
                    log.warning("dra_spare_failed", workspace=str(self.workspace.spares_folder),
                                cdi=str(self.cdi.folder), error=str(error), retry_in_s=SPARE_RETRY_S)
                    failing = str(error)
                await asyncio.sleep(SPARE_RETRY_S)
        finally:
            if making is not None:
                if not making.done():
                    await asyncio.wait([making], timeout=5.0)
                if making.done() and not making.cancelled() and making.exception() is None:
                    self._keep(making.result())  # made while the service was being stopped: removed below
            for spare in self._spares:
                spare.close()
            self._spares.clear()
            self._spec_spares.clear()
            self.workspace.remove_spares()
            self.cdi.remove_spares()

    def _keep(self, made: tuple[Spare | None, str | None, OSError | None]) -> OSError | None:
        folder, spec, error = made
        if folder is not None and folder not in self._spares:
            self._spares.append(folder)
        if spec is not None and spec not in self._spec_spares:
            self._spec_spares.append(spec)
        return error

    # -- restarts and housekeeping ---------------------------------------------------------------------------
    def restore(self) -> None:
        """At start: every prepared claim's CDI spec as its records say; specs of claims without records go (they
        were never answered, or their claim was retired)."""
        try:
            self.cdi.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            log.warning("dra_cdi_folder_unusable", folder=str(self.cdi.folder), error=str(e))
        self.cdi.remove_spares()  # an earlier run's: no spec is in them
        live = self.claim_uids()
        for uid in sorted(live):
            self._write_spec_quietly(uid)
        for uid in self.cdi.claim_uids() - live:
            log.info("dra_cdi_spec_orphan_removed", claim_uid=uid)
            try:
                self.cdi.remove(uid)
            except OSError as e:
                log.warning("dra_cdi_spec_unremovable", claim_uid=uid, error=str(e))

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
        held = self.allocator.allocations
        self._learn([a for i in list(self._unnamed) if (a := held.get(i)) is not None])
        self._unnamed.intersection_update(held)  # retired meanwhile (by nothing but this ledger, but be exact)

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

    async def collect_orphans(self, list_claims: Callable[[], Awaitable[set[tuple[str, str]]]] | None) -> int:
        """Retire the slices of claims that are gone: no longer on the API server (or allocated otherwise) AND not
        reported by kubelet's pod-resources. Kubelet unprepares claims itself; this catches the one it forgot (its
        state lost, or the agent down through the call). Returns how many claims were retired."""
        if list_claims is None:
            return 0  # no authority to ask: kubelet's own unprepare is the only way out
        by_claim: dict[str, list[Allocation]] = {}
        for alloc in self.records():
            assert alloc.claim is not None
            by_claim.setdefault(alloc.claim.uid, []).append(alloc)
        if not by_claim:
            return 0
        try:
            in_use = await list_claims()
        except Exception as e:  # noqa: BLE001 - kubelet briefly unreachable: decide nothing this time
            log.warning("pod_resources_unavailable", error=str(e))
            return 0
        retired = 0
        for uid, records in by_claim.items():
            share = records[0].claim
            assert share is not None
            if (share.namespace, share.name) in in_use:
                continue
            ref = ClaimRef(share.namespace, uid, share.name)
            try:
                claim = await self.claims.get_claim(ref.namespace, ref.name)
            except ClaimUnavailable:
                continue
            if claim is not None:
                try:
                    self._check_uid(ref, claim)
                    current = {_key(r.share) for r in self._results(ref, claim)}
                except PrepareError:
                    current = set()  # another claim of the name, or no longer allocated as recorded
                if any(_key(a.claim) in current for a in records if a.claim is not None):
                    continue  # allocated as recorded: prepared, maybe not yet started, never removed here
            try:
                await self._retire(uid, records, why="claim gone")
                retired += 1
            except PrepareError as e:
                log.warning("dra_orphan_pending", claim_uid=uid, error=str(e))
        return retired
