"""Several GPUs for one container (`alnair/vgpu-count: N`): the shared fit rule gives it N distinct GPUs of one node
by the profile, the real extender decides them at bind, the real agents carry them out behind a kubelet emulator
admitting resources in random order, and a request no node can meet stays Pending with a reason saying so, never
half allocated."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from test_placement import PROFILES, allocated_everywhere, check_cluster, gpu_units, no_locks, wait_for

from alnair_agent.constants import ENV_CUDA_DEVICE_ORDER, ENV_REGIONS, ENV_VISIBLE_DEVICES
from alnair_agent.kube.pods import parse_pod
from alnair_agent.node import fit
from alnair_agent.node.decision import (
    ALLOCATED_ANNOTATION,
    PLACEMENT_ANNOTATION,
    Decision,
    DecisionError,
    parse_allocated,
    parse_decision,
)
from alnair_agent.scheduler.extender import RequestError, parse_pod_request
from alnair_standins.apiserver import make_pod
from alnair_standins.cluster import alnair_pod, cluster
from alnair_standins.node import remove_tree, short_tmp

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def root():
    path = short_tmp()
    yield path
    remove_tree(path)


def rooms(*free: tuple[int, int], total: tuple[int, int] = (16, 100)) -> list[fit.Room]:
    return [fit.Room(f"GPU-{i}", i, m, c, *total) for i, (m, c) in enumerate(free)]


# -- the fit rule ------------------------------------------------------------------------------------------------

def test_pack_takes_the_fullest_gpus_and_spread_the_emptiest() -> None:
    r = rooms((16, 100), (4, 40), (10, 60), (2, 20))
    need = fit.Need("main", 2, 20, count=2)
    assert fit.place([need], r, fit.PACK).gpus == {"main": ("GPU-1", "GPU-3")}  # fullest that fit, index order
    assert fit.place([need], r, fit.SPREAD).gpus == {"main": ("GPU-0", "GPU-2")}


def test_a_containers_gpus_are_distinct_and_all_or_none() -> None:
    # one GPU could hold both slices, but a container's two GPUs must be two GPUs
    result = fit.place([fit.Need("main", 4, 10, count=2)], rooms((16, 100), (2, 100)), fit.PACK)
    assert isinstance(result, fit.NoFit) and result.resolvable
    assert "no 2 healthy GPUs of this node have room each for container 'main'" in result.reason


def test_more_gpus_than_the_node_has_is_unresolvable_and_says_so() -> None:
    result = fit.place([fit.Need("main", 1, 10, count=3)], rooms((16, 100), (16, 100)), fit.PACK)
    assert isinstance(result, fit.NoFit) and not result.resolvable
    assert "asks for 3 GPUs and this node has 2 healthy GPU(s)" in result.reason


def test_a_slice_no_two_empty_gpus_can_hold_is_unresolvable() -> None:
    result = fit.place([fit.Need("main", 12, 10, count=2)], rooms((4, 100), (4, 100), total=(16, 100))[:2]
                       + [fit.Room("GPU-9", 9, 16, 100, 16, 100)], fit.PACK)
    assert isinstance(result, fit.NoFit) and result.resolvable  # GPU 0 and 1 are full now: preemption helps
    big = fit.place([fit.Need("main", 20, 10, count=2)], rooms((16, 100), (16, 100)), fit.PACK)
    assert isinstance(big, fit.NoFit) and not big.resolvable and "even when empty" in big.reason


def test_init_containers_with_a_multi_gpu_container_are_refused_clearly() -> None:
    needs = [fit.Need("setup", 1, 0, fit.KIND_INIT), fit.Need("main", 1, 10, count=2)]
    result = fit.place(needs, rooms((16, 100), (16, 100)), fit.PACK)
    assert isinstance(result, fit.NoFit) and not result.resolvable and "asks for 2 GPUs" in result.reason


@pytest.mark.parametrize("seed", range(200))
def test_fast_verdict_agrees_with_place(seed: int) -> None:
    """Filter answers multi-GPU pods without placing them where it can; it must never say "fits" where `place`
    would not."""
    rng = random.Random(seed)
    r = [fit.Room(f"GPU-{i}", i, rng.randint(0, 16), rng.choice((0, 10, 30, 60, 100)), 16, 100)
         for i in range(rng.randint(1, 8))]
    needs = [fit.Need(f"c{k}", rng.randint(0, 6), rng.choice((0, 10, 20, 40)), count=rng.randint(1, 4))
             for k in range(rng.randint(1, 3))]
    shape = fit.Shape.of(needs)
    fast = fit.verdict(shape, r, fit.FreeSummary.of(r), fit.PACK)
    full = fit.place(needs, r, fit.PACK)
    assert (fast is None or isinstance(fast, fit.Placement)) == isinstance(full, fit.Placement)
    if max(n.count for n in shape.needs or needs) <= len(r):  # else place refuses before placing
        assert full == _slow_place(list(shape.needs), r, fit.PACK)
    if isinstance(full, fit.NoFit):
        assert isinstance(fast, fit.NoFit) and fast.resolvable == full.resolvable
        if len(shape.needs) == 1:
            assert fast == full
    if isinstance(full, fit.Placement):
        used: Counter[str] = Counter()
        for n in shape.needs:
            gpus = full.gpus[n.name]
            assert len(gpus) == len(set(gpus)) == n.count
            assert [g for g in gpus] == sorted(gpus, key=lambda g: int(g.split("-")[1]))
            for g in gpus:
                used[g] += 1
        for (g, m, c) in ((x.uuid, x.memory_free, x.compute_free) for x in r):
            per = fit.usage(shape.needs, full.gpus).get(g, (0, 0))
            assert per[0] <= m and per[1] <= c


# -- the pod's request -------------------------------------------------------------------------------------------

def test_count_splits_the_containers_totals_evenly() -> None:
    pod = parse_pod(make_pod("p", containers=[{"name": "main", "memory": 8, "compute": 60, "gpus": 2}]))
    [c] = pod.containers
    assert (c.memory_units, c.compute_units, c.gpus) == (8, 60, 2)
    assert c.need() == fit.Need("main", 4, 30, fit.KIND_REGULAR, 2)


@pytest.mark.parametrize("spec, words", [
    ({"memory": 9, "compute": 60, "gpus": 2}, ["alnair/vgpu-memory", "\"9\"", "not a multiple of alnair/vgpu-count = 2"]),
    ({"memory": 8, "compute": 45, "gpus": 2}, ["alnair/vgpu-compute", "not a multiple"]),
    ({"memory": 8, "gpus": 0}, ["alnair/vgpu-count", "\"0\"", "1..16"]),
    ({"memory": 8, "gpus": 65}, ["alnair/vgpu-count", "1..16"]),
    ({"memory": 8, "gpus": "two"}, ["alnair/vgpu-count", "\"two\"", "non-negative integer"]),
    ({"gpus": 2}, ["alnair/vgpu-count", "no alnair/vgpu-memory or alnair/vgpu-compute"]),
])
def test_a_bad_count_is_refused_naming_what_is_wrong(spec: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(RequestError) as e:
        parse_pod_request(make_pod("p", containers=[{"name": "main", **spec}]))
    assert "container 'main'" in str(e.value)
    for w in words:
        assert w in str(e.value)


def test_placement_annotation_round_trips_lists_and_refuses_bad_ones() -> None:
    from datetime import datetime, timezone
    d = Decision("n", "alnair-cost-saving", datetime(2026, 1, 1, tzinfo=timezone.utc),
                 {"a": ("GPU-0",), "b": ("GPU-1", "GPU-3")})
    text = d.to_json()
    assert '"a": "GPU-0"' in text and '"b": ["GPU-1", "GPU-3"]' in text  # one GPU: a string, as before
    assert parse_decision(text).gpus == d.gpus
    for bad in ('["GPU-1", "GPU-1"]', "[]", "[1]"):
        with pytest.raises(DecisionError):
            parse_decision(text.replace('["GPU-1", "GPU-3"]', bad))


# -- end to end --------------------------------------------------------------------------------------------------

def mixed_pods(rng: random.Random, count: int) -> list[dict[str, Any]]:
    """Pods of one or two containers, some over 2-4 GPUs (memory and compute are totals over them)."""
    pods = []
    for n in range(count):
        containers = []
        for k in range(rng.choice((1, 1, 2))):
            gpus = rng.choice((1, 1, 2, 2, 3, 4))
            c: dict[str, Any] = {"name": f"c{k}", "memory": gpus * rng.randint(1, 3),
                                 "compute": gpus * rng.choice((5, 10, 20))}
            if gpus > 1 or rng.random() < 0.5:
                c["gpus"] = gpus
            containers.append(c)
        pods.append(alnair_pod(f"p{n}", containers, profile=rng.choice(PROFILES)))
    return pods


@pytest.mark.parametrize("seed", range(8))
async def test_multi_gpu_pods_mixed_in_are_never_cross_wired(root: Path, seed: int) -> None:
    """Pods created in the same second, admitted in every order, resources of a container in random order: each
    container gets exactly its N GPUs (distinct, on its node, in the decided order), each GPU's region its
    per-GPU limits, nothing double-booked; ending pods removes every folder of theirs and nothing else."""
    rng = random.Random(seed)
    order = ("fifo", "reverse", "random")[seed % 3]
    async with cluster(root, {"node-a": "4x16GiB", "node-b": "4x16GiB"}, seed, admission_order=order) as c:
        pods = mixed_pods(rng, 10)
        for pod in pods:
            c.api.add_pod(pod)
        await c.settle(len(pods), timeout=90)
        assert c.refused() == {}
        check_cluster(c, gpu_units(c))
        await wait_for(lambda: allocated_everywhere(c), what="allocated annotations")
        for _uid, (node, adm) in c.admitted().items():
            pod = c.api.pod(adm.namespace, adm.pod)
            granted = parse_allocated(pod["metadata"]["annotations"][ALLOCATED_ANNOTATION])
            decided = parse_decision(pod["metadata"]["annotations"][PLACEMENT_ANNOTATION]).gpus
            for name, answers in adm.answers.items():
                env = dict(next(iter(answers.values())).envs)
                assert env[ENV_VISIBLE_DEVICES].split(",") == list(decided[name])
                if len(decided[name]) > 1:
                    assert granted[name].gpus == decided[name] and len(set(granted[name].allocations)) == len(
                        decided[name])
                    assert env[ENV_REGIONS] == ",".join(
                        ["/run/alnair/region"] + [f"/run/alnair-{k}/region" for k in range(1, len(decided[name]))])
                    assert env[ENV_CUDA_DEVICE_ORDER] == "PCI_BUS_ID"
                    index = {g.uuid: g.info.index for g in c.nodes[node].agent.inventory.gpus.values()}
                    assert [index[g] for g in decided[name]] == sorted(index[g] for g in decided[name])
        await wait_for(lambda: no_locks(c), what="no node lock left")

        admitted = list(c.admitted().values())
        rng.shuffle(admitted)
        ending, staying = admitted[: len(admitted) // 2], admitted[len(admitted) // 2:]
        folders = {adm.pod: {Path(m.host_path).parent for a in adm.answers.values() for r in a.values()
                             for m in r.mounts if m.container_path.startswith("/run/alnair")} for _, adm in admitted}
        for _, adm in ending:
            c.api.delete_pod(adm.namespace, adm.pod)
        gone = {f for _, adm in ending for f in folders[adm.pod]}
        await wait_for(lambda: not any(f.exists() for f in gone), what="ended pods' folders removed")
        assert all(f.is_dir() for _, adm in staying for f in folders[adm.pod])


async def test_profiles_pack_or_spread_the_slices_end_to_end(root: Path) -> None:
    async with cluster(root, {"node-a": "4x16GiB"}, seed=11) as c:
        c.api.add_pod(alnair_pod("base", [{"name": "main", "memory": 8, "compute": 50}]))  # fills one GPU half
        await c.settle(1, timeout=30)
        [base] = parse_decision(c.api.pod_annotations("default", "base")[PLACEMENT_ANNOTATION]).gpus["main"]
        c.api.add_pod(alnair_pod("pack", [{"name": "main", "memory": 4, "compute": 40, "gpus": 2}],
                                 profile="alnair-cost-saving"))
        await c.settle(2, timeout=30)
        packed = parse_decision(c.api.pod_annotations("default", "pack")[PLACEMENT_ANNOTATION]).gpus["main"]
        assert base in packed  # the fullest GPU is one of the two
        c.api.add_pod(alnair_pod("spread", [{"name": "main", "memory": 4, "compute": 40, "gpus": 2}],
                                 profile="alnair-high-performance"))
        await c.settle(3, timeout=30)
        spread = parse_decision(c.api.pod_annotations("default", "spread")[PLACEMENT_ANNOTATION]).gpus["main"]
        assert not set(spread) & set(packed)  # the two GPUs nobody uses yet
        assert c.refused() == {}
        check_cluster(c, gpu_units(c))


@pytest.mark.parametrize("spec, words", [
    ({"memory": 5, "compute": 50, "gpus": 5}, ["asks for 5 GPUs and this node has 4 healthy GPU(s)"]),
    ({"memory": 40, "compute": 20, "gpus": 2}, ["no 2 healthy GPUs", "2 GPUs of 20 memory + 10 compute units each"]),
])
async def test_a_request_no_node_can_meet_stays_pending_with_the_reason(root: Path, spec: dict[str, Any],
                                                                        words: list[str]) -> None:
    async with cluster(root, {"node-a": "4x16GiB"}, seed=12, backoff_initial_s=0.2) as c:
        c.api.add_pod(alnair_pod("wide", [{"name": "main", **spec}]))
        assert c.scheduler is not None
        await wait_for(lambda: len(c.scheduler.unschedulable) >= 2, what="the pod tried and found unschedulable")
        _, reasons = c.scheduler.unschedulable[-1]
        for w in words:
            assert w in reasons["node-a"], reasons
        assert not c.api.pod("default", "wide")["spec"].get("nodeName")
        agent = c.nodes["node-a"].agent
        assert agent is not None and agent.ledger is not None and not agent.ledger.allocations


def _slow_place(needs: list[fit.Need], r: list[fit.Room], policy: str) -> fit.Placement | fit.NoFit:
    """`fit.place` without its one-container shortcut and its cache: place, then place again on the GPUs empty."""
    result = fit._place(needs, r, policy)
    if isinstance(result, fit.Placement):
        return result
    empty = fit._place(needs, [x.empty() for x in r], policy)
    if isinstance(empty, fit.Placement):
        return fit.NoFit(result.why, result.resolvable, tuple(r))
    if not empty.resolvable:
        return fit.NoFit(empty.why, False, tuple(r))
    if any(n.count > 1 for n in needs):
        return fit.NoFit("the request is larger than this node's GPUs can hold even when empty: " + empty.why,
                         False, tuple(r))
    mem, comp = max(x.memory_total for x in r), max(x.compute_total for x in r)
    return fit.NoFit(f"the request is larger than any single GPU on this node can hold (largest offers {mem} "
                     f"memory + {comp} compute units; memory and compute of a container come from one GPU): "
                     + empty.why, False, tuple(r))


@pytest.mark.parametrize("seed", range(200))
def test_one_container_shortcut_gives_what_placing_gives(seed: int) -> None:
    """Filter answers a one-container pod that does not fit without placing it twice; the answer (reason and
    resolvability) is the one placing gives."""
    rng = random.Random(seed)
    total = rng.choice((16, 80))
    r = [fit.Room(f"GPU-{i}", i, rng.randint(0, total), rng.choice((0, 10, 30, 60, 100)), total, 100)
         for i in range(rng.randint(1, 8))]
    n = fit.Need("main", rng.randint(0, total + 4), rng.choice((0, 10, 40, 100)), count=rng.randint(1, len(r)))
    if not (n.memory or n.compute):
        return
    policy = rng.choice(fit.POLICIES)
    assert fit.place([n], r, policy) == _slow_place([n], r, policy)
