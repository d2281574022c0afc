"""The extender's logic, free of I/O: kube-scheduler's ExtenderArgs (as decoded JSON) in, the answer out.

kube-scheduler sends Go structs without JSON tags, so field names are the Go names, capitalized (`Pod`, `Nodes`,
`NodeNames`); Go's decoder matches names case-insensitively, and so does `_field` here.

Filter. A node passes when the pod's Alnair containers fit its healthy GPUs' free units, as the node agent reports
them in the node annotation `ai.centaurus.io/gpu-devices`. A container's memory and compute units come from ONE
GPU. Containers that run at the same time must fit at the same time:
  - the regular containers together with the sidecars (init containers with restartPolicy Always), packed
    first-fit-decreasing into the GPUs (largest dominant share first, GPUs in index order);
  - each run-once init container on its own, beside the sidecars declared before it (init containers run one at
    a time, before the regular containers; their units are free again when they end).
A node that could not take the pod even with all its healthy GPUs empty (no annotation, no healthy GPU, a
container larger than any GPU) goes to FailedAndUnresolvableNodes: preempting pods there would not help. A pod
asking for no Alnair resources passes every node.

Prioritize, by the pod's `spec.schedulerName`, on the node's Alnair utilization after placing the pod (the mean of
memory and compute: used / offered over its healthy GPUs, counting the pod's regular containers and sidecars):
  - `alnair-cost-saving` packs: score = round(10 * utilization), the most used nodes first;
  - `alnair-high-performance` spreads: score = 10 - that, the least used first;
  - any other scheduler name, or a pod asking for no Alnair resources: every node scores 0 (no opinion: a
    uniform score changes no ranking, and the default profile should not be steered by GPU packing).
A node the pod does not fit scores 0. Scores are integers 0..10 computed with exact fractions (deterministic).

The extender is stateless: the annotation is its only view of a node, so it is not node-cache-capable
(configure kube-scheduler with `nodeCacheCapable: false`). Asked with NodeNames only, it passes every name for
a pod without Alnair requests and answers an Error for one with them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from alnair_agent.constants import COMPUTE_UNITS_PER_GPU, NODE_GPU_DEVICES, RESOURCE_COMPUTE, RESOURCE_MEMORY
from alnair_agent.kube.pods import parse_quantity

PROFILE_COST_SAVING = "alnair-cost-saving"
PROFILE_HIGH_PERFORMANCE = "alnair-high-performance"
PROFILES = (PROFILE_COST_SAVING, PROFILE_HIGH_PERFORMANCE)
MAX_SCORE = 10  # kube-scheduler's MaxExtenderPriority
NEUTRAL_SCORE = 0

KIND_INIT = "init"  # run-once init container
KIND_SIDECAR = "sidecar"  # init container with restartPolicy Always: runs beside the regular containers
KIND_REGULAR = "regular"


class RequestError(ValueError):
    """The ExtenderArgs, or the pod in them, cannot be judged (the message goes into the answer's Error)."""


class AnnotationError(ValueError):
    """A node's GPU annotation is missing or unreadable (the message is the node's failure reason)."""


# -- the pod ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ContainerNeed:
    """One container's Alnair request: units that must come from one GPU."""

    name: str
    memory: int
    compute: int
    kind: str = KIND_REGULAR

    def describe(self) -> str:
        return f"{self.memory} memory + {self.compute} compute units"


@dataclass(frozen=True)
class PodRequest:
    """What a pod asks of Alnair: its containers with a non-zero request, init containers first, in pod order."""

    namespace: str
    name: str
    scheduler_name: str
    containers: tuple[ContainerNeed, ...] = ()

    @property
    def wants_gpu(self) -> bool:
        return bool(self.containers)

    @property
    def steady(self) -> tuple[ContainerNeed, ...]:
        """The containers that run together once the pod is up: sidecars and regular containers."""
        return tuple(c for c in self.containers if c.kind != KIND_INIT)

    def groups(self) -> list[tuple[ContainerNeed, ...]]:
        """Each set of containers that must fit on the node's GPUs at the same time."""
        out: list[tuple[ContainerNeed, ...]] = []
        sidecars: list[ContainerNeed] = []
        for c in self.containers:
            if c.kind == KIND_SIDECAR:
                sidecars.append(c)
            elif c.kind == KIND_INIT:
                out.append((*sidecars, c))
        if self.steady:
            out.append(self.steady)
        return out

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


def _dict(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _str(value: Any, default: str = "") -> str:
    return value if isinstance(value, str) else default


def _field(obj: Mapping[str, Any], name: str) -> Any:
    """obj[name], matched as Go's JSON decoder does: exactly, else ignoring case."""
    if name in obj:
        return obj[name]
    lower = name.lower()
    for key, value in obj.items():
        if isinstance(key, str) and key.lower() == lower:
            return value
    return None


def parse_pod_request(pod: Any) -> PodRequest:
    """The pod's Alnair requests (limits, requests as the fallback); RequestError naming pod, container, resource
    and value for a quantity that is not a non-negative integer."""
    if not isinstance(pod, Mapping):
        raise RequestError("ExtenderArgs has no Pod object")
    meta, spec = _dict(pod.get("metadata")), _dict(pod.get("spec"))
    namespace = _str(meta.get("namespace"), "default") or "default"
    name = _str(meta.get("name")) or _str(meta.get("generateName"), "<unnamed>")
    needs: list[ContainerNeed] = []
    for key, init in (("initContainers", True), ("containers", False)):
        for spec_c in _list(spec.get(key)):
            spec_c = _dict(spec_c)
            cname = _str(spec_c.get("name"), "<unnamed>")
            resources = _dict(spec_c.get("resources"))
            limits, requests = _dict(resources.get("limits")), _dict(resources.get("requests"))
            units: dict[str, int] = {}
            for resource in (RESOURCE_MEMORY, RESOURCE_COMPUTE):
                raw = limits.get(resource, requests.get(resource))
                try:
                    units[resource] = 0 if raw is None else parse_quantity(raw)
                except ValueError:
                    raise RequestError(
                        f"pod {namespace}/{name}: container {cname!r}: {resource} = {json.dumps(raw)} is not a "
                        f"non-negative integer") from None
            if not any(units.values()):
                continue
            kind = KIND_REGULAR
            if init:
                kind = KIND_SIDECAR if spec_c.get("restartPolicy") == "Always" else KIND_INIT
            needs.append(ContainerNeed(cname, units[RESOURCE_MEMORY], units[RESOURCE_COMPUTE], kind))
    return PodRequest(namespace, name, _str(spec.get("schedulerName")), tuple(needs))


# -- the node ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Gpu:
    """One GPU as the node agent reports it: units offered and free of each resource."""

    index: int
    uuid: str = ""
    name: str = ""
    healthy: bool = True
    memory_units: int = 0
    memory_free: int = 0
    compute_units: int = COMPUTE_UNITS_PER_GPU
    compute_free: int = COMPUTE_UNITS_PER_GPU

    def describe_free(self) -> str:
        return f"GPU {self.index}: {self.memory_free}/{self.memory_units} memory, " \
               f"{self.compute_free}/{self.compute_units} compute free"


@dataclass(frozen=True)
class NodeGpus:
    memory_unit_mib: int
    gpus: tuple[Gpu, ...]

    @property
    def healthy(self) -> tuple[Gpu, ...]:
        return tuple(g for g in self.gpus if g.healthy)


def _count(gpu: Mapping[str, Any], key: str, where: str) -> int:
    value = gpu.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise AnnotationError(f"{where}: {key} = {json.dumps(value)} is not a non-negative integer")
    return value


def parse_node_gpus(node: Any) -> NodeGpus:
    """The GPUs of a node (a v1.Node JSON dict) from its annotation; AnnotationError with the reason otherwise."""
    annotations = _dict(_dict(_dict(node).get("metadata")).get("annotations"))
    text = annotations.get(NODE_GPU_DEVICES)
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
    gpus: list[Gpu] = []
    for position, raw in enumerate(doc["gpus"]):
        if not isinstance(raw, Mapping):
            raise AnnotationError(f"{prefix}: gpus[{position}] is not an object")
        where = f"{prefix}: gpus[{position}]"
        index = raw.get("index", position)
        healthy = raw.get("healthy", True)  # an agent that reports no health reports a healthy GPU
        if isinstance(index, bool) or not isinstance(index, int) or not isinstance(healthy, bool):
            raise AnnotationError(f"{where}: index must be an integer and healthy a boolean")
        gpu = Gpu(
            index=index, uuid=_str(raw.get("uuid")), name=_str(raw.get("name")), healthy=healthy,
            memory_units=_count(raw, "memoryUnits", where), memory_free=_count(raw, "memoryUnitsFree", where),
            compute_units=_count(raw, "computeUnits", where), compute_free=_count(raw, "computeUnitsFree", where),
        )
        if gpu.memory_free > gpu.memory_units or gpu.compute_free > gpu.compute_units:
            raise AnnotationError(f"{where}: more units free than offered")
        gpus.append(gpu)
    return NodeGpus(unit, tuple(sorted(gpus, key=lambda g: (g.index, g.uuid))))


# -- fitting ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Packing:
    """Where each container went (container name -> GPU index), or the first container that found no room."""

    placed: Mapping[str, int]
    no_room: ContainerNeed | None = None

    @property
    def fits(self) -> bool:
        return self.no_room is None


def pack(containers: Sequence[ContainerNeed], rooms: Sequence[tuple[int, int, int]]) -> Packing:
    """First-fit-decreasing: `rooms` are (gpu index, memory units, compute units) free, tried in the given order;
    containers go largest dominant share first (ties: more memory, more compute, pod order)."""
    mem_scale = max((m for _, m, _ in rooms), default=0) or 1
    comp_scale = max((c for _, _, c in rooms), default=0) or 1

    def key(item: tuple[int, ContainerNeed]) -> tuple[Fraction, int, int, int]:
        pos, c = item
        share = max(Fraction(c.memory, mem_scale), Fraction(c.compute, comp_scale))
        return (-share, -c.memory, -c.compute, pos)

    free = [[index, mem, comp] for index, mem, comp in rooms]
    placed: dict[str, int] = {}
    for _, c in sorted(enumerate(containers), key=key):
        for room in free:
            if room[1] >= c.memory and room[2] >= c.compute:
                room[1] -= c.memory
                room[2] -= c.compute
                placed[c.name] = room[0]
                break
        else:
            return Packing(placed, c)
    return Packing(placed)


@dataclass(frozen=True)
class Verdict:
    """The filter's answer for one node: fits, or why not and whether preemption could change that."""

    reason: str = ""
    resolvable: bool = True

    @property
    def fits(self) -> bool:
        return not self.reason


FITS = Verdict()


def _names(group: Sequence[ContainerNeed]) -> str:
    return ", ".join(repr(c.name) for c in group)


def _group_reason(group: Sequence[ContainerNeed], packing: Packing, healthy: Sequence[Gpu]) -> str:
    missing = packing.no_room
    assert missing is not None
    free = "; ".join(g.describe_free() for g in healthy)
    label = {KIND_INIT: "init container", KIND_SIDECAR: "sidecar", KIND_REGULAR: "container"}[missing.kind]
    if len(group) == 1:
        return f"no healthy GPU has room for {label} {missing.name!r} ({missing.describe()} on one GPU); {free}"
    return (f"containers {_names(group)} do not fit the GPUs together: no room left for {label} {missing.name!r} "
            f"({missing.describe()} on one GPU) after placing the others; {free}")


def check_fit(request: PodRequest, node: NodeGpus) -> Verdict:
    """Whether every group of the pod's simultaneous containers fits the node's healthy GPUs' free units."""
    if not request.wants_gpu:
        return FITS
    healthy = node.healthy
    if not healthy:
        unhealthy = len(node.gpus) - len(healthy)
        return Verdict(f"node has no healthy GPU ({len(node.gpus)} GPU(s), {unhealthy} unhealthy)", False)
    free_rooms = [(g.index, g.memory_free, g.compute_free) for g in healthy]
    empty_rooms = [(g.index, g.memory_units, g.compute_units) for g in healthy]
    for group in request.groups():
        packing = pack(group, free_rooms)
        if not packing.fits:
            # Would the group fit with every healthy GPU empty? If not, no preemption can make room.
            resolvable = pack(group, empty_rooms).fits
            return Verdict(_group_reason(group, packing, healthy), resolvable)
    return FITS


def utilization(request: PodRequest, node: NodeGpus) -> Fraction:
    """The node's healthy GPUs' share in use once the pod runs: mean of memory and compute used / offered."""
    healthy = node.healthy
    shares: list[Fraction] = []
    for offered, used, wanted in (
        (sum(g.memory_units for g in healthy), sum(g.memory_units - g.memory_free for g in healthy),
         sum(c.memory for c in request.steady)),
        (sum(g.compute_units for g in healthy), sum(g.compute_units - g.compute_free for g in healthy),
         sum(c.compute for c in request.steady)),
    ):
        if offered > 0:
            shares.append(min(Fraction(1), Fraction(used + wanted, offered)))
    return sum(shares, Fraction(0)) / len(shares) if shares else Fraction(0)


def score(request: PodRequest, node: NodeGpus) -> int:
    """0..10 by the pod's profile (see the module doc); 0 for a node the pod does not fit."""
    if request.scheduler_name not in PROFILES or not request.wants_gpu:
        return NEUTRAL_SCORE
    if not check_fit(request, node).fits:
        return 0
    packed = math.floor(MAX_SCORE * utilization(request, node) + Fraction(1, 2))  # round half up
    packed = max(0, min(MAX_SCORE, packed))
    return packed if request.scheduler_name == PROFILE_COST_SAVING else MAX_SCORE - packed


# -- the requests kube-scheduler sends --------------------------------------------------------------------------

@dataclass
class FilterResult:
    """ExtenderFilterResult; answers in the shape it was asked (Nodes, or NodeNames)."""

    nodes: list[Any] | None = None
    node_list: Mapping[str, Any] = field(default_factory=dict)  # the NodeList's other fields, echoed back
    node_names: list[str] | None = None
    failed: dict[str, str] = field(default_factory=dict)
    unresolvable: dict[str, str] = field(default_factory=dict)
    error: str = ""
    pod: str = ""  # namespace/name, for the log; not part of the answer

    def to_json(self) -> dict[str, Any]:
        nodes = None if self.nodes is None else {**self.node_list, "items": self.nodes}
        return {"Nodes": nodes, "NodeNames": self.node_names, "FailedNodes": self.failed,
                "FailedAndUnresolvableNodes": self.unresolvable, "Error": self.error}


@dataclass(frozen=True)
class HostPriority:
    host: str
    score: int

    def to_json(self) -> dict[str, Any]:
        return {"Host": self.host, "Score": self.score}


@dataclass
class PrioritizeResult:
    """HostPriorityList; `error` is not part of the answer (kube-scheduler's has no such field): it is logged."""

    hosts: list[HostPriority] = field(default_factory=list)
    error: str = ""
    pod: str = ""

    def to_json(self) -> list[dict[str, Any]]:
        return [h.to_json() for h in self.hosts]


@dataclass(frozen=True)
class _Args:
    request: PodRequest
    nodes: list[Any] | None  # node objects, when sent
    node_list: Mapping[str, Any]
    node_names: list[str] | None  # names, when only names were sent


def _node_name(node: Any) -> str:
    return _str(_dict(_dict(node).get("metadata")).get("name"))


def _parse_args(args: Any) -> _Args:
    if not isinstance(args, Mapping):
        raise RequestError(f"ExtenderArgs must be a JSON object, not {type(args).__name__}")
    request = parse_pod_request(_field(args, "Pod"))
    node_list = _field(args, "Nodes")
    if isinstance(node_list, Mapping):
        items = _field(node_list, "items")
        if not isinstance(items, list):
            raise RequestError("ExtenderArgs.Nodes has no items list")
        rest = {k: v for k, v in node_list.items() if k != "items"}
        return _Args(request, items, rest, None)
    names = _field(args, "NodeNames")
    if isinstance(names, list) and all(isinstance(n, str) for n in names):
        return _Args(request, None, {}, list(names))
    raise RequestError("ExtenderArgs has neither Nodes nor NodeNames")


def _names_only_error(request: PodRequest) -> str:
    return (f"pod {request.ref}: kube-scheduler sent NodeNames only; alnair-scheduler reads each node's "
            f"{NODE_GPU_DEVICES} annotation and needs the Node objects: configure the extender with "
            f"nodeCacheCapable: false")


def filter_nodes(args: Any) -> FilterResult:
    """/filter: ExtenderArgs (decoded JSON) -> ExtenderFilterResult. Never raises for bad input."""
    try:
        parsed = _parse_args(args)
    except RequestError as e:
        return FilterResult(error=str(e))
    request = parsed.request
    if parsed.nodes is None:
        assert parsed.node_names is not None
        if request.wants_gpu:
            return FilterResult(error=_names_only_error(request), pod=request.ref)
        return FilterResult(node_names=list(parsed.node_names), pod=request.ref)
    result = FilterResult(nodes=[], node_list=parsed.node_list, pod=request.ref)
    assert result.nodes is not None
    for node in parsed.nodes:
        name = _node_name(node)
        if not request.wants_gpu:
            result.nodes.append(node)
            continue
        try:
            verdict = check_fit(request, parse_node_gpus(node))
        except AnnotationError as e:
            verdict = Verdict(str(e), False)
        if verdict.fits:
            result.nodes.append(node)
        elif verdict.resolvable:
            result.failed[name] = verdict.reason
        else:
            result.unresolvable[name] = verdict.reason
    return result


def prioritize_nodes(args: Any) -> PrioritizeResult:
    """/prioritize: ExtenderArgs (decoded JSON) -> HostPriorityList. Never raises for bad input: a failure
    gives every node it can name a zero score and sets `error` for the caller to log."""
    try:
        parsed = _parse_args(args)
    except RequestError as e:
        names: list[str] = []
        if isinstance(args, Mapping):
            node_list = _field(args, "Nodes")
            items = _field(node_list, "items") if isinstance(node_list, Mapping) else None
            raw_names = _field(args, "NodeNames")
            if isinstance(items, list):
                names = [n for n in map(_node_name, items) if n]
            elif isinstance(raw_names, list):
                names = [n for n in raw_names if isinstance(n, str)]
        return PrioritizeResult([HostPriority(n, 0) for n in names], str(e))
    request = parsed.request
    names = parsed.node_names if parsed.nodes is None else [n for n in map(_node_name, parsed.nodes) if n]
    assert names is not None
    if request.scheduler_name not in PROFILES or not request.wants_gpu:
        return PrioritizeResult([HostPriority(n, NEUTRAL_SCORE) for n in names], "", request.ref)
    if parsed.nodes is None:
        return PrioritizeResult([HostPriority(n, 0) for n in names], _names_only_error(request), request.ref)
    hosts: list[HostPriority] = []
    for node in parsed.nodes:
        name = _node_name(node)
        if not name:
            continue
        try:
            value = score(request, parse_node_gpus(node))
        except AnnotationError:
            value = 0
        hosts.append(HostPriority(name, value))
    return PrioritizeResult(hosts, "", request.ref)
