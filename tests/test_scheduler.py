"""The scheduler extender as kube-scheduler meets it: which nodes a GPU-sharing pod fits (one GPU per container,
init containers alone, the rest packed together, unhealthy GPUs skipped), how the cost-saving and
high-performance profiles rank nodes, and the HTTP extender answering real ExtenderArgs JSON with 200 even for
garbage; then the `alnair-scheduler` process itself, started, asked and stopped with SIGTERM."""

from __future__ import annotations

import asyncio
import io
import json
import os
import random
import re
import signal
import socket
import sys
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from structlog.testing import capture_logs

from alnair_agent.constants import NODE_GPU_DEVICES, RESOURCE_COMPUTE, RESOURCE_MEMORY
from alnair_agent.node import fit as fit_rule
from alnair_agent.node.gpu_devices import AnnotationError, report_of_node
from alnair_agent.scheduler.extender import (
    PROFILE_COST_SAVING,
    PROFILE_HIGH_PERFORMANCE,
    RequestError,
    filter_nodes,
    parse_pod_request,
    prioritize_nodes,
)
from alnair_agent.scheduler.main import main
from alnair_agent.scheduler.server import build_app
from alnair_agent.scheduler.view import ClusterView
from alnair_standins.apiserver import make_pod

pytestmark = pytest.mark.timeout(30)

# -- realistic Kubernetes JSON, as kube-scheduler sends it --------------------------------------------------------

Spec = tuple[str, Any, Any]  # (container name, memory units, compute units); None leaves the resource out


def gpu(index: int, mem: int = 16, mem_free: int | None = None, comp: int = 100, comp_free: int | None = None,
        healthy: bool = True) -> dict[str, Any]:
    return {"uuid": f"GPU-{index:08d}-1111-2222-3333-444455556666", "index": index, "name": "NVIDIA A100-SXM4-40GB",
            "healthy": healthy, "memoryUnits": mem, "memoryUnitsFree": mem if mem_free is None else mem_free,
            "computeUnits": comp, "computeUnitsFree": comp if comp_free is None else comp_free}


def node(name: str, gpus: Sequence[dict[str, Any]] | None = None, annotation: str | None = None) -> dict[str, Any]:
    """A v1.Node; `gpus` become the agent's annotation (None: no annotation), `annotation` overrides its text."""
    annotations = {"node.alpha.kubernetes.io/ttl": "0",
                   "volumes.kubernetes.io/controller-managed-attach-detach": "true"}
    if annotation is not None:
        annotations[NODE_GPU_DEVICES] = annotation
    elif gpus is not None:
        annotations[NODE_GPU_DEVICES] = json.dumps({"memoryUnitMiB": 1024, "gpus": list(gpus)})
    offered = {RESOURCE_MEMORY: str(sum(g["memoryUnits"] for g in gpus or ())),
               RESOURCE_COMPUTE: str(sum(g["computeUnits"] for g in gpus or ()))}
    return {
        "kind": "Node", "apiVersion": "v1",
        "metadata": {"name": name, "uid": f"uid-{name}", "resourceVersion": "41817",
                     "creationTimestamp": "2026-11-29T08:00:00Z",
                     "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                "nvidia.com/gpu.present": "true"},
                     "annotations": annotations},
        "spec": {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24"]},
        "status": {
            "capacity": {"cpu": "64", "memory": "527988420Ki", "pods": "110", **offered},
            "allocatable": {"cpu": "64", "memory": "527886020Ki", "pods": "110", **offered},
            "conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": "2026-11-29T19:40:00Z",
                            "lastTransitionTime": "2026-11-29T08:01:00Z", "reason": "KubeletReady",
                            "message": "kubelet is posting ready status"}],
            "nodeInfo": {"kubeletVersion": "v1.31.2", "containerRuntimeVersion": "containerd://1.7.22",
                         "operatingSystem": "linux", "architecture": "amd64"},
        },
    }


def _container(spec: Spec, sidecar: bool = False, requests_only: bool = False) -> dict[str, Any]:
    name, mem, comp = spec
    quantities = {r: str(v) if isinstance(v, int) else v
                  for r, v in ((RESOURCE_MEMORY, mem), (RESOURCE_COMPUTE, comp)) if v is not None}
    resources: dict[str, Any] = {"requests": {"cpu": "1", **quantities}}
    if not requests_only:
        resources["limits"] = dict(quantities)
    out = {"name": name, "image": "nvcr.io/nvidia/pytorch:24.10-py3", "resources": resources,
           "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File",
           "imagePullPolicy": "IfNotPresent"}
    if sidecar:
        out["restartPolicy"] = "Always"
    return out


def pod(containers: Iterable[Spec] = (("train", 4, 50),), init: Iterable[Spec] = (), sidecars: Iterable[Spec] = (),
        scheduler: str = PROFILE_COST_SAVING, name: str = "trainer-0", requests_only: bool = False) -> dict[str, Any]:
    """A pending, unbound v1.Pod; sidecars are init containers with restartPolicy Always, listed first."""
    spec: dict[str, Any] = {
        "containers": [_container(c, requests_only=requests_only) for c in containers],
        "restartPolicy": "Never", "terminationGracePeriodSeconds": 30, "dnsPolicy": "ClusterFirst",
        "serviceAccountName": "default", "schedulerName": scheduler, "priority": 0, "enableServiceLinks": True,
        "preemptionPolicy": "PreemptLowerPriority",
        "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute",
                         "tolerationSeconds": 300}],
    }
    inits = [_container(c, sidecar=True) for c in sidecars] + [_container(c) for c in init]
    if inits:
        spec["initContainers"] = inits
    return {"kind": "Pod", "apiVersion": "v1",
            "metadata": {"name": name, "namespace": "ml", "uid": "0b4c6a8e-5d1f-4e0a-9b7e-3f2a1c9d8e7f",
                         "resourceVersion": "52011", "creationTimestamp": "2026-11-29T19:41:00Z",
                         "labels": {"app": "trainer"}},
            "spec": spec, "status": {"phase": "Pending", "qosClass": "Burstable"}}


def args(p: dict[str, Any], nodes: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """ExtenderArgs as a node-cache-capable extender gets it: node names only."""
    return {"Pod": p, "Nodes": None, "NodeNames": [n["metadata"]["name"] for n in nodes]}


def view_of(nodes: Sequence[dict[str, Any]]) -> ClusterView:
    """The extender's view after its node watch delivered `nodes`."""
    view = ClusterView()
    for n in nodes:
        view.apply_node(n)
    return view


def fit(p: dict[str, Any], gpus: Sequence[dict[str, Any]]) -> tuple[bool, str, bool, str]:
    """(fits, filter's reason, resolvable, the reason bind gives for this one node: with its GPUs' free units)."""
    n = node("n", gpus)
    view = view_of([n])
    result = filter_nodes(args(p, [n]), view)
    assert not result.error, result.error
    if result.node_names == ["n"]:
        return True, "", True, ""
    rooms = view.summary("n").rooms
    placed = fit_rule.place(parse_pod_request(p).needs, rooms, fit_rule.PACK) if rooms is not None else None
    one_node = placed.reason if isinstance(placed, fit_rule.NoFit) else ""
    if "n" in result.failed:
        return False, result.failed["n"], True, one_node
    return False, result.unresolvable["n"], False, one_node


# Words of a reason that list a node's GPUs: only the answer about one node has them (filter's reason is the same
# for every node failing the same way, so kube-scheduler's FailedScheduling event counts the nodes).
GPU_LISTING = re.compile(r"GPU \d|\d+/\d+ (memory|compute)")


# -- filter: does the pod fit a node's GPUs ---------------------------------------------------------------------

FIT_CASES = [
    # id, pod kwargs, node GPUs, fits, resolvable (when it does not fit), words the reason must hold
    ("exactly-the-free-units", {}, [gpu(0, mem_free=4, comp_free=50)], True, True, []),
    ("memory-short", {}, [gpu(0, mem_free=3)], False, True,
     ["'train'", "4 memory + 50 compute", "GPU 0: 3/16 memory"]),
    ("compute-short", {}, [gpu(0, comp_free=49)], False, True, ["'train'", "49/100 compute"]),
    ("memory-on-one-gpu-compute-on-another", {}, [gpu(0, comp_free=10), gpu(1, mem_free=1)], False, True,
     ["GPU 0", "GPU 1"]),
    ("second-gpu-has-room", {}, [gpu(0, mem_free=0), gpu(1)], True, True, []),
    ("room-only-on-an-unhealthy-gpu", {}, [gpu(0, mem_free=0), gpu(1, healthy=False)], False, True,
     ["GPU 0: 0/16"]),
    ("all-gpus-unhealthy", {}, [gpu(0, healthy=False), gpu(1, healthy=False)], False, False,
     ["no healthy GPU", "2 unhealthy"]),
    ("no-gpus-at-all", {}, [], False, False, ["no healthy GPU"]),
    ("larger-than-any-gpu", {"containers": [("train", 24, 50)]}, [gpu(0), gpu(1)], False, False, ["'train'"]),
    ("compute-only-container", {"containers": [("infer", None, 30)]}, [gpu(0, mem_free=0, comp_free=30)],
     True, True, []),
    ("memory-only-container", {"containers": [("infer", 16, None)]}, [gpu(0, comp_free=0)], True, True, []),
    ("no-alnair-request", {"containers": [("web", None, None)]}, [gpu(0, mem_free=0, comp_free=0)], True, True, []),
    ("zero-quantities-ask-nothing", {"containers": [("web", 0, "0")]}, [], True, True, []),
    # init containers run alone, before the others: their units are free again afterwards
    ("init-fits-alone", {"init": [("setup", 16, 100)], "containers": [("a", 8, 50), ("b", 8, 50)]},
     [gpu(0), gpu(1)], True, True, []),
    # kubelet hands an init container's devices to the next containers: such a pod goes on one GPU
    ("init-makes-the-pod-one-gpu", {"init": [("setup", 16, 100)], "containers": [("a", 16, 100), ("b", 16, 100)]},
     [gpu(0), gpu(1)], False, False, ["init containers", "one GPU", "setup, a, b"]),
    ("init-too-big", {"init": [("setup", 12, 10)], "containers": [("a", 1, 10)]}, [gpu(0, mem_free=8)], False,
     True, ["init containers", "setup", "GPU 0: 8/16 memory"]),
    ("each-init-alone", {"init": [("i1", 16, 100), ("i2", 16, 100)], "containers": [("a", 1, 1)]}, [gpu(0)],
     True, True, []),
    # sidecars (restartPolicy Always) keep running beside everything after them
    ("sidecar-counts-with-containers", {"sidecars": [("proxy", 8, 10)], "containers": [("a", 16, 10), ("b", 16, 10)]},
     [gpu(0), gpu(1)], False, False, ["'proxy'", "'a'", "'b'", "do not fit the GPUs together"]),
    ("sidecar-counts-with-later-init", {"sidecars": [("proxy", 8, 10)], "init": [("setup", 12, 10)],
                                        "containers": [("a", 1, 1)]},
     [gpu(0, mem_free=16)], False, False, ["proxy, setup", "one GPU"]),
    # regular containers run together: first-fit-decreasing into the GPUs
    ("two-containers-one-gpu", {"containers": [("a", 8, 50), ("b", 8, 50)]}, [gpu(0)], True, True, []),
    ("two-containers-two-gpus", {"containers": [("a", 10, 60), ("b", 10, 60)]}, [gpu(0), gpu(1)], True, True, []),
    ("largest-first-packs-what-pod-order-would-not", {"containers": [("a", 2, 1), ("b", 2, 1), ("c", 4, 1),
                                                                     ("d", 4, 1)]},
     [gpu(0, mem=6), gpu(1, mem=6)], True, True, []),
    ("together-too-big", {"containers": [("a", 10, 60), ("b", 10, 60)]}, [gpu(0)], False, False,
     ["containers 'a', 'b' do not fit the GPUs together", "no room left for container"]),
    ("together-too-big-for-now", {"containers": [("a", 10, 60), ("b", 10, 60)]}, [gpu(0), gpu(1, mem_free=9)],
     False, True, ["do not fit the GPUs together"]),
]


@pytest.mark.parametrize("kwargs, gpus, fits, resolvable, words",
                         [c[1:] for c in FIT_CASES], ids=[c[0] for c in FIT_CASES])
def test_fit(kwargs: dict[str, Any], gpus: list[dict[str, Any]], fits: bool, resolvable: bool,
             words: list[str]) -> None:
    got_fits, reason, got_resolvable, one_node = fit(pod(**kwargs), gpus)
    assert got_fits == fits, reason
    assert got_resolvable == resolvable, reason
    assert (reason == "") == fits
    assert not GPU_LISTING.search(reason), reason
    for word in words:
        assert word in (one_node if GPU_LISTING.search(word) else reason), (reason, one_node)
    if reason and one_node:
        assert one_node.startswith(reason + "; GPU 0: ")


def test_nodes_failing_the_same_way_give_the_same_reason() -> None:
    """Different free units, same shortfall: one text, so kube-scheduler's event reads "3 no healthy GPU has room
    for ..." instead of listing each node."""
    nodes = [node("a", [gpu(0, mem_free=3)]), node("b", [gpu(0, mem_free=1, comp_free=10), gpu(1, comp_free=20)]),
             node("c", [gpu(0, mem_free=0), gpu(1, mem_free=2), gpu(2, comp_free=0)])]
    result = filter_nodes(args(pod(), nodes), view_of(nodes))
    assert result.node_names == [] and sorted(result.failed) == ["a", "b", "c"]
    assert set(result.failed.values()) == {"no healthy GPU has room for container 'train' (4 memory + 50 compute "
                                           "units on one GPU)"}


def test_requests_are_the_fallback_for_limits() -> None:
    request = parse_pod_request(pod(containers=[("a", 4, 20)], requests_only=True))
    assert [(c.name, c.memory, c.compute) for c in request.needs] == [("a", 4, 20)]
    both = pod(containers=[("a", 4, 20)])
    both["spec"]["containers"][0]["resources"]["requests"][RESOURCE_MEMORY] = "1"  # limits win
    assert parse_pod_request(both).needs[0].memory == 4


@pytest.mark.parametrize("resource, value", [(RESOURCE_MEMORY, "1.5"), (RESOURCE_MEMORY, "2Gi"),
                                             (RESOURCE_COMPUTE, "-10"), (RESOURCE_COMPUTE, "50%")])
def test_malformed_quantity_names_pod_container_resource_value(resource: str, value: str) -> None:
    p = pod(containers=[("ok", 1, 1), ("train", 4, 50)])
    p["spec"]["containers"][1]["resources"]["limits"][resource] = value
    with pytest.raises(RequestError) as e:
        parse_pod_request(p)
    for word in ("ml/trainer-0", "'train'", resource, value):
        assert word in str(e.value)
    nodes = [node("gpu-1", [gpu(0)])]
    result = filter_nodes(args(p, nodes), view_of(nodes)).to_json()
    assert value in result["Error"] and result["NodeNames"] is None and result["FailedNodes"] == {}


@pytest.mark.parametrize("annotation, words", [
    (None, ["no ai.centaurus.io/gpu-devices annotation"]),
    ("{not json", ["unreadable"]),
    ("[]", ["unreadable", "gpus"]),
    (json.dumps({"gpus": {}}), ["unreadable", "gpus"]),
    (json.dumps({"gpus": [{"index": 0}]}), ["gpus[0]", "memoryUnits"]),
    (json.dumps({"gpus": [gpu(0) | {"memoryUnitsFree": -1}]}), ["memoryUnitsFree = -1"]),
    (json.dumps({"gpus": [gpu(0) | {"computeUnitsFree": "70"}]}), ["computeUnitsFree = \"70\""]),
    (json.dumps({"gpus": [gpu(0, mem=16, mem_free=17)]}), ["more units free than offered"]),
    (json.dumps({"gpus": [gpu(0) | {"healthy": "yes"}]}), ["healthy a boolean"]),
    (json.dumps({"memoryUnitMiB": 0, "gpus": []}), ["memoryUnitMiB = 0"]),
])
def test_missing_or_unreadable_annotation(annotation: str | None, words: list[str]) -> None:
    n = node("gpu-1", None if annotation is None else [], annotation=annotation)
    with pytest.raises(AnnotationError) as e:
        report_of_node(n)
    for word in words:
        assert word in str(e.value)


def test_annotation_gpus_come_in_index_order_with_defaults() -> None:
    text = json.dumps({"memoryUnitMiB": 512, "gpus": [
        gpu(2, mem_free=3), {"memoryUnits": 8, "memoryUnitsFree": 8, "computeUnits": 100, "computeUnitsFree": 5}]})
    parsed = report_of_node(node("n", annotation=text))
    assert parsed.memory_unit_mib == 512
    assert [(g.index, g.healthy, g.memory_free, g.compute_free) for g in parsed.gpus] == [(1, True, 8, 5),
                                                                                         (2, True, 3, 100)]


def test_filter_sorts_nodes_into_passed_failed_and_unresolvable() -> None:
    nodes = [node("free", [gpu(0)]), node("busy", [gpu(0, mem_free=1)]), node("plain"),
             node("broken", annotation="{"), node("sick", [gpu(0, healthy=False)])]
    result = filter_nodes(args(pod(), nodes + [node("unknown")]), view_of(nodes)).to_json()
    assert result["NodeNames"] == ["free"]
    assert sorted(result["FailedNodes"]) == ["busy", "unknown"]  # not in the node watch yet: maybe later
    assert "unknown to alnair-scheduler" in result["FailedNodes"]["unknown"]
    assert sorted(result["FailedAndUnresolvableNodes"]) == ["broken", "plain", "sick"]
    assert "no ai.centaurus.io/gpu-devices annotation" in result["FailedAndUnresolvableNodes"]["plain"]
    assert result["Error"] == "" and result["Nodes"] is None


def test_a_pod_without_alnair_requests_passes_every_node() -> None:
    nodes = [node("plain"), node("broken", annotation="{"), node("full", [gpu(0, mem_free=0, comp_free=0)])]
    result = filter_nodes(args(pod(containers=[("web", None, None)]), nodes), view_of(nodes)).to_json()
    assert result["NodeNames"] == ["plain", "broken", "full"]
    assert result["FailedNodes"] == {} and result["FailedAndUnresolvableNodes"] == {}


# -- prioritize: pack or spread ---------------------------------------------------------------------------------

# One 16-unit GPU per node; the pod asks 2 memory + 10 compute. Utilization after placing it, memory and compute
# averaged: idle (2/16+10/100)/2 = 0.11 -> 1; half (10/16+60/100)/2 = 0.61 -> 6; busy (14/16+90/100)/2 = 0.89 -> 9;
# round-half-up (5/10+60/100)/2 = 0.55 -> 6. High performance scores 10 minus cost saving's score.
SCORE_NODES = {
    "idle": [gpu(0)],
    "half": [gpu(0, mem_free=8, comp_free=50)],
    "busy": [gpu(0, mem_free=4, comp_free=20)],
    "two-gpus": [gpu(0, mem_free=0, comp_free=0), gpu(1)],  # (18/32 + 110/200)/2 = 0.556 -> 6
    "unhealthy-ignored": [gpu(0, mem_free=8, comp_free=50), gpu(1, mem_free=0, comp_free=0, healthy=False)],
    "round-half-up": [gpu(0, mem=10, mem_free=7, comp_free=50)],
    "full": [gpu(0, mem_free=1)],  # the pod does not fit: 0 whatever the profile
}
SCORES = [
    (PROFILE_COST_SAVING, {"idle": 1, "half": 6, "busy": 9, "two-gpus": 6, "unhealthy-ignored": 6,
                           "round-half-up": 6, "full": 0}),
    (PROFILE_HIGH_PERFORMANCE, {"idle": 9, "half": 4, "busy": 1, "two-gpus": 4, "unhealthy-ignored": 4,
                                "round-half-up": 4, "full": 0}),
    ("default-scheduler", {name: 0 for name in SCORE_NODES}),
    ("", {name: 0 for name in SCORE_NODES}),
]


@pytest.mark.parametrize("profile, expected", SCORES, ids=[s[0] or "no-name" for s in SCORES])
def test_scores_by_profile(profile: str, expected: dict[str, int]) -> None:
    nodes = [node(name, gpus) for name, gpus in SCORE_NODES.items()]
    result = prioritize_nodes(args(pod(containers=[("train", 2, 10)], scheduler=profile), nodes), view_of(nodes))
    assert dict(result.hosts) == expected  # (host, score) pairs


def test_cost_saving_packs_and_high_performance_spreads() -> None:
    nodes = [node(name, gpus) for name, gpus in SCORE_NODES.items() if name in ("idle", "half", "busy")]

    def ranking(profile: str) -> list[str]:
        hosts = prioritize_nodes(args(pod(containers=[("train", 2, 10)], scheduler=profile), nodes),
                                 view_of(nodes)).hosts
        return [host for host, _ in sorted(hosts, key=lambda h: -h[1])]

    assert ranking(PROFILE_COST_SAVING) == ["busy", "half", "idle"]
    assert ranking(PROFILE_HIGH_PERFORMANCE) == ["idle", "half", "busy"]


def test_only_running_containers_count_towards_utilization() -> None:
    # The init container's 12 units are free again once it ends; the sidecar's 4 stay with the pod.
    nodes = [node("n", [gpu(0)])]
    p = pod(containers=[("a", 2, 10)], init=[("setup", 12, 90)], sidecars=[("proxy", 4, 10)])
    [(_, score)] = prioritize_nodes(args(p, nodes), view_of(nodes)).hosts
    assert score == 3  # (6/16 + 20/100)/2 = 0.29 -> 3


def test_scores_are_zero_for_nodes_without_the_annotation() -> None:
    nodes = [node("plain"), node("broken", annotation="nope"), node("ok", [gpu(0)])]
    result = prioritize_nodes(args(pod(scheduler=PROFILE_HIGH_PERFORMANCE), nodes), view_of(nodes))
    assert result.to_json() == [{"Host": "plain", "Score": 0}, {"Host": "broken", "Score": 0},
                                {"Host": "ok", "Score": 6}]  # (4/16 + 50/100)/2 = 0.375 -> 4; 10 - 4 = 6


def random_pod(rng: random.Random, profile: str) -> dict[str, Any]:
    """One to three containers (some over several GPUs), now and then a sidecar or a run-once init container."""
    containers = []
    for k in range(rng.choice((1, 1, 1, 2, 3))):
        count = rng.choice((1, 1, 2, 4))
        containers.append({"name": f"c{k}", "memory": rng.randint(0, 12) * count,
                           "compute": rng.choice((0, 10, 30, 50)) * count, "gpus": count})
        if not (containers[-1]["memory"] or containers[-1]["compute"]):
            containers[-1]["compute"] = 5 * count
        if rng.random() < 0.25:  # memory as a share of each GPU instead (it needs compute beside it)
            del containers[-1]["memory"]
            containers[-1]["memory_percent"] = rng.choice((1, 10, 25, 50, 100))
            containers[-1]["compute"] = containers[-1]["compute"] or 5 * count
    inits = []
    if rng.random() < 0.2:
        inits.append({"name": "side", "memory": rng.randint(1, 4), "compute": 5, "restartPolicy": "Always"})
    if rng.random() < 0.1:
        inits.append({"name": "setup", "memory": rng.randint(1, 16), "compute": 10})
        containers = [{"name": c["name"], "gpus": 1, "memory": c.get("memory", 1) // c["gpus"],
                       "compute": c["compute"] // c["gpus"]} for c in containers]
    p = make_pod("p", node=None, containers=containers, init_containers=inits)
    p["spec"]["schedulerName"] = profile
    return p


@pytest.mark.parametrize("seed", range(60))
def test_filter_and_prioritize_give_what_the_fit_rule_gives(seed: int) -> None:
    """Filter and prioritize judge thousands of nodes per request by counting where they can; on any node and pod
    they answer what `fit.place` and `fit.score_added` answer on that node's free units."""
    rng = random.Random(seed)
    nodes = []
    for i in range(40):
        size = rng.choice((16, 40, 80))
        gpus = [gpu(k, mem=size if rng.random() < 0.9 else 24, mem_free=None, comp_free=None)
                for k in range(rng.randint(1, 8))]
        for g in gpus:
            g["memoryUnitsFree"] = rng.randint(0, g["memoryUnits"])
            g["computeUnitsFree"] = rng.choice((0, 10, 30, 50, 70, 100))
        nodes.append(node(f"n{i}", gpus))
    view = view_of(nodes)
    for _ in range(5):
        profile = rng.choice((PROFILE_COST_SAVING, PROFILE_HIGH_PERFORMANCE))
        p = random_pod(rng, profile)
        needs = parse_pod_request(p).needs
        policy = fit_rule.PACK if profile == PROFILE_COST_SAVING else fit_rule.SPREAD
        result = filter_nodes(args(p, nodes), view)
        scores = dict(prioritize_nodes(args(p, nodes), view).hosts)
        for n in nodes:
            name = n["metadata"]["name"]
            summary = view.summary(name)
            assert summary.rooms is not None and summary.free is not None
            placed = fit_rule.place(needs, summary.rooms, policy)
            if isinstance(placed, fit_rule.Placement):
                assert name in (result.node_names or [])
                steady = [x for x in needs if x.kind != fit_rule.KIND_INIT]
                sizes = {r.uuid: r.memory_total for r in summary.rooms}
                added = (sum(x.memory_on(sizes[g]) for x in steady for g in placed.gpus[x.name]),
                         sum(x.compute * x.count for x in steady))
                assert scores[name] == fit_rule.score_added(added, summary.free, policy)
                continue
            assert scores[name] == 0
            got = (result.failed if placed.resolvable else result.unresolvable).get(name)
            assert got is not None, (name, placed)
            if len([x for x in needs if x.asks]) == 1:
                assert got == placed.why


def test_answers_kept_per_pod_shape_follow_every_change_of_a_node() -> None:
    """Filter keeps its answers per pod shape; a new report, a bind's reservation, and a report going stale each
    change the answer for the next pod of the same shape."""
    from datetime import datetime, timedelta, timezone

    from alnair_agent.node.decision import Decision
    from alnair_agent.scheduler.view import Reservation
    beat = datetime(2026, 12, 3, 12, 0, tzinfo=timezone.utc)

    def reported(mem_free: int) -> dict[str, Any]:
        n = node("n", [gpu(0, mem_free=mem_free)])
        doc = json.loads(n["metadata"]["annotations"][NODE_GPU_DEVICES])
        n["metadata"]["annotations"][NODE_GPU_DEVICES] = json.dumps({**doc, "heartbeat": "2026-12-03T12:00:00Z"})
        return n

    view = view_of([reported(16)])
    p = pod(containers=[("train", 10, 50)])
    assert filter_nodes(args(p, [reported(16)]), view, beat).node_names == ["n"]
    view.apply_node(reported(8))  # the agent reports less room
    assert filter_nodes(args(p, [reported(8)]), view, beat).node_names == []
    view.apply_node(reported(16))
    assert filter_nodes(args(p, [reported(16)]), view, beat).node_names == ["n"]
    gpu_uuid = gpu(0)["uuid"]
    view.reserve(Reservation("uid-1", "ml", "other", (fit_rule.Need("a", 8, 10),),
                             Decision("n", PROFILE_COST_SAVING, beat, {"a": (gpu_uuid,)})))
    later = beat + timedelta(seconds=31)  # past the reservation's lock, before the report goes stale
    assert filter_nodes(args(p, [reported(16)]), view, later).node_names == []  # 8 of 16 taken by the bind
    view.unreserve("uid-1")
    assert filter_nodes(args(p, [reported(16)]), view, later).node_names == ["n"]
    stale = filter_nodes(args(p, [reported(16)]), view, beat + timedelta(seconds=181))
    assert stale.node_names == [] and "has not reported for 181 s" in stale.failed["n"]


# -- the HTTP extender, as kube-scheduler calls it --------------------------------------------------------------

HTTP_NODES = [node("gpu-a", [gpu(0, mem_free=2), gpu(1, mem_free=12, comp_free=70)]),
              node("gpu-b", [gpu(0, mem_free=2), gpu(1, comp_free=20)]),
              node("cpu-only")] + [node(name, SCORE_NODES[name]) for name in ("idle", "half", "busy")]


@pytest.fixture
async def client() -> AsyncIterator[TestClient[Any, Any]]:
    async with TestClient(TestServer(build_app(view_of(HTTP_NODES)))) as c:
        yield c


async def post(client: TestClient[Any, Any], path: str, body: Any) -> Any:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = await client.post(path, data=io.BytesIO(data), headers={"Content-Type": "application/json"})
    assert resp.status == 200
    assert resp.content_type == "application/json"
    return await resp.json()


async def test_http_filter_answers_an_extender_filter_result(client: TestClient[Any, Any]) -> None:
    nodes = HTTP_NODES[:3]
    with capture_logs() as logs:
        result = await post(client, "/filter", args(pod(), nodes))
    assert set(result) == {"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}
    assert result["Error"] == "" and result["Nodes"] is None
    assert result["NodeNames"] == ["gpu-a"]
    reason = result["FailedNodes"]["gpu-b"]
    assert reason == "no healthy GPU has room for container 'train' (4 memory + 50 compute units on one GPU)"
    assert list(result["FailedAndUnresolvableNodes"]) == ["cpu-only"]
    assert {"event": "filter", "pod": "ml/trainer-0", "passed": 1, "failed": 1, "unresolvable": 1,
            "log_level": "info"} in logs


@pytest.mark.parametrize("body, words", [
    (b"", "not JSON"),
    (b"\x00\xffgarbage", "not JSON"),
    (b"{\"Pod\": ", "not JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b"null", "must be a JSON object"),
    (json.dumps({"Nodes": {"items": []}, "NodeNames": None}).encode(), "no Pod"),
    (json.dumps({"Pod": "trainer-0", "Nodes": {"items": []}}).encode(), "no Pod"),
    (json.dumps({"Pod": pod(), "Nodes": None, "NodeNames": None}).encode(), "neither NodeNames nor Nodes"),
    (json.dumps({"Pod": pod(), "NodeNames": ["gpu-a", 7]}).encode(), "list of strings"),
    (json.dumps({"Pod": pod(containers=[("train", "lots", 50)]), "Nodes": {"items": []}}).encode(),
     "pod ml/trainer-0: container 'train': alnair/vgpu-memory = \"lots\""),
])
async def test_http_filter_puts_every_failure_in_error(client: TestClient[Any, Any], body: bytes, words: str) -> None:
    with capture_logs() as logs:
        result = await post(client, "/filter", body)
    assert words in result["Error"]
    assert result["Nodes"] is None and result["NodeNames"] is None and result["FailedNodes"] == {}
    assert [e["event"] for e in logs] == ["filter_error"]


async def test_http_filter_reads_only_names_from_whole_nodes(client: TestClient[Any, Any]) -> None:
    """A kube-scheduler configured without nodeCacheCapable sends Node objects: only their names count; the
    view (the node watch) says what each node has."""
    stale = node("gpu-b", [gpu(0), gpu(1)])  # the object says empty GPUs; the view knows better
    result = await post(client, "/filter", {"Pod": pod(), "Nodes": {"items": [HTTP_NODES[0], stale]}})
    assert result["NodeNames"] == ["gpu-a"] and list(result["FailedNodes"]) == ["gpu-b"]


async def test_http_field_names_match_case_insensitively_like_go(client: TestClient[Any, Any]) -> None:
    result = await post(client, "/filter", {"pod": pod(), "nodenames": ["gpu-a"]})
    assert result["NodeNames"] == ["gpu-a"]


async def test_http_prioritize_answers_a_host_priority_list(client: TestClient[Any, Any]) -> None:
    nodes = [node(name, SCORE_NODES[name]) for name in ("idle", "half", "busy")]
    packed = await post(client, "/prioritize", args(pod(containers=[("train", 2, 10)]), nodes))
    assert packed == [{"Host": "idle", "Score": 1}, {"Host": "half", "Score": 6}, {"Host": "busy", "Score": 9}]
    spread = await post(client, "/prioritize",
                        args(pod(containers=[("train", 2, 10)], scheduler=PROFILE_HIGH_PERFORMANCE), nodes))
    assert spread == [{"Host": "idle", "Score": 9}, {"Host": "half", "Score": 4}, {"Host": "busy", "Score": 1}]


async def test_http_prioritize_failures_give_zero_scores_and_a_log_line(client: TestClient[Any, Any]) -> None:
    with capture_logs() as logs:
        assert await post(client, "/prioritize", b"]]garbage[[") == []
        bad = pod(containers=[("train", 4, "1.5")])
        scores = await post(client, "/prioritize", args(bad, [node("gpu-a", [gpu(0)]), node("gpu-b", [gpu(0)])]))
        assert scores == [{"Host": "gpu-a", "Score": 0}, {"Host": "gpu-b", "Score": 0}]
    errors = [e for e in logs if e["event"] == "prioritize_error"]
    assert len(errors) == 2 and all(e["log_level"] == "warning" for e in errors)
    assert "not JSON" in errors[0]["error"]
    assert "alnair/vgpu-compute = \"1.5\"" in errors[1]["error"]


async def test_http_takes_bodies_larger_than_aiohttp_default() -> None:
    # A kube-scheduler not configured node-cache-capable sends 400 nodes with kubelet-sized status blocks: MiBs.
    nodes = [node(f"gpu-{i:03d}", [gpu(0, mem_free=i % 17)]) for i in range(400)]
    for n in nodes:
        n["status"]["images"] = [{"names": [f"registry.example.com/team/image-{k}:{'x' * 64}"],
                                  "sizeBytes": 123456789} for k in range(50)]
    body = json.dumps({"Pod": pod(), "Nodes": {"items": nodes}}).encode()
    assert len(body) > 2 * 1024 * 1024
    async with TestClient(TestServer(build_app(view_of(nodes)))) as big:
        result = await post(big, "/filter", body)
    assert result["Error"] == ""
    assert len(result["NodeNames"]) == sum(1 for i in range(400) if i % 17 >= 4)


async def test_http_healthz(client: TestClient[Any, Any]) -> None:
    resp = await client.get("/healthz")
    assert resp.status == 200 and await resp.text() == "ok\n"


# -- the alnair-scheduler process -------------------------------------------------------------------------------

def test_bad_port_variable_stops_with_a_message(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("ALNAIR_SCHEDULER_PORT", "eighty")
    assert main([]) == 2
    assert "ALNAIR_SCHEDULER_PORT: 'eighty' is not a port number" in capsys.readouterr().err
    assert main(["--port", "70000"]) == 2
    monkeypatch.setenv("ALNAIR_SCHEDULER_PORT", "8080")
    monkeypatch.setenv("ALNAIR_LOG_FORMAT", "xml")
    assert main([]) == 2
    assert "ALNAIR_LOG_FORMAT: 'xml' is not one of json, console" in capsys.readouterr().err


async def test_process_serves_until_sigterm() -> None:
    env = os.environ | {"ALNAIR_SCHEDULER_PORT": "0", "ALNAIR_SCHEDULER_HEALTH_PORT": "0", "ALNAIR_KUBERNETES": "off"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "alnair_agent.scheduler.main", "--host", "127.0.0.1", env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    assert proc.stderr is not None
    try:
        while True:
            line = json.loads(await asyncio.wait_for(proc.stderr.readline(), 20))
            if line["event"] == "scheduler_listening":
                break
        assert line["level"] == "info" and len(line["addresses"]) == 2  # verbs, then health
        base, health = (f"http://{a}" for a in line["addresses"])
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{health}/healthz") as resp:
                assert resp.status == 200
            async with session.get(f"{health}/readyz") as resp:
                assert resp.status == 200
            async with session.post(f"{base}/filter", data=b"garbage") as resp:
                assert resp.status == 200 and "not JSON" in (await resp.json())["Error"]
            async with session.post(f"{base}/bind", json={"PodName": "p", "PodNamespace": "d", "PodUID": "u",
                                                          "Node": "n"}) as resp:
                assert "without an API server" in (await resp.json())["Error"]
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 0
        events = [json.loads(raw)["event"] for raw in (await proc.stderr.read()).splitlines()]
        assert events[0] == "filter_error" and events[-1] == "scheduler_stopped"
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _scheduler_log_until(stream: asyncio.StreamReader, event: str, seen: list[dict[str, Any]],
                               timeout: float = 20) -> dict[str, Any]:
    """The first log line of `event`, read from `stream` unless it is already in `seen`: the HTTP server and the
    watches start together, so the view may be synced before the server logs that it listens."""
    for line in seen:
        if line["event"] == event:
            return line
    while True:
        line = json.loads(await asyncio.wait_for(stream.readline(), timeout))
        seen.append(line)
        if line["event"] == event:
            return line


async def test_sigterm_answers_a_bind_waiting_for_a_locked_node_and_exits_within_2_s(tmp_path) -> None:
    """One replica, Recreate strategy: a rollout stops the old extender while a bind waits for a node's lock (a
    pod bound there that kubelet has not admitted yet). The waiting bind is answered with an Error at once (kube-
    scheduler retries it against the new extender), nothing of it is left on the pod, and the process exits 0
    within 2 s, its log naming the scheduler."""
    from alnair_agent.node.decision import PLACEMENT_ANNOTATION
    from alnair_standins.apiserver import FakeApiServer
    from alnair_standins.cluster import alnair_pod

    async with FakeApiServer() as api:
        api.add_node("gpu-a", node=node("gpu-a", [gpu(0)]))
        first = api.add_pod(alnair_pod("first", [{"name": "main", "memory": 2, "compute": 20}]))
        second = api.add_pod(alnair_pod("second", [{"name": "main", "memory": 2, "compute": 20}]))
        env = os.environ | {"KUBECONFIG": str(api.write_kubeconfig(tmp_path / "kubeconfig"))}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "alnair_agent.scheduler.main", "--host", "127.0.0.1", "--port", "0",
            "--health-port", "0", "--kubernetes", "auto", "--bind-wait-s", "20", env=env,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        assert proc.stderr is not None
        seen: list[dict[str, Any]] = []
        try:
            base = f"http://{(await _scheduler_log_until(proc.stderr, 'scheduler_listening', seen))['addresses'][0]}"
            await _scheduler_log_until(proc.stderr, "scheduler_view_synced", seen)

            def bind_args(p: dict[str, Any]) -> dict[str, Any]:
                meta = p["metadata"]
                return {"PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"],
                        "Node": "gpu-a"}

            async with aiohttp.ClientSession() as session:
                async with session.post(f"{base}/bind", json=bind_args(first)) as resp:
                    assert (await resp.json())["Error"] == ""  # bound: the node is locked until kubelet admits it

                async def bind_second() -> tuple[dict[str, Any], float]:
                    async with session.post(f"{base}/bind", json=bind_args(second)) as resp:
                        assert resp.status == 200
                        return await resp.json(), loop.time()

                loop = asyncio.get_running_loop()
                waiting = asyncio.create_task(bind_second())
                await _scheduler_log_until(proc.stderr, "bind_waiting_for_lock", seen)
                assert not waiting.done()
                proc.send_signal(signal.SIGTERM)
                stopped_at = loop.time()
                answer, answered_at = await asyncio.wait_for(waiting, 5)
                assert await asyncio.wait_for(proc.wait(), 5) == 0
                exited_at = loop.time()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        seen += [json.loads(raw) for raw in (await proc.stderr.read()).splitlines()]
        events = [line["event"] for line in seen]
        assert "stopping" in answer["Error"] and "retry" in answer["Error"], answer
        assert answered_at - stopped_at < 1.0
        assert exited_at - stopped_at < 2.0, events
        assert "scheduler_stopping" in events and events[-1] == "scheduler_stopped"
        assert "agent_stopping" not in events and "service_stop_timeout" not in events, events
        # Nothing of the unanswered bind is left: no decision on the pod, not bound; the first one is untouched.
        assert PLACEMENT_ANNOTATION not in api.pod_annotations("default", "second")
        assert not api.pod("default", "second")["spec"].get("nodeName")
        assert [b[1] for b in api.bindings] == ["first"]


async def test_process_exits_1_when_the_port_is_taken() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "alnair_agent.scheduler.main", "--host", "127.0.0.1", "--port", str(port),
            "--health-port", "0", "--kubernetes", "off",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        _, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 1
    failed = json.loads(err.splitlines()[-1])
    assert failed["event"] == "scheduler_listen_failed" and failed["port"] == port
