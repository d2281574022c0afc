"""A stand-in for kube-scheduler's structured allocator (k8s.io/dynamic-resource-allocation/structured), with
consumable capacity (KEP-5075), working on the same JSON the API server holds.

What it does, as the upstream allocator does:
- pools: the ResourceSlices of the node (spec.nodeName, or allNodes), per (driver, pool) only the highest
  generation, and only when all its resourceSliceCount slices are there (an incomplete pool is skipped);
- each request of the claim (`exactly`, or the first `firstAvailable` subrequest that can be satisfied), its
  ExactCount devices (count, default 1), each device checked against the DeviceClass's and the request's selectors
  (this stand-in evaluates CEL of the forms `device.driver == "..."` and `device.attributes["d"].a == v`, joined
  by `&&`; anything else is refused, never guessed), then first fit in pool order (driver, pool name) and slice order;
- a device without allowMultipleAllocations goes to one request of one claim at most; one with it may be allocated
  any number of times: per capacity, the consumed amount is the request's (capacity.requests), else the policy's
  default, else the whole capacity; rounded up to the policy's validRange (min, then min + n*step) or validValues;
  refused when it violates the policy (over max, or over every valid value) or when the sum of what every allocated
  claim consumes of it plus this exceeds the capacity's value; a request naming a capacity the device does not have
  does not fit it;
- constraints (spec.devices.constraints): `distinctAttribute` (KEP-5075), the devices of the requests it names (all
  requests when it names none) each have the attribute, with values that differ (so one multi-allocatable device
  is not picked twice); any other constraint is refused, never guessed;
- backtracking: when a later request cannot be satisfied, earlier choices are revisited (the allocator is complete);
- the result: per device {request, driver, pool, device} and, for a multi-allocatable device, shareID and every
  capacity's consumedCapacity; the allocation's nodeSelector names the node.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from alnair_agent.dra.quantity import format_bytes, parse_quantity


class AllocationFailed(Exception):
    """The claim cannot be allocated on the node; the message says why (the last reason found)."""


@dataclass(frozen=True)
class DeviceRef:
    driver: str
    pool: str
    name: str


@dataclass
class _Device:
    ref: DeviceRef
    obj: Mapping[str, Any]

    @property
    def multi(self) -> bool:
        return self.obj.get("allowMultipleAllocations") is True

    def capacity(self) -> dict[str, Mapping[str, Any]]:
        return dict(self.obj.get("capacity") or {})


def _q(value: Fraction) -> str:
    if value.denominator == 1:
        n = int(value)
        return format_bytes(n) if n >= 1024 else str(n)
    milli = value * 1000
    if milli.denominator == 1:
        return f"{int(milli)}m"
    raise ValueError(f"{value} is not representable as a quantity")


def consumed_amount(requested: Fraction | None, cap: Mapping[str, Any]) -> Fraction:
    """calculateConsumedCapacity: the request (or the default), rounded up by the request policy."""
    policy = cap.get("requestPolicy")
    if requested is None:
        if isinstance(policy, Mapping) and policy.get("default") is not None:
            return parse_quantity(policy["default"])
        return parse_quantity(cap["value"])
    if not isinstance(policy, Mapping):
        return requested
    vrange = policy.get("validRange")
    if isinstance(vrange, Mapping) and vrange.get("min") is not None:
        lo = parse_quantity(vrange["min"])
        if requested < lo:
            return lo
        if vrange.get("step") is None:
            return requested
        step = parse_quantity(vrange["step"])
        # Quantity.Value() rounds up to a whole number first, as the upstream code does
        req = Fraction(-(-requested.numerator // requested.denominator))
        n, mod = divmod(int(req - lo), int(step))
        return lo + step * (n + (1 if mod else 0))
    values = policy.get("validValues")
    if values:
        for v in values:
            if requested <= parse_quantity(v):
                return parse_quantity(v)
    return requested


def violates(amount: Fraction, cap: Mapping[str, Any]) -> bool:
    policy = cap.get("requestPolicy")
    if not isinstance(policy, Mapping):
        return False
    if policy.get("default") is not None and amount == parse_quantity(policy["default"]):
        return False
    vrange = policy.get("validRange")
    if isinstance(vrange, Mapping):
        if vrange.get("max") is not None and amount > parse_quantity(vrange["max"]):
            return True
        if vrange.get("step") is not None:
            lo = parse_quantity(vrange.get("min") or "0")
            if (amount - lo) % parse_quantity(vrange["step"]):
                return True
        return False
    values = policy.get("validValues")
    if values:
        return all(amount != parse_quantity(v) for v in values)
    return False


_TERM = re.compile(r'^\s*device\.(?:driver\s*==\s*"([^"]*)"|attributes\["([^"]+)"\]\.(\w+)\s*==\s*("[^"]*"|-?\d+|true|false))\s*$')


def cel_matches(expression: str, device: _Device) -> bool:
    """The small CEL subset this stand-in evaluates (see the module doc); AllocationFailed for anything else."""
    for term in expression.split("&&"):
        m = _TERM.match(term)
        if m is None:
            raise AllocationFailed(f"CEL expression {expression!r} is beyond this allocator stand-in")
        driver, domain, attr, literal = m.groups()
        if driver is not None:
            if device.ref.driver != driver:
                return False
            continue
        name = attr if domain == device.ref.driver else f"{domain}/{attr}"
        value = (device.obj.get("attributes") or {}).get(name)
        if not isinstance(value, Mapping):
            return False
        got = next(iter(value.values()), None)
        want: Any = literal[1:-1] if literal.startswith('"') else (literal == "true" if literal in ("true", "false")
                                                                   else int(literal))
        if got != want:
            return False
    return True


def attribute(device: _Device, qualified: str) -> Any:
    """A device attribute's value by its fully qualified name ("<domain>/<name>"; a bare name is the driver's)."""
    domain, _, attr = qualified.rpartition("/")
    name = attr if domain in ("", device.ref.driver) else qualified
    value = (device.obj.get("attributes") or {}).get(name)
    return next(iter(value.values()), None) if isinstance(value, Mapping) else None


def _distinct(claim: Mapping[str, Any]) -> list[tuple[frozenset[str] | None, str]]:
    """The claim's distinctAttribute constraints: (the requests they bind, None for all; the attribute)."""
    out = []
    for c in (claim.get("spec") or {}).get("devices", {}).get("constraints") or []:
        if set(c) - {"requests", "distinctAttribute"} or not c.get("distinctAttribute"):
            raise AllocationFailed(f"constraint {dict(c)!r} is beyond this allocator stand-in (distinctAttribute only)")
        names = c.get("requests")
        out.append((frozenset(names) if names else None, c["distinctAttribute"]))
    return out


def _selectors(obj: Mapping[str, Any] | None) -> list[str]:
    return [s["cel"]["expression"] for s in (obj or {}).get("selectors") or [] if isinstance(s.get("cel"), Mapping)]


@dataclass
class _Usage:
    """What allocated claims hold: exclusive devices, and the consumed sum per (device, capacity)."""

    exclusive: set[DeviceRef] = field(default_factory=set)
    consumed: dict[tuple[DeviceRef, str], Fraction] = field(default_factory=dict)

    def add(self, result: Mapping[str, Any]) -> None:
        ref = DeviceRef(result["driver"], result["pool"], result["device"])
        if result.get("consumedCapacity"):
            for name, q in result["consumedCapacity"].items():
                self.consumed[(ref, name)] = self.consumed.get((ref, name), Fraction(0)) + parse_quantity(q)
        else:
            self.exclusive.add(ref)

    def remove(self, result: Mapping[str, Any]) -> None:
        ref = DeviceRef(result["driver"], result["pool"], result["device"])
        if result.get("consumedCapacity"):
            for name, q in result["consumedCapacity"].items():
                self.consumed[(ref, name)] -= parse_quantity(q)
        else:
            self.exclusive.discard(ref)


def node_devices(slices: Iterable[Mapping[str, Any]], node: str) -> list[_Device]:
    """The devices of the node's complete pools at their newest generation, in pool then slice order."""
    pools: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for s in slices:
        spec = s.get("spec") or {}
        if spec.get("nodeName") != node and spec.get("allNodes") is not True:
            continue
        pools.setdefault((spec["driver"], spec["pool"]["name"]), []).append(s)
    out: list[_Device] = []
    for (driver, pool), members in sorted(pools.items()):
        newest = max(m["spec"]["pool"]["generation"] for m in members)
        current = [m for m in members if m["spec"]["pool"]["generation"] == newest]
        if len(current) < current[0]["spec"]["pool"]["resourceSliceCount"]:
            continue  # incomplete pool: not usable until the driver has published all of it
        for m in sorted(current, key=lambda m: m["metadata"]["name"]):
            for d in m["spec"].get("devices") or []:
                out.append(_Device(DeviceRef(driver, pool, d["name"]), d))
    return out


class Allocator:
    """Allocates claims the way kube-scheduler does, one claim at a time, remembering what it allocated."""

    def __init__(self, device_classes: Mapping[str, Mapping[str, Any]]) -> None:
        self.classes = dict(device_classes)
        self.usage = _Usage()

    def learn(self, claims: Iterable[Mapping[str, Any]]) -> None:
        """Count what already-allocated claims hold (the scheduler's view of the cluster)."""
        for claim in claims:
            for r in (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []:
                self.usage.add(r)

    def release(self, claim: Mapping[str, Any]) -> None:
        """A claim deallocated (its pods are gone): what it held is free again."""
        for r in (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []:
            self.usage.remove(r)

    def _fits(self, device: _Device, request: Mapping[str, Any], taken: _Usage) -> dict[str, Fraction] | None:
        """The consumed capacity if `device` can serve one device of `request` now, else None."""
        capacity = device.capacity()
        wanted = {k: parse_quantity(v) for k, v in ((request.get("capacity") or {}).get("requests") or {}).items()}
        if any(name not in capacity for name in wanted):
            return None  # requestsContainNonExistCapacity
        if not device.multi:
            if device.ref in taken.exclusive or any(k[0] == device.ref for k in taken.consumed if taken.consumed[k]):
                return None
            if any(parse_quantity(capacity[n]["value"]) < v for n, v in wanted.items()):
                return None
            return {}
        if device.ref in taken.exclusive:
            return None
        consumed: dict[str, Fraction] = {}
        for name, cap in capacity.items():
            amount = consumed_amount(wanted.get(name), cap)
            if violates(amount, cap):
                return None
            if taken.consumed.get((device.ref, name), Fraction(0)) + amount > parse_quantity(cap["value"]):
                return None
            consumed[name] = amount
        return consumed

    def _candidates(self, request: Mapping[str, Any], devices: list[_Device]) -> list[_Device]:
        cls = self.classes.get(request.get("deviceClassName", ""))
        if cls is None:
            raise AllocationFailed(f"DeviceClass {request.get('deviceClassName')!r} not found")
        exprs = _selectors(cls.get("spec")) + _selectors(request)
        return [d for d in devices if all(cel_matches(e, d) for e in exprs)]

    def allocate(self, claim: Mapping[str, Any], node: str, slices: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
        """The claim's status.allocation on `node` (and what it holds is counted); AllocationFailed otherwise."""
        devices = node_devices(slices, node)
        slots: list[tuple[str, list[tuple[str, Mapping[str, Any]]]]] = []  # (request name, alternatives) per device
        for req in (claim.get("spec") or {}).get("devices", {}).get("requests") or []:
            if "exactly" in req:
                alternatives = [(req["name"], req["exactly"])]
            else:
                alternatives = [(f"{req['name']}/{sub['name']}", sub) for sub in req.get("firstAvailable") or []]
            if not alternatives:
                raise AllocationFailed(f"request {req.get('name')!r} has neither exactly nor firstAvailable")
            for _, spec in alternatives:
                if (spec.get("allocationMode") or "ExactCount") != "ExactCount":
                    raise AllocationFailed(f"allocationMode {spec.get('allocationMode')!r} is beyond this stand-in")
            count = int(alternatives[0][1].get("count") or 1)
            slots += [(req["name"], alternatives)] * count
        results: list[dict[str, Any]] = []
        picked: list[tuple[str, _Device]] = []  # (main request, device) of each result so far
        distinct = _distinct(claim)
        chosen_sub: dict[str, str] = {}

        def allowed(main: str, device: _Device) -> bool:
            for names, attr in distinct:
                if names is not None and main not in names:
                    continue
                value = attribute(device, attr)
                if value is None or any(attribute(d, attr) == value for m, d in picked
                                        if names is None or m in names):
                    return False
            return True

        def search(i: int) -> bool:
            if i == len(slots):
                return True
            main, alternatives = slots[i]
            for name, spec in alternatives:
                if chosen_sub.get(main, name) != name:
                    continue  # every device of a request comes from the same subrequest
                fresh = main not in chosen_sub
                chosen_sub[main] = name
                for device in self._candidates(spec, devices):
                    consumed = self._fits(device, spec, self.usage) if allowed(main, device) else None
                    if consumed is None:
                        continue
                    result: dict[str, Any] = {"request": name, "driver": device.ref.driver,
                                              "pool": device.ref.pool, "device": device.ref.name}
                    if device.multi:
                        result["shareID"] = str(uuid.uuid4())
                        result["consumedCapacity"] = {k: _q(v) for k, v in consumed.items()}
                    self.usage.add(result)
                    results.append(result)
                    picked.append((main, device))
                    if search(i + 1):
                        return True
                    results.pop()
                    picked.pop()
                    self.usage.remove(result)
                if fresh:
                    del chosen_sub[main]
            return False

        if not search(0):
            raise AllocationFailed(f"cannot allocate all of claim {claim['metadata'].get('name')!r} on node {node}: "
                                   "no device with enough capacity left matches each request")
        return {"devices": {"results": results},
                "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": [node]}]}]}}


def reserved_for(pod: Mapping[str, Any]) -> list[dict[str, str]]:
    """status.reservedFor naming a pod, as kube-scheduler writes it."""
    return [{"resource": "pods", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}]
