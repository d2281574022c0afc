"""The node annotation `ai.centaurus.io/gpu-devices`: the agent's report of its GPUs, read by the extender.

    {"memoryUnitMiB": 1024, "heartbeat": "<RFC 3339>", "pods": ["<pod uid>", ...],
     "gpus": [{"uuid", "index", "name", "healthy", "memoryUnits", "memoryUnitsFree", "computeUnits",
               "computeUnitsFree"}, ...]}

`pods` names every pod whose units the free counts already subtract, so the extender adds exactly the pods it has
placed that are not in it yet (nothing counted twice, nothing missed). A pod is subtracted whole: one the agent is
still allocating also holds the units kubelet has yet to ask for. `heartbeat` is rewritten at least every
`HEARTBEAT_S`; a node whose heartbeat is older than `STALE_AFTER_S` gets no new pods (its agent is gone).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from alnair_agent.constants import COMPUTE_UNITS_PER_GPU, NODE_GPU_DEVICES
from alnair_agent.node.decision import parse_time, rfc3339
from alnair_agent.node.fit import Room

HEARTBEAT_S = 60.0
STALE_AFTER_S = 180.0


class AnnotationError(ValueError):
    """A node's GPU annotation is missing or unreadable (the message is the node's failure reason)."""


@dataclass(frozen=True)
class GpuReport:
    """One GPU as the node agent reports it: units offered and free of each resource."""

    index: int
    uuid: str = ""
    name: str = ""
    healthy: bool = True
    memory_units: int = 0
    memory_free: int = 0
    compute_units: int = COMPUTE_UNITS_PER_GPU
    compute_free: int = COMPUTE_UNITS_PER_GPU

    def room(self) -> Room:
        return Room(self.uuid or str(self.index), self.index, self.memory_free, self.compute_free,
                    self.memory_units, self.compute_units)

    def to_dict(self) -> dict[str, Any]:
        return {"uuid": self.uuid, "index": self.index, "name": self.name, "healthy": self.healthy,
                "memoryUnits": self.memory_units, "memoryUnitsFree": self.memory_free,
                "computeUnits": self.compute_units, "computeUnitsFree": self.compute_free}


@dataclass(frozen=True)
class NodeReport:
    memory_unit_mib: int
    gpus: tuple[GpuReport, ...]
    heartbeat: datetime | None = None
    pods: frozenset[str] = field(default_factory=frozenset)

    @property
    def healthy(self) -> tuple[GpuReport, ...]:
        return tuple(g for g in self.gpus if g.healthy)

    def rooms(self) -> list[Room]:
        return [g.room() for g in self.healthy]

    def to_json(self) -> str:
        doc: dict[str, Any] = {"memoryUnitMiB": self.memory_unit_mib, "gpus": [g.to_dict() for g in self.gpus],
                               "pods": sorted(self.pods)}
        if self.heartbeat is not None:
            doc["heartbeat"] = rfc3339(self.heartbeat)
        return json.dumps(doc, sort_keys=True)

    def stale(self, now: datetime) -> bool:
        return self.heartbeat is not None and (now - self.heartbeat).total_seconds() > STALE_AFTER_S


def _count(gpu: Mapping[str, Any], key: str, where: str) -> int:
    value = gpu.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise AnnotationError(f"{where}: {key} = {json.dumps(value)} is not a non-negative integer")
    return value


def parse_report(text: Any) -> NodeReport:
    """The report in a node's annotation value; AnnotationError with the reason otherwise."""
    if text is None:
        raise AnnotationError(f"node has no {NODE_GPU_DEVICES} annotation (no Alnair agent reports its GPUs)")
    prefix = f"node annotation {NODE_GPU_DEVICES} is unreadable"
    try:
        doc = json.loads(text) if isinstance(text, str) else None
    except ValueError as e:
        raise AnnotationError(f"{prefix}: {e}") from None
    if not isinstance(doc, Mapping) or not isinstance(doc.get("gpus"), list):
        raise AnnotationError(f"{prefix}: not an object with a \"gpus\" list")
    unit = doc.get("memoryUnitMiB", 1024)
    if isinstance(unit, bool) or not isinstance(unit, int) or unit <= 0:
        raise AnnotationError(f"{prefix}: memoryUnitMiB = {json.dumps(unit)} is not a positive integer")
    pods = doc.get("pods", [])
    if not isinstance(pods, list) or not all(isinstance(p, str) for p in pods):
        raise AnnotationError(f"{prefix}: pods is not a list of pod UIDs")
    heartbeat = doc.get("heartbeat")
    when = parse_time(heartbeat)
    if heartbeat is not None and when is None:
        raise AnnotationError(f"{prefix}: heartbeat = {json.dumps(heartbeat)} is not an RFC 3339 time")
    gpus: list[GpuReport] = []
    for position, raw in enumerate(doc["gpus"]):
        if not isinstance(raw, Mapping):
            raise AnnotationError(f"{prefix}: gpus[{position}] is not an object")
        where = f"{prefix}: gpus[{position}]"
        index = raw.get("index", position)
        healthy = raw.get("healthy", True)  # an agent that reports no health reports a healthy GPU
        if isinstance(index, bool) or not isinstance(index, int) or not isinstance(healthy, bool):
            raise AnnotationError(f"{where}: index must be an integer and healthy a boolean")
        uuid = raw.get("uuid", "")
        name = raw.get("name", "")
        gpu = GpuReport(
            index=index, uuid=uuid if isinstance(uuid, str) else "", name=name if isinstance(name, str) else "",
            healthy=healthy,
            memory_units=_count(raw, "memoryUnits", where), memory_free=_count(raw, "memoryUnitsFree", where),
            compute_units=_count(raw, "computeUnits", where), compute_free=_count(raw, "computeUnitsFree", where),
        )
        if gpu.memory_free > gpu.memory_units or gpu.compute_free > gpu.compute_units:
            raise AnnotationError(f"{where}: more units free than offered")
        gpus.append(gpu)
    return NodeReport(unit, tuple(sorted(gpus, key=lambda g: (g.index, g.uuid))), when, frozenset(pods))


def report_of_node(node: Any) -> NodeReport:
    """The report on a v1.Node JSON dict."""
    meta = node.get("metadata") if isinstance(node, Mapping) else None
    annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
    return parse_report(annotations.get(NODE_GPU_DEVICES) if isinstance(annotations, Mapping) else None)


def build_report(memory_unit_mib: int, gpus: Sequence[GpuReport], pods: Sequence[str],
                 heartbeat: datetime) -> NodeReport:
    return NodeReport(memory_unit_mib, tuple(gpus), heartbeat, frozenset(pods))
