"""A ResourceClaim as the DRA front-end reads it: named by kubelet (namespace, name, UID), read from the API server,
its allocation results for Alnair's driver checked against this node (its pool, its published GPUs, the request
policies) before anything is booked. Nothing here writes: prepare.py books what this returns.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from alnair_agent.constants import DRA_DRIVER
from alnair_agent.dra import capacity
from alnair_agent.node.inventory import Gpu, Inventory
from alnair_agent.node.workspace import ClaimShare


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
    """One device of a prepared claim, as NodePrepareResources returns it: `request` as containers name it (a
    firstAvailable result's main request, as kubelet matches them), and the CDI devices a container naming it gets
    (none for a device whose group's CDI device another device of the group carries: groups.py)."""

    request: str
    pool: str
    device: str
    cdi_ids: tuple[str, ...]


class ClaimSource(Protocol):
    async def get_claim(self, namespace: str, name: str) -> Mapping[str, Any] | None: ...


@dataclass(frozen=True)
class ClaimResult:
    """One allocation result of our driver, checked."""

    share: ClaimShare
    gpu: Gpu
    consumed: capacity.Consumed


def _str(value: object) -> str:
    return value if isinstance(value, str) else ""


def share_key(share: ClaimShare) -> tuple[str, str, str, str]:
    return (share.request, share.pool, share.device, share.share_id)


class ClaimReader:
    """Reads claims from the API server and checks their results against this node's pool and GPUs."""

    def __init__(self, claims: ClaimSource, node_name: str, inventory: Inventory) -> None:
        self.claims = claims
        self.pool = capacity.pool_name(node_name)
        self.inventory = inventory

    def gpus_by_device(self) -> dict[str, Gpu]:
        return {capacity.device_name(g.info.index): g for g in self.inventory.gpus.values()}

    async def read(self, ref: ClaimRef) -> Mapping[str, Any]:
        try:
            claim = await self.claims.get_claim(ref.namespace, ref.name)
        except ClaimUnavailable as e:
            raise PrepareError(f"cannot read {ref.describe()} from the API server: {e}") from None
        if claim is None:
            raise PrepareError(f"{ref.describe()} does not exist")
        self.check_uid(ref, claim)
        return claim

    @staticmethod
    def check_uid(ref: ClaimRef, claim: Mapping[str, Any]) -> None:
        meta = claim.get("metadata")
        uid = _str(meta.get("uid")) if isinstance(meta, Mapping) else ""
        if uid != ref.uid:
            raise PrepareError(f"{ref.describe()}: the claim of that name has uid {uid or '(none)'} (deleted and "
                               "created again?)")

    def results(self, ref: ClaimRef, claim: Mapping[str, Any]) -> list[ClaimResult]:
        """Our driver's allocation results of the claim, each checked; PrepareError naming the first bad one."""
        status = claim.get("status") if isinstance(claim.get("status"), Mapping) else {}
        allocation = status.get("allocation") if isinstance(status, Mapping) else None
        if not isinstance(allocation, Mapping):
            raise PrepareError(f"{ref.describe()} is not allocated (no status.allocation)")
        devices = allocation.get("devices") if isinstance(allocation.get("devices"), Mapping) else {}
        raw = devices.get("results") if isinstance(devices, Mapping) else None
        if not isinstance(raw, list):
            raise PrepareError(f"{ref.describe()}: status.allocation.devices.results is not a list")
        by_device = self.gpus_by_device()
        out: list[ClaimResult] = []
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
            out.append(ClaimResult(share, gpu, consumed))
        keys = [share_key(x.share) for x in out]
        if len(set(keys)) != len(keys):
            raise PrepareError(f"{ref.describe()}: two allocation results name the same request, device and share")
        return out

    @staticmethod
    def consumers(claim: Mapping[str, Any]) -> list[tuple[str, str]]:
        """(pod name, pod UID) of every pod the claim is reserved for, in its order."""
        status = claim.get("status") if isinstance(claim.get("status"), Mapping) else {}
        reserved = status.get("reservedFor") if isinstance(status, Mapping) else None
        return [(_str(entry.get("name")), _str(entry.get("uid"))) for entry in
                (reserved if isinstance(reserved, list) else [])
                if isinstance(entry, Mapping) and entry.get("resource") == "pods" and not entry.get("apiGroup")]

    @classmethod
    def consumer(cls, claim: Mapping[str, Any]) -> tuple[str, str]:
        """(pod name, pod UID) of the first pod the claim is reserved for ("" when none)."""
        return next(iter(cls.consumers(claim)), ("", ""))
