"""What the agent needs to know of a pod, parsed and validated from the Kubernetes JSON of the pod.

One path only: pods arrive as plain dicts in Kubernetes' JSON shape (camelCase keys), as the API server sends
them; the pod watch never builds kubernetes-asyncio models (cheaper, and the tests' stand-in speaks the same JSON).

A malformed Alnair quantity on a container is the pod author's mistake, not the agent's: that container is left
out of what the agent serves, and the problem is kept on the PodInfo (`invalid`) so the caller logs it once per
pod (`log_invalid`) rather than on every watch event.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import structlog

from alnair_agent.constants import (
    COMPUTE_POLICY_ANNOTATION,
    RESOURCE_COMPUTE,
    RESOURCE_COUNT,
    RESOURCE_MEMORY,
    RESOURCE_MEMORY_PERCENT,
    RESOURCES,
    USAGE_ANNOTATION,
)
from alnair_agent.node.decision import (
    ALLOCATED_ANNOTATION,
    PLACEMENT_ANNOTATION,
    Decision,
    DecisionError,
    parse_decision,
)
from alnair_agent.node.fit import KIND_INIT, KIND_REGULAR, KIND_SIDECAR, MAX_GPUS_PER_CONTAINER, Need

log = structlog.get_logger(__name__)

PHASE_PENDING = "Pending"
PHASE_RUNNING = "Running"
PHASE_SUCCEEDED = "Succeeded"
PHASE_FAILED = "Failed"
TERMINAL_PHASES = frozenset({PHASE_SUCCEEDED, PHASE_FAILED})

EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)

# Extended resources are whole numbers; the API server writes them as canonical decimal strings. Anything with a
# fraction, sign, exponent or suffix ("1.5", "-2", "1e3", "2Gi", "1k") is refused rather than guessed at.
_QUANTITY_RE = re.compile(r"[0-9]{1,12}")


class PodError(ValueError):
    """The pod object lacks what identifies it (uid, namespace, name): it cannot be tracked at all."""


@dataclass(frozen=True)
class InvalidQuantity:
    """A container's Alnair quantity that is not a non-negative integer (or does not go with its others, `why`);
    the container is left out."""

    container: str
    resource: str
    value: str
    why: str = "is not a non-negative integer"

    def describe(self) -> str:
        return f"container {self.container!r}: {self.resource} = {json.dumps(self.value)} {self.why}"


@dataclass(frozen=True)
class ContainerRequest:
    """One container's request for Alnair resources (units of memory and compute, from one GPU)."""

    pod_uid: str
    namespace: str
    pod_name: str
    container: str
    memory_units: int  # all its GPUs together (what kubelet allocates): `gpus` x the slice of each
    compute_units: int
    scheduled_at: datetime = EPOCH  # of its pod; orders ties when matching kubelet's Allocate to a container
    index: int = 0  # position in the pod: init containers first (kubelet admits them first), then containers
    init: bool = False
    kind: str = KIND_REGULAR  # fit.KIND_INIT (run-once init), KIND_SIDECAR or KIND_REGULAR
    gpus: int = 1  # alnair/vgpu-count: GPUs its units are spread over evenly
    memory_percent: int = 0  # alnair/vgpu-memory-percent: memory as a share of each GPU (memory_units is then 0)

    def units(self, resource: str) -> int:
        """Units requested of `resource` (one of constants.RESOURCES); 0 for anything else."""
        if resource == RESOURCE_MEMORY:
            return self.memory_units
        if resource == RESOURCE_COMPUTE:
            return self.compute_units
        return 0

    @property
    def key(self) -> tuple[str, str]:
        """(pod_uid, container): the identity the device plugin records as taken."""
        return (self.pod_uid, self.container)

    def sort_key(self) -> tuple[datetime, str, str, int]:
        return (self.scheduled_at, self.namespace, self.pod_name, self.index)

    def need(self) -> Need:
        return Need(self.container, self.memory_units // self.gpus, self.compute_units // self.gpus, self.kind,
                    self.gpus, self.memory_percent)

    def memory_on(self, gpu_memory_units: int) -> int:
        """Memory units this container holds on one of its GPUs, which offers `gpu_memory_units`."""
        return self.need().memory_on(gpu_memory_units)


@dataclass(frozen=True)
class PodInfo:
    """A pod as the agent sees it."""

    uid: str
    namespace: str
    name: str
    node_name: str  # "" while unbound
    phase: str
    scheduled_at: datetime  # PodScheduled condition's time, else creationTimestamp, else the epoch
    containers: tuple[ContainerRequest, ...]  # only those asking for Alnair resources, init containers first
    ended: frozenset[str]  # names of containers that have ended for good (will not run again)
    deleting: bool  # metadata.deletionTimestamp is set
    resource_version: str = ""
    invalid: tuple[InvalidQuantity, ...] = ()
    decision: Decision | None = None  # the extender's placement (ai.centaurus.io/placement)
    decision_error: str = ""  # why the placement annotation could not be read ("" when absent or fine)
    allocated: bool = False  # the agent has recorded every Alnair container allocated (ai.centaurus.io/allocated)
    admitted: bool = False  # kubelet has reported container statuses: it admitted the pod
    scheduler_name: str = ""
    created_at: datetime = EPOCH
    # (container name, container ID without its "containerd://" style prefix) of every container, init ones too,
    # from status: the profiler maps a process's cgroup to its container by these.
    container_ids: tuple[tuple[str, str], ...] = ()
    usage: str = ""  # the pod's ai.centaurus.io/usage annotation as found (the profiler merges into it)
    compute_policy: str = ""  # its ai.centaurus.io/compute-policy annotation as found (the dispatcher validates it)
    # DRA: (ResourceClaim name, request name or "" for the whole claim, container) for every claim a container
    # (init containers too) references; the generated claims of templates by the names the pod's status gives them.
    claim_users: tuple[tuple[str, str, str], ...] = ()
    # (container name, the Linux user it declares: its securityContext.runAsUser, else the pod's) of every container
    # that declares one, init containers too; a container not named runs as its image's user (unknown here)
    run_as: tuple[tuple[str, int], ...] = ()

    def user_of(self, container: str) -> int | None:
        """The user `container` declares it runs as; None: its image's user, which the pod does not say."""
        for name, user in self.run_as:
            if name == container:
                return user
        return None

    @property
    def finished(self) -> bool:
        """The pod reached Succeeded or Failed: none of its containers runs again."""
        return self.phase in TERMINAL_PHASES

    def container_ended(self, container: str) -> bool:
        return self.finished or container in self.ended

    @property
    def live(self) -> bool:
        """Neither finished nor being deleted: its containers may still run."""
        return not self.finished and not self.deleting

    def needs(self) -> list[Need]:
        return [c.need() for c in self.containers]

    def request(self, container: str) -> ContainerRequest | None:
        for c in self.containers:
            if c.container == container:
                return c
        return None

    def claim_containers(self, claim: str, request: str) -> list[str]:
        """The containers that use `request` of ResourceClaim `claim` (naming the request, its main request for a
        "<request>/<subrequest>" result, or the whole claim), in pod order."""
        main = request.split("/", 1)[0]
        return list(dict.fromkeys(c for name, req, c in self.claim_users if name == claim and req in ("", main)))


def container_ended(pod: PodInfo | None, container: str) -> bool:
    """Whether `container` of `pod` has ended for good; a pod that is gone (None) has no live containers."""
    return pod is None or pod.container_ended(container)


def pod_gone(pod: PodInfo | None) -> bool:
    """Whether a pod no longer runs anything: deleted from the API (None here) or in a terminal phase."""
    return pod is None or pod.finished


def parse_quantity(value: Any) -> int:
    """An extended-resource quantity as a non-negative integer; ValueError for anything else."""
    if isinstance(value, bool):  # bool is an int subclass; a YAML `true` is no quantity
        raise ValueError("not an integer")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("negative")
        return value
    if isinstance(value, str) and _QUANTITY_RE.fullmatch(value):
        return int(value, 10)
    raise ValueError("not a non-negative integer")


def parse_time(value: Any) -> datetime | None:
    """An RFC 3339 timestamp from the API ("2026-11-29T19:00:00Z") as an aware datetime; None if absent/bad."""
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


def _dict(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _scheduled_at(meta: Mapping[str, Any], status: Mapping[str, Any]) -> datetime:
    for cond in _list(status.get("conditions")):
        cond = _dict(cond)
        if cond.get("type") == "PodScheduled" and cond.get("status") == "True":
            when = parse_time(cond.get("lastTransitionTime"))
            if when is not None:
                return when
    return parse_time(meta.get("creationTimestamp")) or EPOCH


def log_invalid(pod: PodInfo) -> None:
    """One warning per malformed quantity of `pod`, naming pod, container, resource and value."""
    for bad in pod.invalid:
        log.warning("pod_quantity_invalid", namespace=pod.namespace, pod=pod.name, container=bad.container,
                    resource=bad.resource, value=bad.value)


def _container_requests(
    specs: Iterable[Any], invalid: list[InvalidQuantity], *, uid: str, namespace: str, name: str,
    scheduled_at: datetime, init: bool, start: int,
) -> list[ContainerRequest]:
    out: list[ContainerRequest] = []
    for offset, spec in enumerate(specs):
        spec = _dict(spec)
        cname = spec.get("name")
        if not isinstance(cname, str) or not cname:
            continue
        resources = _dict(spec.get("resources"))
        limits, requests = _dict(resources.get("limits")), _dict(resources.get("requests"))
        units: dict[str, int] = {}
        bad = False
        for resource in RESOURCES:
            # Extended resources must have requests == limits; limits win, requests are the fallback.
            raw = limits.get(resource, requests.get(resource))
            if raw is None:
                units[resource] = 0
                continue
            try:
                units[resource] = parse_quantity(raw)
            except ValueError:
                invalid.append(InvalidQuantity(cname, resource, str(raw)))
                bad = True
        percent = _memory_percent(cname, limits, requests, units, invalid)
        count = _gpu_count(cname, limits.get(RESOURCE_COUNT, requests.get(RESOURCE_COUNT)), units, invalid)
        if bad or count is None or percent is None or not any(units.values()):
            continue
        out.append(ContainerRequest(
            pod_uid=uid, namespace=namespace, pod_name=name, container=cname,
            memory_units=units[RESOURCE_MEMORY], compute_units=units[RESOURCE_COMPUTE],
            scheduled_at=scheduled_at, index=start + offset, init=init,
            kind=(KIND_SIDECAR if spec.get("restartPolicy") == "Always" else KIND_INIT) if init else KIND_REGULAR,
            gpus=count, memory_percent=percent,
        ))
    return out


def _memory_percent(cname: str, limits: Mapping[str, Any], requests: Mapping[str, Any], units: Mapping[str, int],
                    invalid: list[InvalidQuantity]) -> int | None:
    """A container's alnair/vgpu-memory-percent (0 when absent); None, with the reason in `invalid`, when it is not
    a whole number 1..100, comes with alnair/vgpu-memory, or without alnair/vgpu-compute."""
    raw = limits.get(RESOURCE_MEMORY_PERCENT, requests.get(RESOURCE_MEMORY_PERCENT))
    if raw is None:
        return 0
    try:
        percent = parse_quantity(raw)
    except ValueError:
        invalid.append(InvalidQuantity(cname, RESOURCE_MEMORY_PERCENT, str(raw), "is not a whole number of percent "
                                       "in 1..100"))
        return None
    if not 1 <= percent <= 100:
        invalid.append(InvalidQuantity(cname, RESOURCE_MEMORY_PERCENT, str(raw), "is not a whole number of percent "
                                       "in 1..100"))
        return None
    if RESOURCE_MEMORY in limits or RESOURCE_MEMORY in requests:
        invalid.append(InvalidQuantity(cname, RESOURCE_MEMORY_PERCENT, str(raw), f"comes with {RESOURCE_MEMORY}: "
                                       "ask for memory in units or as a percent of the GPU, not both"))
        return None
    if not units.get(RESOURCE_COMPUTE):
        invalid.append(InvalidQuantity(cname, RESOURCE_MEMORY_PERCENT, str(raw), f"needs {RESOURCE_COMPUTE} on "
                                       "the same container (at least 1 per GPU): kubelet calls the agent only for "
                                       "the device plugin resources a container asks for, and this is not one"))
        return None
    return percent


def _gpu_count(cname: str, raw: Any, units: Mapping[str, int], invalid: list[InvalidQuantity]) -> int | None:
    """A container's alnair/vgpu-count (1 when absent); None, with the reason in `invalid`, when it is not a whole
    number 1..MAX_GPUS_PER_CONTAINER or does not divide its memory and compute evenly."""
    if raw is None:
        return 1
    try:
        count = parse_quantity(raw)
    except ValueError:
        invalid.append(InvalidQuantity(cname, RESOURCE_COUNT, str(raw)))
        return None
    if not 1 <= count <= MAX_GPUS_PER_CONTAINER:
        invalid.append(InvalidQuantity(cname, RESOURCE_COUNT, str(raw), f"is not a GPU count in "
                                                                        f"1..{MAX_GPUS_PER_CONTAINER}"))
        return None
    if not any(units.values()):
        invalid.append(InvalidQuantity(cname, RESOURCE_COUNT, str(raw), f"asks for GPUs but the container asks for "
                                       f"no {RESOURCE_MEMORY} or {RESOURCE_COMPUTE} to put on them"))
        return None
    for resource in RESOURCES:
        if units.get(resource, 0) % count:
            invalid.append(InvalidQuantity(cname, resource, str(units[resource]), f"is not a multiple of "
                                           f"{RESOURCE_COUNT} = {count} (it is the container's total, split evenly "
                                           "over its GPUs)"))
            return None
    return count


def _ended_containers(spec: Mapping[str, Any], status: Mapping[str, Any], deleting: bool) -> frozenset[str]:
    """Containers that have terminated and will not be restarted in this pod.

    A terminated container under restartPolicy Always (or OnFailure after a failure) is started again by kubelet
    with the same devices and mounts, so it has not ended; neither has a restartable init container (sidecar).
    A run-once init container that exited 0 has ended. A pod being deleted restarts nothing.
    """
    pod_policy = spec.get("restartPolicy") or "Always"
    init_specs = {_dict(c).get("name"): _dict(c) for c in _list(spec.get("initContainers"))}
    ended: set[str] = set()
    for key, is_init in (("initContainerStatuses", True), ("containerStatuses", False)):
        for st in _list(status.get(key)):
            st = _dict(st)
            cname = st.get("name")
            terminated = _dict(_dict(st.get("state")).get("terminated"))
            if not isinstance(cname, str) or not terminated:
                continue
            exit_code = terminated.get("exitCode")
            if is_init:
                sidecar = init_specs.get(cname, {}).get("restartPolicy") == "Always"
                if deleting or (not sidecar and exit_code == 0) or (not sidecar and pod_policy == "Never"):
                    ended.add(cname)
            elif deleting or pod_policy == "Never" or (pod_policy == "OnFailure" and exit_code == 0):
                ended.add(cname)
    return frozenset(ended)


def _container_ids(status: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    out = []
    for key in ("initContainerStatuses", "containerStatuses", "ephemeralContainerStatuses"):
        for st in _list(status.get(key)):
            st = _dict(st)
            cname, cid = st.get("name"), st.get("containerID")
            if isinstance(cname, str) and isinstance(cid, str) and cid:
                out.append((cname, cid.split("://", 1)[-1]))
    return tuple(out)


def _claim_users(spec: Mapping[str, Any], status: Mapping[str, Any]) -> tuple[tuple[str, str, str], ...]:
    """Which containers use which ResourceClaim (and request): containers name the pod's claim entries, which name a
    claim directly or a template whose claim's name only the pod's status knows (absent until it is created)."""
    generated = {_dict(st).get("name"): _dict(st).get("resourceClaimName") for st in
                 _list(status.get("resourceClaimStatuses"))}
    claim_of: dict[str, str] = {}
    for entry in _list(spec.get("resourceClaims")):
        entry = _dict(entry)
        name, direct = entry.get("name"), entry.get("resourceClaimName")
        actual = direct if isinstance(direct, str) and direct else generated.get(name)
        if isinstance(name, str) and isinstance(actual, str) and actual:
            claim_of[name] = actual
    out: list[tuple[str, str, str]] = []
    for key in ("initContainers", "containers"):
        for c in _list(spec.get(key)):
            c = _dict(c)
            cname = c.get("name")
            for ref in _list(_dict(c.get("resources")).get("claims")):
                ref = _dict(ref)
                actual = claim_of.get(ref.get("name"))  # type: ignore[arg-type]
                request = ref.get("request") or ""
                if isinstance(cname, str) and actual and isinstance(request, str):
                    out.append((actual, request, cname))
    return tuple(out)


def _user(context: Any) -> int | None:
    """securityContext.runAsUser when it is a user ID (the API server allows 0 to 2^31 - 1), else None."""
    user = _dict(context).get("runAsUser")
    return user if isinstance(user, int) and not isinstance(user, bool) and 0 <= user < 2**31 else None


def _run_as(spec: Mapping[str, Any]) -> tuple[tuple[str, int], ...]:
    """Each container's declared user: its own securityContext.runAsUser, else the pod's (Kubernetes' own rule)."""
    default = _user(spec.get("securityContext"))
    out: list[tuple[str, int]] = []
    for key in ("initContainers", "containers"):
        for c in _list(spec.get(key)):
            c = _dict(c)
            name, own = c.get("name"), _user(c.get("securityContext"))
            user = own if own is not None else default
            if isinstance(name, str) and name and user is not None:
                out.append((name, user))
    return tuple(out)


def parse_pod(obj: Mapping[str, Any]) -> PodInfo:
    """Build a PodInfo from a pod's JSON dict; PodError when uid, namespace or name is missing."""
    meta, spec, status = _dict(obj.get("metadata")), _dict(obj.get("spec")), _dict(obj.get("status"))
    uid, namespace, name = meta.get("uid"), meta.get("namespace"), meta.get("name")
    if not all(isinstance(v, str) and v for v in (uid, namespace, name)):
        raise PodError(f"pod without uid/namespace/name: {dict(meta)!r:.200}")
    assert isinstance(uid, str) and isinstance(namespace, str) and isinstance(name, str)
    scheduled_at = _scheduled_at(meta, status)
    deleting = bool(meta.get("deletionTimestamp"))
    init_specs = _list(spec.get("initContainers"))
    common: dict[str, Any] = dict(uid=uid, namespace=namespace, name=name, scheduled_at=scheduled_at)
    invalid: list[InvalidQuantity] = []
    containers = _container_requests(init_specs, invalid, init=True, start=0, **common) + _container_requests(
        _list(spec.get("containers")), invalid, init=False, start=len(init_specs), **common)
    if any(c.kind == KIND_INIT for c in containers):
        # kubelet hands a run-once init container's devices on to the next containers of the pod; memory asked as
        # a percent holds no devices, so the agent could not tell whose it is
        for c in [c for c in containers if c.memory_percent]:
            invalid.append(InvalidQuantity(c.container, RESOURCE_MEMORY_PERCENT, str(c.memory_percent),
                                           "cannot be used in a pod whose init containers ask for Alnair resources "
                                           f"(kubelet hands their devices on); ask for {RESOURCE_MEMORY} instead"))
        containers = [c for c in containers if not c.memory_percent]
    phase = status.get("phase")
    node = spec.get("nodeName")
    rv = meta.get("resourceVersion")
    annotations = _dict(meta.get("annotations"))
    decision: Decision | None = None
    decision_error = ""
    if PLACEMENT_ANNOTATION in annotations:
        try:
            decision = parse_decision(annotations[PLACEMENT_ANNOTATION])
        except DecisionError as e:
            decision_error = str(e)
    scheduler = spec.get("schedulerName")
    return PodInfo(
        uid=uid, namespace=namespace, name=name,
        node_name=node if isinstance(node, str) else "",
        phase=phase if isinstance(phase, str) else PHASE_PENDING,
        scheduled_at=scheduled_at,
        containers=tuple(containers),
        ended=_ended_containers(spec, status, deleting),
        deleting=deleting,
        resource_version=rv if isinstance(rv, str) else "",
        invalid=tuple(invalid),
        decision=decision,
        decision_error=decision_error,
        allocated=ALLOCATED_ANNOTATION in annotations,
        admitted=bool(_list(status.get("containerStatuses")) or _list(status.get("initContainerStatuses"))),
        scheduler_name=scheduler if isinstance(scheduler, str) else "",
        created_at=parse_time(meta.get("creationTimestamp")) or EPOCH,
        container_ids=_container_ids(status),
        usage=usage if isinstance(usage := _dict(meta.get("annotations")).get(USAGE_ANNOTATION), str) else "",
        compute_policy=cp if isinstance(cp := annotations.get(COMPUTE_POLICY_ANNOTATION), str) else "",
        claim_users=_claim_users(spec, status),
        run_as=_run_as(spec),
    )
