"""The node's ResourceSlice: one pool, one device per GPU the DRA front-end offers, kept true on the API server.

A GPU is offered when it is healthy and no container the device plugin admitted still holds part of it (after a
switch of front-end those keep their units; kube-scheduler, counting claims only, would book them again), and it
has a memory unit to offer. An unhealthy GPU leaves the slice and comes back when it recovers.

The loop reads the slice and writes it only when it differs from what it should be: a restarted agent finds its
slice as it left it and writes nothing (no churn; the pool generation moves only when the devices change). kubelet
deletes a driver's slices at its own start and when the plugin has been away a while: the next pass creates it
again. Writes are retried each pass (every ALNAIR_RESYNC_INTERVAL_S, or at once on a health change). Claims
prepared or unprepared change nothing here: kube-scheduler counts what claims consume, the slice says what is offered.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any, Protocol

import structlog

from alnair_agent.constants import DRA_API_GROUP_VERSION
from alnair_agent.dra import capacity
from alnair_agent.node.ledger import Ledger

log = structlog.get_logger(__name__)


class SliceApi(Protocol):
    async def get_slice(self, name: str) -> Mapping[str, Any] | None: ...

    async def create_slice(self, body: Mapping[str, Any], dry_run: bool = False) -> Mapping[str, Any]: ...

    async def replace_slice(self, name: str, body: Mapping[str, Any]) -> Mapping[str, Any]: ...

    async def delete_slice(self, name: str) -> bool: ...


def _spec(obj: Mapping[str, Any] | None) -> Mapping[str, Any]:
    spec = obj.get("spec") if isinstance(obj, Mapping) else None
    return spec if isinstance(spec, Mapping) else {}


def _generation(obj: Mapping[str, Any] | None) -> int:
    pool = _spec(obj).get("pool")
    gen = pool.get("generation") if isinstance(pool, Mapping) else None
    return gen if isinstance(gen, int) and not isinstance(gen, bool) else 0


def _comparable(spec: Mapping[str, Any]) -> dict[str, Any]:
    """What must match for the slice to need no write: everything but the pool generation."""
    pool = dict(spec.get("pool") or {}) if isinstance(spec.get("pool"), Mapping) else {}
    pool.pop("generation", None)
    return {"driver": spec.get("driver"), "pool": pool, "nodeName": spec.get("nodeName"),
            "devices": spec.get("devices") or []}


class SlicePublisher:
    def __init__(self, api: SliceApi, ledger: Ledger, node_name: str, interval_s: float) -> None:
        self.api = api
        self.ledger = ledger
        self.inventory = ledger.inventory
        self.node_name = node_name
        self.name = capacity.slice_name(node_name)
        self.interval_s = interval_s
        self.kick = asyncio.Event()
        self.writes = 0  # creates and updates sent (tests, the benchmark: churn)
        self.published: list[str] = []  # device names of the last slice written or found right
        self.synced = asyncio.Event()  # set once the slice on the server is as it should be

    def offered(self) -> list[str]:
        """UUIDs of the GPUs this front-end offers now, in index order."""
        dp_held = {a.gpu_uuid for a in self.ledger.allocations.values()
                   if a.claim is None and self.ledger.live(a)}
        return [g.uuid for g in self.inventory.gpus.values()
                if g.healthy and g.uuid not in dp_held and capacity.publishable(g)]

    def devices(self) -> list[dict[str, Any]]:
        unit = self.inventory.memory_unit_bytes
        return [capacity.device_json(self.inventory.gpus[uuid], unit) for uuid in self.offered()]

    def body(self, generation: int, resource_version: str | None = None) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": self.name, "labels": {"app.kubernetes.io/part-of": "alnair"}}
        if resource_version:
            meta["resourceVersion"] = resource_version
        return {"apiVersion": DRA_API_GROUP_VERSION, "kind": "ResourceSlice", "metadata": meta,
                "spec": capacity.slice_spec(self.node_name, self.devices(), generation)}

    async def sync_once(self) -> bool:
        """One pass: read the slice, write it if it is missing or differs. True when the server's slice is right."""
        current = await self.api.get_slice(self.name)
        devices = self.devices()
        wanted = capacity.slice_spec(self.node_name, devices, _generation(current))
        names = [d["name"] for d in devices]
        if current is not None and _comparable(_spec(current)) == _comparable(wanted):
            if self.published != names or not self.synced.is_set():
                log.info("dra_slice_current", slice=self.name, devices=names, generation=_generation(current))
            self.published = names
            self.synced.set()
            return True
        generation = _generation(current) + 1
        if current is None:
            await self.api.create_slice(self.body(generation))
        else:
            rv = current.get("metadata", {}).get("resourceVersion") if isinstance(current.get("metadata"),
                                                                                   Mapping) else None
            await self.api.replace_slice(self.name, self.body(generation, rv if isinstance(rv, str) else None))
        self.writes += 1
        self.published = names
        self.synced.set()
        log.info("dra_slice_written", slice=self.name, created=current is None, devices=names, generation=generation)
        return True

    async def notify_devices_changed(self) -> None:
        """The health service's call: a GPU's health changed."""
        self.kick.set()

    async def run(self) -> None:
        failing: str | None = None
        while True:
            self.kick.clear()
            try:
                await self.sync_once()
                if failing is not None:
                    log.info("dra_slice_recovered")
                    failing = None
            except Exception as e:  # noqa: BLE001 - an API outage or refusal: said once, retried every pass
                if str(e) != failing:
                    log.warning("dra_slice_write_failed", slice=self.name, error=str(e))
                    failing = str(e)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.kick.wait(), self.interval_s)

    async def withdraw(self) -> None:
        """Remove the node's slice (this node's GPUs are offered by the device plugin now). Said once; an API
        failure is logged and left to kubelet, which deletes slices of drivers that are not registered."""
        try:
            if await self.api.delete_slice(self.name):
                log.info("dra_slice_withdrawn", slice=self.name)
        except Exception as e:  # noqa: BLE001 - best effort, see above
            log.warning("dra_slice_withdraw_failed", slice=self.name, error=str(e))
