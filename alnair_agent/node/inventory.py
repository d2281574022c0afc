"""The node's GPUs as the device plugin offers them: device IDs per resource, health, units per GPU."""

from __future__ import annotations

from dataclasses import dataclass

from alnair_agent.constants import (
    COMPUTE_UNITS_PER_GPU,
    DEVICE_ID_SEPARATOR,
    DEVICE_KIND,
    RESOURCE_COMPUTE,
    RESOURCE_MEMORY,
)
from alnair_agent.gpu.backend import GpuInfo

_KIND_TO_RESOURCE = {kind: resource for resource, kind in DEVICE_KIND.items()}


class UnknownDevice(ValueError):
    """A device ID that this agent did not offer (malformed, other GPU, other resource, out of range)."""


@dataclass(frozen=True)
class DeviceId:
    gpu_uuid: str
    resource: str
    index: int

    def __str__(self) -> str:
        return DEVICE_ID_SEPARATOR.join((self.gpu_uuid, DEVICE_KIND[self.resource], str(self.index)))


@dataclass
class Gpu:
    info: GpuInfo
    units: dict[str, int]  # resource -> units this GPU offers
    healthy: bool = True

    @property
    def uuid(self) -> str:
        return self.info.uuid


class Inventory:
    """GPUs in index order, with the units each offers for both resources."""

    def __init__(self, gpus: list[GpuInfo], memory_unit_bytes: int) -> None:
        if memory_unit_bytes <= 0:
            raise ValueError("memory unit must be positive")
        self.memory_unit_bytes = memory_unit_bytes
        self.gpus: dict[str, Gpu] = {}
        for info in sorted(gpus, key=lambda g: g.index):
            units = {RESOURCE_MEMORY: info.memory_bytes // memory_unit_bytes, RESOURCE_COMPUTE: COMPUTE_UNITS_PER_GPU}
            self.gpus[info.uuid] = Gpu(info, units)
        self._known = {r: frozenset(i for i, _ in self.device_ids(r)) for r in (RESOURCE_MEMORY, RESOURCE_COMPUTE)}

    def device_ids(self, resource: str) -> list[tuple[str, bool]]:
        """Every device ID of `resource`, with whether its GPU is healthy, in GPU then unit order."""
        return [
            (str(DeviceId(gpu.uuid, resource, k)), gpu.healthy)
            for gpu in self.gpus.values()
            for k in range(gpu.units[resource])
        ]

    def parse(self, text: str, resource: str) -> DeviceId:
        """Parse one of our device IDs of `resource`; raise UnknownDevice saying what is wrong."""
        parts = text.split(DEVICE_ID_SEPARATOR)
        if len(parts) != 3:
            raise UnknownDevice(f"device ID {text!r} is not <GPU-UUID>::<kind>::<n>")
        uuid, kind, number = parts
        gpu = self.gpus.get(uuid)
        if gpu is None:
            raise UnknownDevice(f"device ID {text!r} names GPU {uuid!r}, which is not on this node")
        if _KIND_TO_RESOURCE.get(kind) != resource:
            raise UnknownDevice(f"device ID {text!r} is not a {resource} device")
        # ASCII digits only: str.isdigit() also takes '¹' and the like, which int() refuses (an UNKNOWN error).
        if not (number.isascii() and number.isdigit()) or not 0 <= int(number) < gpu.units[resource]:
            raise UnknownDevice(f"device ID {text!r}: unit {number!r} out of range 0..{gpu.units[resource] - 1}")
        return DeviceId(uuid, resource, int(number))

    def check(self, device_ids: list[str], resource: str) -> None:
        """Raise UnknownDevice for the first ID that is not one of ours for `resource` (a set lookup each)."""
        known = self._known[resource]
        for device_id in device_ids:
            if device_id not in known:
                self.parse(device_id, resource)
                raise UnknownDevice(f"device ID {device_id!r} is not offered by this node")

    @staticmethod
    def owner(device_id: str) -> tuple[str, str] | None:
        """(GPU UUID, resource) a device ID names, without range checks (for counting IDs already vetted)."""
        parts = device_id.split(DEVICE_ID_SEPARATOR)
        if len(parts) != 3 or parts[1] not in _KIND_TO_RESOURCE:
            return None
        return parts[0], _KIND_TO_RESOURCE[parts[1]]

    def set_health(self, uuid: str, healthy: bool) -> bool:
        """Record a health change; True when it changed anything."""
        gpu = self.gpus.get(uuid)
        if gpu is None or gpu.healthy == healthy:
            return False
        gpu.healthy = healthy
        return True
