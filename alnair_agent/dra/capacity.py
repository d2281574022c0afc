"""The capacity model of the DRA front-end: how a GPU is published (one device, consumable `memory` and `compute`)
and how an allocation result's consumed capacity is checked against it.

Each GPU is one device with `allowMultipleAllocations: true`, so kube-scheduler may allocate it to many claims, each
consuming part of each capacity (KEP-5075). The request policies make kube-scheduler round a request up to what the
agent enforces: `memory` in bytes with step = ALNAIR_MEMORY_UNIT_MIB (the device plugin's memory unit), `compute` in
percent with step 1. A capacity a claim does not ask for defaults to 0: a memory-only claim gets no compute cap and
a compute-only claim no memory cap, as with the device plugin.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from alnair_agent.constants import (
    COMPUTE_UNITS_PER_GPU,
    DRA_API_GROUP_VERSION,
    DRA_ATTR_INDEX,
    DRA_ATTR_MEMORY,
    DRA_ATTR_PRODUCT,
    DRA_ATTR_UUID,
    DRA_CAP_COMPUTE,
    DRA_CAP_MEMORY,
    DRA_DEVICE_CLASS,
    DRA_DEVICE_PREFIX,
    DRA_DRIVER,
    RESOURCE_MEMORY,
)
from alnair_agent.dra.quantity import QuantityError, format_bytes, parse_quantity
from alnair_agent.node.inventory import Gpu

MAX_SLICE_DEVICES = 128  # resource.k8s.io/v1 ResourceSliceMaxDevices; a node has at most 64 GPUs (config)
_ATTRIBUTE_MAX_LEN = 64  # DeviceAttributeMaxValueLength


class CapacityError(ValueError):
    """An allocation result's consumed capacity does not fit the device or its request policy; the message names
    the capacity, the value and what the policy allows."""


@dataclass(frozen=True)
class Consumed:
    """What one allocation result consumes of its GPU."""

    memory_bytes: int
    compute_percent: int

    def units(self, memory_unit_bytes: int) -> tuple[int, int]:
        """(memory units, compute units) in the device plugin's units: the one ledger counts both front-ends."""
        return self.memory_bytes // memory_unit_bytes, self.compute_percent


def device_name(index: int) -> str:
    return f"{DRA_DEVICE_PREFIX}{index}"


def pool_name(node_name: str) -> str:
    """One pool per node, named after it."""
    return node_name


def slice_name(node_name: str) -> str:
    """The node's one ResourceSlice: a DNS subdomain of at most 253 characters, stable across restarts."""
    name = f"{node_name}-{DRA_DRIVER}"
    if len(name) <= 253:
        return name
    digest = hashlib.sha256(node_name.encode()).hexdigest()[:10]
    return f"{node_name[:200].rstrip('.-')}-{digest}-{DRA_DRIVER}"


def memory_capacity(gpu: Gpu, memory_unit_bytes: int) -> int:
    """The bytes of `gpu` offered: whole memory units, as the device plugin offers them (one ledger: the inventory
    counts memory in the device plugin's units)."""
    return gpu.units[RESOURCE_MEMORY] * memory_unit_bytes


def _range_policy(value: str, step: str) -> dict[str, Any]:
    return {"default": "0", "validRange": {"min": "0", "max": value, "step": step}}


def device_json(gpu: Gpu, memory_unit_bytes: int) -> dict[str, Any]:
    """The ResourceSlice device of one GPU (resource.k8s.io/v1 JSON)."""
    memory = format_bytes(memory_capacity(gpu, memory_unit_bytes))
    compute = str(COMPUTE_UNITS_PER_GPU)
    return {
        "name": device_name(gpu.info.index),
        "attributes": {
            DRA_ATTR_UUID: {"string": gpu.uuid[:_ATTRIBUTE_MAX_LEN]},
            DRA_ATTR_INDEX: {"int": gpu.info.index},
            DRA_ATTR_PRODUCT: {"string": (gpu.info.name or "unknown")[:_ATTRIBUTE_MAX_LEN]},
            DRA_ATTR_MEMORY: {"int": gpu.info.memory_bytes},
        },
        "capacity": {
            DRA_CAP_MEMORY: {"value": memory, "requestPolicy": _range_policy(memory, format_bytes(memory_unit_bytes))},
            DRA_CAP_COMPUTE: {"value": compute, "requestPolicy": _range_policy(compute, "1")},
        },
        "allowMultipleAllocations": True,
    }


def publishable(gpu: Gpu) -> bool:
    """A GPU with at least one memory unit (a request policy needs min + step within the capacity)."""
    return gpu.units[RESOURCE_MEMORY] >= 1


def slice_spec(node_name: str, devices: list[dict[str, Any]], generation: int) -> dict[str, Any]:
    """The spec of the node's ResourceSlice: its one pool, all its published GPUs."""
    return {
        "driver": DRA_DRIVER,
        "pool": {"name": pool_name(node_name), "generation": generation, "resourceSliceCount": 1},
        "nodeName": node_name,
        "devices": devices[:MAX_SLICE_DEVICES],
    }


def device_class_json() -> dict[str, Any]:
    """The DeviceClass that claims name (manifests/alnair-dra.yaml ships it; a test keeps the two the same)."""
    return {"apiVersion": DRA_API_GROUP_VERSION, "kind": "DeviceClass",
            "metadata": {"name": DRA_DEVICE_CLASS,
                         "labels": {"app.kubernetes.io/name": "alnair-agent", "app.kubernetes.io/part-of": "alnair"}},
            "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRA_DRIVER}"'}}]}}


def keeps_consumable_capacity(device: Mapping[str, Any]) -> bool:
    """Whether an API server's answer still carries what consumable capacity needs (a server without the
    DRAConsumableCapacity feature drops these fields silently)."""
    capacity = device.get("capacity") if isinstance(device.get("capacity"), Mapping) else {}
    memory = capacity.get(DRA_CAP_MEMORY) if isinstance(capacity, Mapping) else None
    return device.get("allowMultipleAllocations") is True and isinstance(memory, Mapping) \
        and isinstance(memory.get("requestPolicy"), Mapping)


def _whole(name: str, raw: object) -> int:
    try:
        amount = parse_quantity(raw)
    except QuantityError as e:
        raise CapacityError(f"consumed {name}: {e}") from None
    if amount.denominator != 1:
        raise CapacityError(f"consumed {name} {raw!r} is not a whole number")
    return int(amount)


def consumed_of(consumed: object, gpu: Gpu, memory_unit_bytes: int) -> Consumed:
    """Check an allocation result's consumedCapacity against the device as published; CapacityError naming what is
    wrong. kube-scheduler records every capacity of a multi-allocatable device, rounded up by the request policy,
    so anything else was not allocated by the rules the slice set."""
    if not isinstance(consumed, Mapping) or not consumed:
        raise CapacityError("the allocation records no consumedCapacity (the cluster must serve consumable capacity, "
                            "KEP-5075: feature DRAConsumableCapacity)")
    unknown = sorted(str(k) for k in consumed if k not in (DRA_CAP_MEMORY, DRA_CAP_COMPUTE))
    if unknown:
        raise CapacityError(f"consumedCapacity names {', '.join(unknown)}, which the device does not have "
                            f"(it has {DRA_CAP_MEMORY}, {DRA_CAP_COMPUTE})")
    for name in (DRA_CAP_MEMORY, DRA_CAP_COMPUTE):
        if name not in consumed:
            raise CapacityError(f"consumedCapacity lacks {name}")
    memory = _whole(DRA_CAP_MEMORY, consumed[DRA_CAP_MEMORY])
    compute = _whole(DRA_CAP_COMPUTE, consumed[DRA_CAP_COMPUTE])
    capacity = memory_capacity(gpu, memory_unit_bytes)
    if not 0 <= memory <= capacity or memory % memory_unit_bytes:
        raise CapacityError(f"consumed {DRA_CAP_MEMORY} {consumed[DRA_CAP_MEMORY]} does not match the request policy "
                            f"of {device_name(gpu.info.index)}: 0..{format_bytes(capacity)} in steps of "
                            f"{format_bytes(memory_unit_bytes)}")
    if not 0 <= compute <= COMPUTE_UNITS_PER_GPU:
        raise CapacityError(f"consumed {DRA_CAP_COMPUTE} {consumed[DRA_CAP_COMPUTE]} does not match the request "
                            f"policy of {device_name(gpu.info.index)}: 0..{COMPUTE_UNITS_PER_GPU} in steps of 1")
    return Consumed(memory, compute)
