"""Which of a claim's allocation results a container gets together: its GPUs, as one CDI device.

A container names a claim whole or one or more of its requests (`resources.claims: [{name, request}]`); kubelet then
hands it the CDI devices of every device of those requests (all of them for the whole claim), and the runtime applies
them in order, a later device's variable or mount over an earlier one's. A container of several GPUs needs ONE set
of variables and mounts naming all of them (`NVIDIA_VISIBLE_DEVICES`, `ALNAIR_REGIONS`, one folder per GPU), which
devices applied one after another cannot compose. So the results a container takes together form a group, served as
one CDI device (node/edits.py's `group_edits`, the device plugin's own definition), listed once among the group's
devices in the answer to kubelet.

Groups follow what the containers name, read from the pods the claim is reserved for: every distinct set of the
claim's Alnair requests that some container names (the whole claim: all of them) is one group, and a request nobody
names is a group alone. Two containers naming overlapping but different sets cannot both be served (kubelet would
give the smaller set's container a device of the larger one, or the other way round): the claim is refused, naming
them. A claim of one Alnair request (`count: N`, or several results of one request) is one group whatever the
containers name, so it needs no pod. Within a group, the GPUs are in GPU index (PCI bus) order and distinct: two
results on one GPU cannot be two GPUs of one container (the claim should say `distinctAttribute`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from alnair_agent.constants import DRA_ATTR_UUID, DRA_DRIVER
from alnair_agent.dra.claims import ClaimRef, ClaimResult, PrepareError
from alnair_agent.kube.pods import PodInfo
from alnair_agent.node.fit import MAX_GPUS_PER_CONTAINER


def main_request(request: str) -> str:
    """The request a result answers as containers name it: "<request>/<subrequest>" (firstAvailable) -> "<request>"."""
    return request.split("/", 1)[0]


@dataclass(frozen=True)
class View:
    """What one container of a pod names of the claim: a set of its Alnair requests."""

    who: str  # "<pod>/<container>", for messages
    requests: frozenset[str]


@dataclass(frozen=True)
class Group:
    """Results one container takes together, in GPU index order; `key` names them (their requests, comma-joined)."""

    key: str
    results: tuple[ClaimResult, ...]


def requests_of(results: Iterable[ClaimResult]) -> list[str]:
    """The claim's Alnair requests (as containers name them), in the order of their first result."""
    return list(dict.fromkeys(main_request(r.share.request) for r in results))


def views(claim_name: str, pods: Iterable[PodInfo], requests: Sequence[str]) -> list[View]:
    """What each container of `pods` names of claim `claim_name`, as sets of `requests` (the whole claim: all)."""
    out = []
    for pod in pods:
        named: dict[str, set[str]] = {}
        for name, request, container in pod.claim_users:
            if name == claim_name:
                named.setdefault(container, set()).update(requests if not request else [request])
        for container, names in named.items():
            mine = frozenset(names) & frozenset(requests)  # another driver's requests are its own plugin's
            if mine:
                out.append(View(f"{pod.name}/{container}", mine))
    return out


def _describe(requests: Iterable[str]) -> str:
    return ", ".join(repr(r) for r in sorted(requests))


def group(ref: ClaimRef, results: Sequence[ClaimResult], named: Sequence[View]) -> list[Group]:
    """The claim's results grouped by what its containers take together (see the module doc); PrepareError for
    views that overlap, a group with two results on one GPU, or more GPUs than one container can have."""
    requests = requests_of(results)
    sets: list[frozenset[str]] = []
    if len(requests) > 1:
        by_set: dict[frozenset[str], View] = {}
        for v in named:
            for other, first in by_set.items():
                if other != v.requests and other & v.requests:
                    raise PrepareError(
                        f"{ref.describe()}: container {first.who} takes requests {_describe(other)} of it together "
                        f"and container {v.who} takes {_describe(v.requests)}: the runtime cannot give each exactly "
                        f"its own GPUs from one claim ({DRA_DRIVER} serves sets of requests that are the same or "
                        "apart); name the same requests in both, or use two claims")
            by_set.setdefault(v.requests, v)
        sets = list(by_set)
    taken = {r for s in sets for r in s}
    sets += [frozenset([r]) for r in requests if r not in taken]
    if len(requests) == 1:
        sets = [frozenset(requests)]
    out = []
    for s in sets:
        members = sorted((r for r in results if main_request(r.share.request) in s),
                         key=lambda r: (r.gpu.info.index, r.share.request, r.share.share_id))
        key = ",".join(sorted(s))
        for a, b in zip(members, members[1:], strict=False):
            if a.gpu.uuid == b.gpu.uuid:
                raise PrepareError(
                    f"{ref.describe()}: results of request(s) {_describe(s)} name device {b.share.device} twice, but "
                    f"a container's GPUs must be distinct GPUs; add to the claim's spec.devices.constraints "
                    f"{{requests: [{', '.join(sorted(s))}], distinctAttribute: {DRA_DRIVER}/{DRA_ATTR_UUID}}}")
        if len(members) > MAX_GPUS_PER_CONTAINER:
            raise PrepareError(f"{ref.describe()}: request(s) {_describe(s)} give one container {len(members)} GPUs; "
                               f"at most {MAX_GPUS_PER_CONTAINER} are supported")
        out.append(Group(key, tuple(members)))
    return out


__all__ = ["Group", "View", "group", "main_request", "requests_of", "views"]
