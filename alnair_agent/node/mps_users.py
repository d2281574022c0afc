"""MPS serves one Linux user per GPU at a time: the one rule about who may share an MPS GPU, and its words.

The MPS control daemon starts a GPU's server as the user of its first client. A client of another user is queued
until every client of the server's user has ended, so a container of a second user starts, and its first CUDA call
waits, for as long as the first user's containers run there (an inference service beside a training job: for
good). Nothing fails, so nothing says why. The agent names it where `kubectl describe pod` shows it, at admission
(a Warning Event on the container's pod and a log line), from what the pods declare: a container's user is its
`securityContext.runAsUser`, else its pod's; one that declares none runs as its image's user, which the agent cannot
know. So two declared users that differ are a certain wait; a declared user beside an undeclared one is a possible
one, said as such; two undeclared users say nothing. The way out is to run the containers sharing an MPS GPU as
one user, or the daemon in multi-user mode where the driver has it (README, "Compute").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import structlog

from alnair_agent.node.workspace import Allocation

log = structlog.get_logger(__name__)

REASON_MPS_USER = "AlnairMpsUserMismatch"


@dataclass(frozen=True)
class Tenant:
    """A container on a GPU, and the Linux user it declares (None: its image's)."""

    pod: str  # namespace/name
    container: str
    user: int | None

    def who(self) -> str:
        return f"{self.pod} container {self.container!r}"

    def runs_as(self) -> str:
        return f"UID {self.user}" if self.user is not None else "its image's user (it declares no runAsUser)"


class PodView(Protocol):
    """What the rule reads of a pod (kube.pods.PodInfo)."""

    @property
    def namespace(self) -> str: ...

    @property
    def name(self) -> str: ...

    @property
    def live(self) -> bool: ...

    def container_ended(self, container: str) -> bool: ...

    def user_of(self, container: str) -> int | None: ...


def tenants(gpu: str, allocations: Iterable[Allocation], pod_of: Callable[[str], PodView | None],
            skip: Callable[[Allocation], bool]) -> list[Tenant]:
    """The live containers the records on `gpu` give a slice to (both front-ends' records), but those `skip` says;
    a record whose pod the watch does not show is left out (its user is not known)."""
    out: list[Tenant] = []
    for alloc in allocations:
        if alloc.gpu_uuid != gpu or not alloc.pod_uid or skip(alloc):
            continue
        pod = pod_of(alloc.pod_uid)
        if pod is None or not pod.live:
            continue
        out.extend(Tenant(f"{pod.namespace}/{pod.name}", c, pod.user_of(c))
                   for c in alloc.container.split(",") if c and not pod.container_ended(c))
    return out


def mismatch(gpu: str, me: Tenant, others: Iterable[Tenant]) -> str | None:
    """Why `me`, admitted onto MPS GPU `gpu` beside `others`, may wait for another user's containers; None when
    nothing the pods declare says so. Names the first other tenant of a certainly different user, else the first
    possibly different."""
    certain: Tenant | None = None
    possible: Tenant | None = None
    for other in others:
        if other.user == me.user:
            continue
        if me.user is not None and other.user is not None:
            certain = certain or other
        else:  # one of them declares none
            possible = possible or other
    named = certain or possible
    if named is None:
        return None
    wait = ("the CUDA start of the later user's processes waits until every process of the other user on that GPU "
            "has ended")
    why = (f"an MPS server serves one Linux user at a time, so {wait}" if certain is not None else
           f"if those are not the same user, {wait} (an MPS server serves one Linux user at a time)")
    return (f"{me.who()} runs as {me.runs_as()} on GPU {gpu}, and {named.who()} on the same GPU as "
            f"{named.runs_as()}: {why}. Run the containers that share an MPS GPU as one user "
            "(securityContext.runAsUser), or the MPS daemon in multi-user mode")


def warn(gpu: str, me: Tenant, others: Iterable[Tenant]) -> str | None:
    """`mismatch`, and when it says why, the agent's log line for it (both front-ends warn with these words)."""
    why = mismatch(gpu, me, others)
    if why is not None:
        log.warning("mps_user_mismatch", pod=me.pod, container=me.container, gpu=gpu, reason=why)
    return why
