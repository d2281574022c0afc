"""The placement decision, its confirmation and the per-node lock: the records the scheduler extender and the
node agent hand each other through pod annotations. One definition of each; both sides import this module.

- `ai.centaurus.io/placement` (written by the extender at bind, before it binds the pod; never changed after):
  `{"node": "<node>", "profile": "<schedulerName>", "decidedAt": "<RFC 3339>", "gpus": {"<container>": "<GPU UUID>"}}`
  — the GPU of every container of the pod that asks for Alnair resources; a container asking for several GPUs
  (`alnair/vgpu-count`) has a list of GPU UUIDs, distinct, in GPU index order: `{"<container>": ["<UUID>", ...]}`.
- `ai.centaurus.io/allocated` (written by the agent once kubelet has allocated every such container):
  `{"node": "<node>", "containers": {"<container>": {"gpu": "<GPU UUID>", "allocation": "<id>",
  "memoryLimitBytes": n, "computeLimitPercent": n}}}` — what each container really got (a multi-GPU container:
  `gpu` is its first GPU, `gpus` lists them all and `allocations` their allocations, in the same order; the
  limits are per GPU). Memory asked as a percent of the GPU adds `memoryPercent` (memoryLimitBytes is that share
  of the first GPU, converted there), and for several GPUs `memoryLimitsBytes`, the limit on each.
- The lock: a node is locked by a pod that has a placement for it, no `allocated` record, is neither finished nor
  being deleted, and was decided less than `LOCK_TTL_S` ago. The extender binds no other pod to a locked node, so
  at most one pod per node is between bind and admission, and the agent knows which pod kubelet is admitting. The
  lock is derived from the pods themselves (one writer per record), so it survives restarts of either side and is
  released by the pod's admission, its deletion, its failure or the expiry — whichever comes first.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from alnair_agent.constants import ANNOTATION_PREFIX

PLACEMENT_ANNOTATION = ANNOTATION_PREFIX + "placement"
ALLOCATED_ANNOTATION = ANNOTATION_PREFIX + "allocated"
# A bound pod that kubelet has not admitted within this long no longer holds its node's lock (kubelet admits a
# bound pod within a second or two; a node whose kubelet is down is NotReady and gets no pods anyway).
LOCK_TTL_S = 30.0
_MAX_CONTAINERS = 1024  # far above what a pod can have; bounds what a hostile annotation makes us parse
_MAX_GPUS = 16  # GPUs of one container (fit.MAX_GPUS_PER_CONTAINER)


class DecisionError(ValueError):
    """A placement or allocated annotation that is not what this module writes; the message says what is wrong."""


def rfc3339(when: datetime) -> str:
    return when.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_time(value: Any) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


def _load(text: Any, key: str) -> Mapping[str, Any]:
    if not isinstance(text, str):
        raise DecisionError(f"{key} is not a string")
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise DecisionError(f"{key} is not JSON: {e}") from None
    if not isinstance(doc, Mapping):
        raise DecisionError(f"{key} is not a JSON object")
    return doc


def _gpu_map(value: Any, key: str) -> dict[str, tuple[str, ...]]:
    """container -> GPU UUIDs: a string for one GPU, a list of distinct strings for several."""
    if not isinstance(value, Mapping) or len(value) > _MAX_CONTAINERS:
        raise DecisionError(f"{key}: gpus must be an object of container name -> GPU UUID(s)")
    out = {}
    for name, item in value.items():
        if not isinstance(name, str) or not name:
            raise DecisionError(f"{key}: gpus must map non-empty container names to GPU UUIDs")
        gpus = (item,) if isinstance(item, str) else tuple(item) if isinstance(item, list) else ()
        if not gpus or len(gpus) > _MAX_GPUS or not all(isinstance(g, str) and g for g in gpus):
            raise DecisionError(f"{key}: gpus[{name!r}] must be a GPU UUID or a list of 1..{_MAX_GPUS} of them")
        if len(set(gpus)) != len(gpus):
            raise DecisionError(f"{key}: gpus[{name!r}] names a GPU twice")
        out[name] = gpus
    return out


@dataclass(frozen=True)
class Decision:
    """The extender's placement of one pod."""

    node: str
    profile: str
    decided_at: datetime
    gpus: Mapping[str, tuple[str, ...]]  # container -> its GPU UUIDs (one, or several in GPU index order)

    def to_json(self) -> str:
        gpus = {name: uuids[0] if len(uuids) == 1 else list(uuids) for name, uuids in sorted(self.gpus.items())}
        return json.dumps({"node": self.node, "profile": self.profile, "decidedAt": rfc3339(self.decided_at),
                           "gpus": gpus}, sort_keys=True)

    def expired(self, now: datetime) -> bool:
        return now - self.decided_at >= timedelta(seconds=LOCK_TTL_S)


def parse_decision(text: Any) -> Decision:
    doc = _load(text, PLACEMENT_ANNOTATION)
    node, profile, when = doc.get("node"), doc.get("profile"), parse_time(doc.get("decidedAt"))
    if not isinstance(node, str) or not node:
        raise DecisionError(f"{PLACEMENT_ANNOTATION}: node must be a non-empty string")
    if not isinstance(profile, str):
        raise DecisionError(f"{PLACEMENT_ANNOTATION}: profile must be a string")
    if when is None:
        raise DecisionError(f"{PLACEMENT_ANNOTATION}: decidedAt must be an RFC 3339 time")
    return Decision(node, profile, when, _gpu_map(doc.get("gpus"), PLACEMENT_ANNOTATION))


@dataclass(frozen=True)
class Granted:
    """What one container really got, as the agent records it on the pod."""

    gpu: str
    allocation: str
    memory_limit_bytes: int  # per GPU
    compute_limit_percent: int  # per GPU
    gpus: tuple[str, ...] = ()  # a multi-GPU container: every GPU, in the order it sees them (gpu is the first)
    allocations: tuple[str, ...] = ()  # and the allocation on each
    memory_percent: int = 0  # memory asked as a percent of each GPU (alnair/vgpu-memory-percent), 0: in units
    # a multi-GPU container with memory as a percent: the limit on each GPU, in `gpus` order (GPUs may differ)
    memory_limits_bytes: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"gpu": self.gpu, "allocation": self.allocation,
                               "memoryLimitBytes": self.memory_limit_bytes,
                               "computeLimitPercent": self.compute_limit_percent}
        if len(self.gpus) > 1:
            out["gpus"], out["allocations"] = list(self.gpus), list(self.allocations)
        if self.memory_percent:
            out["memoryPercent"] = self.memory_percent
            if len(self.memory_limits_bytes) > 1:
                out["memoryLimitsBytes"] = list(self.memory_limits_bytes)
        return out


def allocated_json(node: str, containers: Mapping[str, Granted]) -> str:
    return json.dumps({"node": node, "containers": {n: g.to_dict() for n, g in sorted(containers.items())}},
                      sort_keys=True)


def parse_allocated(text: Any) -> dict[str, Granted]:
    doc = _load(text, ALLOCATED_ANNOTATION)
    containers = doc.get("containers")
    if not isinstance(containers, Mapping) or len(containers) > _MAX_CONTAINERS:
        raise DecisionError(f"{ALLOCATED_ANNOTATION}: containers must be an object")
    out = {}
    for name, item in containers.items():
        if not isinstance(name, str) or not isinstance(item, Mapping):
            raise DecisionError(f"{ALLOCATED_ANNOTATION}: containers must map names to objects")
        gpu, alloc = item.get("gpu"), item.get("allocation")
        mem, comp = item.get("memoryLimitBytes"), item.get("computeLimitPercent")
        if not isinstance(gpu, str) or not isinstance(alloc, str) or any(
                isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in (mem, comp)):
            raise DecisionError(f"{ALLOCATED_ANNOTATION}: container {name!r} has malformed fields")
        gpus, allocs = item.get("gpus", []), item.get("allocations", [])
        if (not isinstance(gpus, list) or not isinstance(allocs, list) or len(gpus) != len(allocs)
                or len(gpus) > _MAX_GPUS or not all(isinstance(v, str) for v in gpus + allocs)):
            raise DecisionError(f"{ALLOCATED_ANNOTATION}: container {name!r}: gpus and allocations must be lists of "
                                "strings of the same length")
        percent, limits = item.get("memoryPercent", 0), item.get("memoryLimitsBytes", [])
        if (isinstance(percent, bool) or not isinstance(percent, int) or not 0 <= percent <= 100
                or not isinstance(limits, list) or len(limits) > _MAX_GPUS
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in limits)):
            raise DecisionError(f"{ALLOCATED_ANNOTATION}: container {name!r}: memoryPercent must be 0..100 and "
                                "memoryLimitsBytes a list of byte counts")
        out[name] = Granted(gpu, alloc, mem, comp, tuple(gpus), tuple(allocs),  # type: ignore[arg-type]
                            percent, tuple(limits))
    return out


def holds_lock(decision: Decision | None, confirmed: bool, live: bool, now: datetime) -> bool:
    """Whether a pod with this decision holds its node's lock (see the module doc)."""
    return decision is not None and not confirmed and live and not decision.expired(now)
