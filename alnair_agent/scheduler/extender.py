"""The extender's filter and prioritize verbs over the cluster view: kube-scheduler's ExtenderArgs (as decoded
JSON) in, the answer out. No I/O here.

kube-scheduler sends Go structs without JSON tags, so field names are the Go names, capitalized (`Pod`, `Nodes`,
`NodeNames`); Go's decoder matches names case-insensitively, and so does `_field` here.

The extender is node-cache-capable: kube-scheduler sends node names only (`nodeCacheCapable: true`) and the view
(`alnair_agent.scheduler.view`), kept by watches, supplies each node's GPUs. Should a kube-scheduler send whole
Node objects anyway, only their names are read.

Filter: a node passes when the shared fit rule (`alnair_agent.node.fit`) places every Alnair container of the pod
on its healthy GPUs' free units. A node that could not take the pod even with all its GPUs empty (no report, no
healthy GPU, a container larger than any GPU) goes to FailedAndUnresolvableNodes: preempting pods there would not
help. A node whose agent has stopped reporting fails (resolvably). A pod asking for no Alnair resources passes
every node.

Prioritize, by the pod's `spec.schedulerName`: `alnair-cost-saving` packs (score = round(10 × the node's Alnair
utilization once the pod runs there)), `alnair-high-performance` spreads (10 − that); any other scheduler name,
or a pod asking for no Alnair resources: every node scores 0 (no opinion). A node the pod does not fit scores 0.
"""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from itertools import chain, repeat
from typing import Any, NamedTuple, overload

from alnair_agent.kube.pods import PodError, parse_pod
from alnair_agent.node import fit
from alnair_agent.scheduler.view import ClusterView, utcnow

PROFILE_COST_SAVING = "alnair-cost-saving"
PROFILE_HIGH_PERFORMANCE = "alnair-high-performance"
PROFILES = {PROFILE_COST_SAVING: fit.PACK, PROFILE_HIGH_PERFORMANCE: fit.SPREAD}
NEUTRAL_SCORE = 0


class RequestError(ValueError):
    """The ExtenderArgs, or the pod in them, cannot be judged (the message goes into the answer's Error)."""


@dataclass(frozen=True)
class PodRequest:
    """What a pod asks of Alnair: its containers with a non-zero request, init containers first, in pod order."""

    namespace: str
    name: str
    uid: str
    scheduler_name: str
    needs: tuple[fit.Need, ...] = ()

    @property
    def wants_gpu(self) -> bool:
        return bool(self.needs)

    @property
    def policy(self) -> str:
        return PROFILES.get(self.scheduler_name, fit.PACK)

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


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
    """The pod's Alnair requests; RequestError naming pod, container, resource and value for a quantity that is
    not a non-negative integer, or for a pod without uid, namespace or name."""
    if not isinstance(pod, Mapping):
        raise RequestError("ExtenderArgs has no Pod object")
    try:
        info = parse_pod(pod)
    except PodError as e:
        raise RequestError(str(e)) from None
    if info.invalid:
        bad = info.invalid[0]
        raise RequestError(f"pod {info.namespace}/{info.name}: {bad.describe()}")
    return PodRequest(info.namespace, info.name, info.uid, info.scheduler_name, tuple(info.needs()))


@dataclass
class FilterResult:
    """ExtenderFilterResult (node-cache-capable: NodeNames)."""

    node_names: list[str] | None = None
    failed: dict[str, str] = field(default_factory=dict)
    unresolvable: dict[str, str] = field(default_factory=dict)
    error: str = ""
    pod: str = ""  # namespace/name, for the log; not part of the answer

    def to_json(self) -> dict[str, Any]:
        return {"Nodes": None, "NodeNames": self.node_names, "FailedNodes": self.failed,
                "FailedAndUnresolvableNodes": self.unresolvable, "Error": self.error}

    def encode(self) -> bytes:
        """`json.dumps(self.to_json())`, compact, each distinct reason escaped once: thousands of nodes failing the
        same way share one reason text (and a pod too large for a cluster fails on all of them)."""
        failed, unresolvable = _reasons_json(self.failed), _reasons_json(self.unresolvable)
        if failed is None or unresolvable is None:
            return json.dumps(self.to_json(), separators=(",", ":")).encode()
        return (f'{{"Nodes":null,"NodeNames":{json.dumps(self.node_names, separators=(",", ":"))},'
                f'"FailedNodes":{failed},"FailedAndUnresolvableNodes":{unresolvable},'
                f'"Error":{json.dumps(self.error)}}}').encode()


class HostPriority(NamedTuple):
    host: str
    score: int

    def to_json(self) -> dict[str, Any]:
        return {"Host": self.host, "Score": self.score}


@dataclass(frozen=True)
class Scores(Sequence[tuple[str, int]]):
    """(host, score) pairs kept as two lists (the view's answer for thousands of nodes): no tuple per node is made
    unless asked for, so a request leaves the cyclic GC nothing new to scan, and `encode` joins the lists."""

    names: Sequence[str]
    values: list[int]

    def __len__(self) -> int:
        return len(self.values)

    @overload
    def __getitem__(self, i: int) -> tuple[str, int]: ...
    @overload
    def __getitem__(self, i: slice) -> list[tuple[str, int]]: ...
    def __getitem__(self, i: int | slice) -> tuple[str, int] | list[tuple[str, int]]:
        if isinstance(i, slice):
            return list(zip(self.names[i], self.values[i], strict=True))
        return self.names[i], self.values[i]


@dataclass
class PrioritizeResult:
    """HostPriorityList; `error` is not part of the answer (kube-scheduler's has no such field): it is logged."""

    hosts: Sequence[tuple[str, int]] = field(default_factory=list)  # (host, score): HostPriority or plain pairs
    error: str = ""
    pod: str = ""

    def to_json(self) -> list[dict[str, Any]]:
        return [{"Host": host, "Score": value} for host, value in self.hosts]

    def best(self) -> tuple[str, int] | None:
        """The first host of the highest score (for the log line)."""
        hosts = self.hosts
        if isinstance(hosts, Scores):
            values = hosts.values
            return (hosts.names[values.index(max(values))], max(values)) if values else None
        return max(hosts, key=operator.itemgetter(1), default=None)

    def encode(self) -> bytes:
        """`json.dumps(self.to_json())`, compact, without building thousands of dicts first. Node names (DNS
        subdomains) need no escaping, which one match over all of them checks; anything else goes to json.dumps."""
        hosts = self.hosts
        if isinstance(hosts, Scores):
            values = hosts.values
            if (_PLAIN_NAMES.fullmatch(",".join(hosts.names)) and all(type(v) is int for v in values)
                    and (not values or (min(values) >= 0 and max(values) <= fit.MAX_SCORE))):
                if not values:
                    return b"[]"
                # name, '","Score":k},{"Host":"', name, ...: one join, no string made per node
                body = "".join(chain.from_iterable(zip(hosts.names, map(_SCORE_JOINS.__getitem__, values),
                                                       strict=True)))
                return ('[{"Host":"' + body[:-len(_NEXT_HOST)] + "]").encode()
        if not _PLAIN_NAMES.fullmatch(",".join(host for host, _ in hosts)):
            return json.dumps(self.to_json(), separators=(",", ":")).encode()
        tail = _SCORE_TAILS
        parts = ['{"Host":"' + host + (tail[value] if type(value) is int and 0 <= value <= fit.MAX_SCORE
                                       else f',"Score":{int(value)}}}') for host, value in hosts]
        return ("[" + ",".join(parts) + "]").encode()


_PLAIN_NAMES = re.compile(r"[a-z0-9.,-]*")  # names joined by commas; a comma is no DNS subdomain's


def _reasons_json(reasons: Mapping[str, str]) -> str | None:
    """{node: reason} as compact JSON, each distinct reason escaped once; None when a node name needs escaping."""
    if not _PLAIN_NAMES.fullmatch(",".join(reasons)):
        return None
    # '"node' + '":"reason"' per node, joined by C-level maps (thousands of nodes, a few distinct reasons)
    escaped = {reason: '":' + json.dumps(reason) for reason in set(reasons.values())}
    return "{" + ",".join(map(str.__add__, map('"'.__add__, reasons), map(escaped.__getitem__,
                                                                         reasons.values()))) + "}"
_SCORE_TAILS = [f'","Score":{k}}}' for k in range(fit.MAX_SCORE + 1)]
_NEXT_HOST = ',{"Host":"'
_SCORE_JOINS = [tail + _NEXT_HOST for tail in _SCORE_TAILS]


def _node_names(args: Mapping[str, Any]) -> list[str]:
    names = _field(args, "NodeNames")
    if isinstance(names, list):
        if not all(map(isinstance, names, repeat(str))):  # (a C-level pass: thousands of names per request)
            raise RequestError("ExtenderArgs.NodeNames must be a list of strings")
        return names
    node_list = _field(args, "Nodes")
    if isinstance(node_list, Mapping):
        items = _field(node_list, "items")
        if isinstance(items, list):
            return [n for n in (_name(item) for item in items) if n]
    raise RequestError("ExtenderArgs has neither NodeNames nor Nodes")


def _name(node: Any) -> str:
    meta = node.get("metadata") if isinstance(node, Mapping) else None
    name = meta.get("name") if isinstance(meta, Mapping) else None
    return name if isinstance(name, str) else ""


def _parse_args(args: Any) -> tuple[PodRequest, list[str]]:
    if not isinstance(args, Mapping):
        raise RequestError(f"ExtenderArgs must be a JSON object, not {type(args).__name__}")
    return parse_pod_request(_field(args, "Pod")), _node_names(args)


def filter_nodes(args: Any, view: ClusterView, now: datetime | None = None) -> FilterResult:
    """/filter: ExtenderArgs (decoded JSON) -> ExtenderFilterResult. Never raises for bad input."""
    try:
        request, names = _parse_args(args)
    except RequestError as e:
        return FilterResult(error=str(e))
    if not request.wants_gpu:
        return FilterResult(node_names=names, pod=request.ref)
    now_ts = (now or utcnow()).timestamp()
    passed, failed, unresolvable = view.filter(names, fit.Shape.of(request.needs), now_ts)
    return FilterResult(passed, failed, unresolvable, pod=request.ref)


def prioritize_nodes(args: Any, view: ClusterView, now: datetime | None = None) -> PrioritizeResult:
    """/prioritize: ExtenderArgs (decoded JSON) -> HostPriorityList. Never raises for bad input: a failure gives
    every node it can name a zero score and sets `error` for the caller to log."""
    try:
        request, names = _parse_args(args)
    except RequestError as e:
        fallback: list[str] = []
        if isinstance(args, Mapping):
            try:
                fallback = _node_names(args)
            except RequestError:
                fallback = []
        return PrioritizeResult([HostPriority(n, 0) for n in fallback], str(e))
    if request.scheduler_name not in PROFILES or not request.wants_gpu:
        return PrioritizeResult([HostPriority(n, NEUTRAL_SCORE) for n in names], "", request.ref)
    now_ts = (now or utcnow()).timestamp()
    scores = view.scores(names, fit.Shape.of(request.needs), request.policy, now_ts)
    return PrioritizeResult(Scores(names, scores), "", request.ref)
