"""The profiles for DRA pods: a prioritize-only extender verb over ResourceSlices and ResourceClaims.

In DRA mode kube-scheduler allocates claims itself: its allocator takes, on each node it considers, the first device
(in slice order: GPU index order) with the capacity the claim asks, so within a node it always packs. Which node a
pod goes to is kube-scheduler's scoring, which in 1.34-1.36 does not count DRA devices. This verb gives that choice
the pod's profile: alnair-scheduler's kube-scheduler calls it (POST /prioritize-dra, an extender entry with no
managed resources, so it is asked about every pod of the two profiles) and it scores each node by how much of
Alnair's DRA capacity there is booked now (the claims' consumedCapacity over the devices' capacity, memory and
compute averaged): `alnair-cost-saving` round(10 × booked) (pack onto the fullest nodes), `alnair-high-performance`
round(10 × (1 − booked)) (spread to the emptiest). A pod of another scheduler, one with no ResourceClaims, or a node
without Alnair devices scores 0 (no opinion); whether a claim fits a node stays kube-scheduler's own filter.

The view is fed by watches (ResourceSlices of driver gpu.alnair.centaurus.io, all ResourceClaims), started only when
the API server serves resource.k8s.io/v1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import structlog
from kubernetes_asyncio.client import ApiClient, ResourceV1Api

from alnair_agent.constants import DRA_CAP_COMPUTE, DRA_CAP_MEMORY, DRA_DRIVER
from alnair_agent.dra.quantity import QuantityError, parse_quantity
from alnair_agent.kube.reflector import Reflector
from alnair_agent.scheduler.extender import (
    NEUTRAL_SCORE,
    PROFILE_COST_SAVING,
    PROFILE_HIGH_PERFORMANCE,
    HostPriority,
    PrioritizeResult,
    RequestError,
    _field,
    _node_names,
)

log = structlog.get_logger(__name__)
MAX_SCORE = 10


def _q(value: object) -> Fraction:
    try:
        return parse_quantity(value)
    except QuantityError:
        return Fraction(0)


@dataclass
class DraView:
    """Per node: what Alnair's devices offer (the newest generation of its pool) and what allocated claims book."""

    slices: dict[str, Mapping[str, Any]] = field(default_factory=dict)  # slice name -> spec
    booked: dict[str, dict[tuple[str, str], tuple[Fraction, Fraction]]] = field(default_factory=dict)
    synced: bool = False

    # -- feeding ---------------------------------------------------------------------------------------------
    def apply_slice(self, obj: Mapping[str, Any]) -> None:
        spec = obj.get("spec") if isinstance(obj.get("spec"), Mapping) else {}
        name = (obj.get("metadata") or {}).get("name") if isinstance(obj.get("metadata"), Mapping) else None
        if isinstance(name, str) and isinstance(spec, Mapping) and spec.get("driver") == DRA_DRIVER:
            self.slices[name] = spec

    def delete_slice(self, obj: Mapping[str, Any]) -> None:
        self.slices.pop(((obj.get("metadata") or {}).get("name")) or "", None)

    def replace_slices(self, items: Sequence[Any]) -> None:
        self.slices.clear()
        for item in items:
            if isinstance(item, Mapping):
                self.apply_slice(item)

    def apply_claim(self, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") if isinstance(obj.get("metadata"), Mapping) else {}
        uid = meta.get("uid") if isinstance(meta, Mapping) else None
        if not isinstance(uid, str):
            return
        results = ((((obj.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results")) \
            if isinstance(obj.get("status"), Mapping) else None
        held: dict[tuple[str, str], tuple[Fraction, Fraction]] = {}
        for r in results or []:
            if isinstance(r, Mapping) and r.get("driver") == DRA_DRIVER and isinstance(r.get("consumedCapacity"), Mapping):
                c = r["consumedCapacity"]
                key = (str(r.get("pool")), str(r.get("device")))
                m, k = held.get(key, (Fraction(0), Fraction(0)))
                held[key] = (m + _q(c.get(DRA_CAP_MEMORY)), k + _q(c.get(DRA_CAP_COMPUTE)))
        if held:
            self.booked[uid] = held
        else:
            self.booked.pop(uid, None)

    def delete_claim(self, obj: Mapping[str, Any]) -> None:
        self.booked.pop(((obj.get("metadata") or {}).get("uid")) or "", None)

    def replace_claims(self, items: Sequence[Any]) -> None:
        self.booked.clear()
        for item in items:
            if isinstance(item, Mapping):
                self.apply_claim(item)

    # -- scoring ---------------------------------------------------------------------------------------------
    def booked_share(self) -> dict[str, float]:
        """Node -> the share of its Alnair DRA capacity booked now (0..1), for nodes that publish any."""
        newest: dict[tuple[str, str], int] = {}
        for spec in self.slices.values():
            pool = spec.get("pool") or {}
            key = (str(spec.get("nodeName")), str(pool.get("name")))
            newest[key] = max(newest.get(key, 0), int(pool.get("generation") or 0))
        offered: dict[tuple[str, str], tuple[str, Fraction, Fraction]] = {}  # (pool, device) -> (node, mem, comp)
        for spec in self.slices.values():
            pool = spec.get("pool") or {}
            node, name = str(spec.get("nodeName")), str(pool.get("name"))
            if int(pool.get("generation") or 0) != newest[(node, name)]:
                continue
            for d in spec.get("devices") or []:
                cap = d.get("capacity") or {}
                offered[(name, str(d.get("name")))] = (node, _q((cap.get(DRA_CAP_MEMORY) or {}).get("value")),
                                                       _q((cap.get(DRA_CAP_COMPUTE) or {}).get("value")))
        totals: dict[str, list[Fraction]] = {}
        for node, mem, comp in offered.values():
            t = totals.setdefault(node, [Fraction(0)] * 4)
            t[2] += mem
            t[3] += comp
        for held in self.booked.values():
            for key, (mem, comp) in held.items():
                where = offered.get(key)
                if where is not None:
                    t = totals[where[0]]
                    t[0] += mem
                    t[1] += comp
        out = {}
        for node, (mem, comp, mem_total, comp_total) in totals.items():
            shares = [float(a / b) for a, b in ((mem, mem_total), (comp, comp_total)) if b > 0]
            out[node] = min(1.0, sum(shares) / len(shares)) if shares else 0.0
        return out


def _uses_claims(pod: Any) -> bool:
    spec = _field(pod, "Spec") if isinstance(pod, Mapping) else None
    claims = _field(spec, "ResourceClaims") if isinstance(spec, Mapping) else None
    return bool(claims)


def prioritize_dra(args: Any, view: DraView) -> PrioritizeResult:
    """/prioritize-dra: ExtenderArgs (decoded JSON) -> HostPriorityList. Never raises for bad input."""
    try:
        if not isinstance(args, Mapping):
            raise RequestError(f"ExtenderArgs must be a JSON object, not {type(args).__name__}")
        names = _node_names(args)
        pod = _field(args, "Pod")
    except RequestError as e:
        return PrioritizeResult([], str(e))
    spec = _field(pod, "Spec") if isinstance(pod, Mapping) else None
    scheduler = _field(spec, "SchedulerName") if isinstance(spec, Mapping) else None
    meta = _field(pod, "Metadata") if isinstance(pod, Mapping) else None
    ref = f"{_field(meta, 'Namespace')}/{_field(meta, 'Name')}" if isinstance(meta, Mapping) else ""
    if scheduler not in (PROFILE_COST_SAVING, PROFILE_HIGH_PERFORMANCE) or not _uses_claims(pod):
        return PrioritizeResult([HostPriority(n, NEUTRAL_SCORE) for n in names], "", ref)
    shares = view.booked_share()
    hosts = []
    for n in names:
        if n not in shares:
            hosts.append(HostPriority(n, NEUTRAL_SCORE))
            continue
        booked = shares[n] if scheduler == PROFILE_COST_SAVING else 1.0 - shares[n]
        hosts.append(HostPriority(n, int(round(MAX_SCORE * booked))))
    return PrioritizeResult(hosts, "", ref)


def dra_reflectors(api: ApiClient, view: DraView) -> list[Reflector]:
    """The watches feeding `view`: ResourceSlices and ResourceClaims (all namespaces)."""
    v1 = ResourceV1Api(api)

    def on_slice(kind: str, obj: Mapping[str, Any]) -> None:
        (view.delete_slice if kind == "DELETED" else view.apply_slice)(obj)

    def on_claim(kind: str, obj: Mapping[str, Any]) -> None:
        (view.delete_claim if kind == "DELETED" else view.apply_claim)(obj)

    return [Reflector("resourceslices", v1.list_resource_slice, view.replace_slices, on_slice,
                      field_selector=f"spec.driver={DRA_DRIVER}"),
            Reflector("resourceclaims", v1.list_resource_claim_for_all_namespaces, view.replace_claims, on_claim)]


async def dra_served(api: ApiClient) -> bool:
    """Whether the API server serves resource.k8s.io/v1 (the watches are started only then)."""
    from alnair_agent.kube.resourceapi import ResourceApi, ResourceApiError

    try:
        return await ResourceApi(api).served()
    except ResourceApiError as e:
        log.warning("scheduler_dra_discovery_failed", error=str(e))
        return False
