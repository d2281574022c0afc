"""Memory asked as a share of a GPU (`alnair/vgpu-memory-percent: P`): the fit rule converts it on each GPU it
considers (P % of that GPU's memory units, rounded down, at least one), so one request lands as different units on
GPUs of different sizes; with `alnair/vgpu-count: N` it is P % of each of the N GPUs. The real extender decides,
the real agents behind a kubelet emulator carry it out, and `ai.centaurus.io/allocated` shows what it became.
A bad request is refused naming what was wrong, and the pod stays Pending."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from test_placement import PROFILES, allocated_everywhere, check_cluster, gpu_units, no_locks, wait_for

from alnair_agent.kube.pods import parse_pod
from alnair_agent.node import fit
from alnair_agent.node.decision import ALLOCATED_ANNOTATION, PLACEMENT_ANNOTATION, parse_allocated, parse_decision
from alnair_agent.node.gpu_devices import report_of_node
from alnair_agent.scheduler.extender import RequestError, parse_pod_request
from alnair_standins.apiserver import make_pod
from alnair_standins.cluster import MEM, alnair_pod, cluster
from alnair_standins.node import remove_tree, short_tmp

pytestmark = pytest.mark.timeout(180)
GIB = 1 << 30


@pytest.fixture
def root():
    path = short_tmp()
    yield path
    remove_tree(path)


def room(i: int, total: int, free: int | None = None, compute_free: int = 100) -> fit.Room:
    return fit.Room(f"GPU-{i}", i, total if free is None else free, compute_free, total, 100)


# -- the conversion and the fit rule -------------------------------------------------------------------------------

@pytest.mark.parametrize("percent, total, units", [
    (50, 16, 8), (50, 40, 20), (33, 16, 5), (100, 141, 141), (1, 16, 1), (1, 80, 1), (2, 80, 1), (3, 80, 2),
    (50, 0, 0),
])
def test_a_percent_is_that_share_of_the_gpus_units_rounded_down_at_least_one(percent: int, total: int,
                                                                            units: int) -> None:
    assert fit.percent_units(percent, total) == units


PLACE_CASES = [
    # id, rooms, need, policy, expected GPUs (None: does not fit), memory held per GPU
    ("half-of-a-small-gpu-fits-where-half-of-a-big-one-would-not", [room(0, 40, free=10), room(1, 16)],
     fit.Need("main", 0, 10, memory_percent=50), fit.PACK, ("GPU-1",), {"GPU-1": 8}),
    ("pack-takes-the-fullest-after-conversion", [room(0, 16), room(1, 40, free=25)],
     fit.Need("main", 0, 10, memory_percent=50), fit.PACK, ("GPU-1",), {"GPU-1": 20}),
    ("spread-takes-the-emptiest-after-conversion", [room(0, 16), room(1, 40, free=25)],
     fit.Need("main", 0, 10, memory_percent=50), fit.SPREAD, ("GPU-0",), {"GPU-0": 8}),
    ("a-percent-of-each-of-n-gpus", [room(0, 16), room(1, 40), room(2, 80, free=10)],
     fit.Need("main", 0, 20, count=2, memory_percent=25), fit.SPREAD, ("GPU-0", "GPU-1"), {"GPU-0": 4, "GPU-1": 10}),
    ("the-whole-gpu", [room(0, 16, free=15), room(1, 16)], fit.Need("main", 0, 10, memory_percent=100), fit.PACK,
     ("GPU-1",), {"GPU-1": 16}),
    ("no-gpu-has-that-share-free", [room(0, 16, free=7), room(1, 40, free=19)],
     fit.Need("main", 0, 10, memory_percent=50), fit.PACK, None, {}),
]


@pytest.mark.parametrize("rooms, need, policy, gpus, held", [c[1:] for c in PLACE_CASES],
                         ids=[c[0] for c in PLACE_CASES])
def test_the_fit_rule_converts_on_each_gpu_it_considers(rooms: list[fit.Room], need: fit.Need, policy: str,
                                                        gpus: tuple[str, ...] | None, held: dict[str, int]) -> None:
    placed = fit.place([need], rooms, policy)
    if gpus is None:
        assert isinstance(placed, fit.NoFit) and placed.resolvable
        assert "50 % memory + 10 compute units" in placed.why
        return
    assert isinstance(placed, fit.Placement) and placed.gpus == {"main": gpus}
    totals = {r.uuid: r.memory_total for r in rooms}
    assert {g: m for g, (m, _) in fit.usage([need], placed.gpus, totals).items()} == held


@pytest.mark.parametrize("seed", range(200))
def test_counting_agrees_with_placing_for_shares_of_gpus(seed: int) -> None:
    """Filter judges thousands of nodes by counting; with memory as a percent it converts once per GPU size (a node
    of one size) or places (GPUs of several sizes); it must answer what placing answers."""
    rng = random.Random(seed)
    sizes = rng.choice(((16,), (80,), (16, 40)))
    rooms = []
    for i in range(rng.randint(1, 6)):
        total = rng.choice(sizes)
        rooms.append(fit.Room(f"GPU-{i}", i, rng.randint(0, total), rng.choice((0, 10, 30, 60, 100)), total, 100))
    needs = []
    for k in range(rng.randint(1, 3)):
        count = rng.randint(1, 3)
        if rng.random() < 0.6:
            needs.append(fit.Need(f"c{k}", 0, rng.choice((10, 20, 40)), count=count,
                                  memory_percent=rng.choice((1, 10, 25, 50, 100))))
        else:
            needs.append(fit.Need(f"c{k}", rng.randint(0, 6), rng.choice((10, 20, 40)), count=count))
    shape = fit.Shape.of(needs)
    free = fit.FreeSummary.of(rooms)
    for policy in fit.POLICIES:
        fast = fit.verdict(shape, rooms, free, policy)
        full = fit.place(needs, rooms, policy)
        assert (fast is None or isinstance(fast, fit.Placement)) == isinstance(full, fit.Placement), (fast, full)
        if isinstance(full, fit.NoFit):
            assert isinstance(fast, fit.NoFit) and fast.resolvable == full.resolvable
        else:
            totals = {r.uuid: r.memory_total for r in rooms}
            for gpu, (m, c) in fit.usage(needs, full.gpus, totals).items():
                r = next(x for x in rooms if x.uuid == gpu)
                assert m <= r.memory_free and c <= r.compute_free
            if policy == fit.PACK:
                steady = [n for n in needs if n.asks]
                assert shape.added(free, rooms) == (
                    sum(n.memory_on(totals[g]) for n in steady for g in full.gpus[n.name]),
                    sum(n.compute * n.count for n in steady))


# -- the request --------------------------------------------------------------------------------------------------

def test_a_percent_is_read_from_the_pod_per_container() -> None:
    pod = parse_pod(make_pod("p", containers=[{"name": "main", "memory_percent": 50, "compute": 60, "gpus": 2},
                                              {"name": "side", "memory": 2, "compute": 10}]))
    main, side = pod.containers
    assert (main.memory_units, main.compute_units, main.gpus, main.memory_percent) == (0, 60, 2, 50)
    assert main.need() == fit.Need("main", 0, 30, fit.KIND_REGULAR, 2, memory_percent=50)
    assert side.need() == fit.Need("side", 2, 10)


@pytest.mark.parametrize("spec, words", [
    ({"memory_percent": 0, "compute": 10}, ['"0"', "1..100"]),
    ({"memory_percent": 101, "compute": 10}, ['"101"', "1..100"]),
    ({"memory_percent": "50%", "compute": 10}, ['"50%"', "whole number of percent"]),
    ({"memory_percent": "0.5", "compute": 10}, ['"0.5"', "whole number of percent"]),
    ({"memory_percent": 50, "memory": 4, "compute": 10}, ["comes with alnair/vgpu-memory", "not both"]),
    ({"memory_percent": 50, "memory": 0, "compute": 10}, ["comes with alnair/vgpu-memory"]),
    ({"memory_percent": 50}, ["needs alnair/vgpu-compute", "kubelet calls the agent only"]),
    ({"memory_percent": 50, "compute": 0}, ["needs alnair/vgpu-compute"]),
])
def test_a_bad_percent_is_refused_naming_what_is_wrong(spec: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(RequestError) as e:
        parse_pod_request(make_pod("p", containers=[{"name": "main", **spec}]))
    assert "container 'main'" in str(e.value) and "alnair/vgpu-memory-percent" in str(e.value)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_a_percent_beside_init_containers_is_refused() -> None:
    """kubelet hands a run-once init container's devices on to the next containers; a share of memory holds none,
    so the agent could not tell whose memory it is."""
    with pytest.raises(RequestError) as e:
        parse_pod_request(make_pod("p", containers=[{"name": "main", "memory_percent": 50, "compute": 10}],
                                   init_containers=[{"name": "setup", "memory": 1, "compute": 10}]))
    assert "container 'main'" in str(e.value) and "init containers" in str(e.value)


# -- end to end: the extender decides, the agent converts, the annotation shows it ---------------------------------

async def test_a_share_lands_as_the_units_of_the_gpu_it_gets_and_the_record_says_so(root: Path) -> None:
    async with cluster(root, {"node-a": "16GiB,40GiB"}, seed=3) as c:
        c.api.add_pod(alnair_pod("small", [{"name": "main", "memory_percent": 50, "compute": 30}],
                                 profile="alnair-cost-saving"))
        c.api.add_pod(alnair_pod("both", [{"name": "main", "memory_percent": 25, "compute": 40, "gpus": 2}],
                                 profile="alnair-high-performance"))
        await c.settle(2, timeout=60)
        assert c.refused() == {}
        check_cluster(c, gpu_units(c))
        await wait_for(lambda: allocated_everywhere(c), what="allocated annotations")
        agent = c.nodes["node-a"].agent
        assert agent is not None and agent.inventory is not None
        units = {g.uuid: g.units[MEM] for g in agent.inventory.gpus.values()}
        [small_gpu] = parse_decision(c.api.pod_annotations("default", "small")[PLACEMENT_ANNOTATION]).gpus["main"]
        small = parse_allocated(c.api.pod_annotations("default", "small")[ALLOCATED_ANNOTATION])["main"]
        assert small.memory_percent == 50 and small.memory_limit_bytes == units[small_gpu] // 2 * GIB
        both_gpus = parse_decision(c.api.pod_annotations("default", "both")[PLACEMENT_ANNOTATION]).gpus["main"]
        raw = json.loads(c.api.pod_annotations("default", "both")[ALLOCATED_ANNOTATION])["containers"]["main"]
        assert raw["memoryPercent"] == 25 and raw["gpus"] == list(both_gpus)
        assert raw["memoryLimitsBytes"] == [units[g] // 4 * GIB for g in both_gpus] == [4 * GIB, 10 * GIB]
        assert raw["memoryLimitBytes"] == raw["memoryLimitsBytes"][0]

        # the node's report counts the converted units as held
        def report_shows_them() -> bool:
            report = report_of_node(c.api.node("node-a"))
            held = {g.uuid: g.memory_units - g.memory_free for g in report.gpus}
            want = {g: units[g] // 4 for g in both_gpus}
            want[small_gpu] += units[small_gpu] // 2
            return held == want
        await wait_for(report_shows_them, what="the node report counting the shares")
        await wait_for(lambda: no_locks(c), what="no node lock left")

        # an agent restarted reads its records back: the shares are still held
        await c.stop_agent("node-a")
        await c.start_agent("node-a")
        agent = c.nodes["node-a"].agent
        assert agent is not None and agent.ledger is not None
        held = {r.uuid: r.memory_total - r.memory_free for r in agent.ledger.rooms()}
        assert held[small_gpu] >= units[small_gpu] // 2 and all(held[g] >= units[g] // 4 for g in both_gpus)
        assert sum(held.values()) == units[small_gpu] // 2 + sum(units[g] // 4 for g in both_gpus)


async def test_a_share_no_gpu_has_free_stays_pending_and_a_bad_one_says_why(root: Path) -> None:
    async with cluster(root, {"node-a": "2x16GiB"}, seed=5, backoff_initial_s=0.2) as c:
        for name in ("a", "b"):
            c.api.add_pod(alnair_pod(name, [{"name": "main", "memory_percent": 75, "compute": 10}]))
        await c.settle(2, timeout=60)
        uids = {c.api.pod("default", name)["metadata"]["uid"] for name in ("a", "b")}
        # the agent's report speaks for both (the extender then counts them by the report alone)
        await wait_for(lambda: uids <= report_of_node(c.api.node("node-a")).pods, what="the report naming both")
        c.api.add_pod(alnair_pod("third", [{"name": "main", "memory_percent": 50, "compute": 10}]))
        c.api.add_pod(alnair_pod("bad", [{"name": "main", "memory_percent": 150, "compute": 10}]))
        assert c.scheduler is not None
        await wait_for(lambda: {"third", "bad"} <= {n for n, _ in c.scheduler.unschedulable}, what="both tried")
        reasons = dict(c.scheduler.unschedulable)
        assert "no healthy GPU has room for container 'main' (50 % memory + 10 compute units on one GPU)" in reasons["third"]["node-a"]
        assert 'alnair/vgpu-memory-percent = "150" is not a whole number of percent in 1..100' in reasons["bad"][
            "error"]
        for name in ("third", "bad"):
            assert not c.api.pod("default", name)["spec"].get("nodeName")
        agent = c.nodes["node-a"].agent
        assert agent is not None and agent.ledger is not None and len(agent.ledger.allocations) == 2


@pytest.mark.parametrize("seed", range(6))
async def test_shares_mixed_in_are_never_cross_wired(root: Path, seed: int) -> None:
    """Pods asking for units, for shares of a GPU, over one or two GPUs, created in the same second and admitted in
    every order: each container gets its own limits (a share converted on its own GPUs) on the GPUs decided."""
    rng = random.Random(seed)
    order = ("fifo", "reverse", "random")[seed % 3]
    async with cluster(root, {"node-a": "16GiB,40GiB,16GiB", "node-b": "2x80GiB"}, seed,
                       admission_order=order) as c:
        pods = []
        for n in range(8):
            containers = []
            for k in range(rng.choice((1, 1, 2))):
                count = rng.choice((1, 1, 2))
                spec: dict[str, Any] = {"name": f"c{k}", "compute": count * rng.choice((5, 10, 20)), "gpus": count}
                if rng.random() < 0.5:
                    spec["memory_percent"] = rng.choice((5, 10, 25))
                else:
                    spec["memory"] = count * rng.randint(1, 3)
                containers.append(spec)
            pods.append(alnair_pod(f"p{n}", containers, profile=rng.choice(PROFILES)))
        for pod in pods:
            c.api.add_pod(pod)
        await c.settle(len(pods), timeout=120)
        assert c.refused() == {}
        check_cluster(c, gpu_units(c))
        await wait_for(lambda: allocated_everywhere(c), what="allocated annotations")
        await wait_for(lambda: no_locks(c), what="no node lock left")
