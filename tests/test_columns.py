"""The extender's columns (`alnair_agent.scheduler.columns`): every node's free units judged at once must give
exactly `fit.judge_all`'s answers, whatever the GPUs, their sizes, the units' range (fields widen; a value beyond
64 bits leaves its node out), and however nodes come, change and go; and the view that keeps them must answer a
changed node anew: after every change of a node's report or of the pods placed on it, filter answers what a view
built afresh from the same state answers."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from test_scheduler import args, gpu, node, pod, view_of

from alnair_agent.constants import NODE_GPU_DEVICES
from alnair_agent.node import fit
from alnair_agent.node.decision import Decision
from alnair_agent.scheduler.columns import Columns
from alnair_agent.scheduler.extender import PROFILE_COST_SAVING, filter_nodes, parse_pod_request
from alnair_agent.scheduler.view import ClusterView, Reservation, utcnow

pytestmark = pytest.mark.timeout(60)

GPU_SETS = [((80, 100),) * 8, ((80, 100),) * 4, ((16, 100),) * 2, ((40, 100), (80, 100)), ((141, 100),) * 8, ()]


def random_rooms(rng: random.Random, totals: tuple[tuple[int, int], ...], scale: int = 1) -> list[fit.Room]:
    rooms = []
    for i, (m, c) in enumerate(totals):
        mem_free = rng.choice((rng.randint(0, m), m, 0, -rng.randint(1, 4) if rng.random() < 0.1 else m // 2))
        comp_free = rng.choice((0, 10, 30, 50, 70, 100, c, -5 if rng.random() < 0.1 else 0))
        rooms.append(fit.Room(f"GPU-{i}", i, mem_free * scale, comp_free, m * scale, c))
    return rooms


def random_needs(rng: random.Random) -> tuple[fit.Need, ...]:
    """One to three containers (some over several GPUs, some asking memory as a percent), now and then a sidecar
    or a run-once init container, and now and then one too large for any GPU."""
    needs = []
    for k in range(rng.choice((1, 1, 2, 3))):
        count = rng.choice((1, 1, 2, 4, 8, 9))
        if rng.random() < 0.25:
            needs.append(fit.Need(f"c{k}", 0, rng.choice((5, 30, 50)), count=count,
                                  memory_percent=rng.choice((1, 10, 50, 100))))
        else:
            needs.append(fit.Need(f"c{k}", rng.choice((0, 1, 4, 16, 40, 80, 200)), rng.choice((0, 10, 50, 100)),
                                  count=count))
    if rng.random() < 0.2:
        needs.insert(0, fit.Need("side", rng.randint(1, 4), 5, kind=fit.KIND_SIDECAR))
    if rng.random() < 0.1:
        needs.insert(0, fit.Need("setup", rng.randint(1, 16), 10, kind=fit.KIND_INIT))
    return tuple(needs)


@pytest.mark.parametrize("seed", range(80))
def test_columns_judge_every_node_as_judge_all_does(seed: int) -> None:
    """Nodes are set, changed and dropped in a random order (positions are reused); then, for several pods, the
    columns' answers for every node kept are judge_all's on that node's FreeSummary, in the order asked."""
    rng = random.Random(seed)
    columns = Columns()
    rooms: dict[str, list[fit.Room]] = {}
    scale = rng.choice((1, 1, 1, 1000, 10**6))  # memory units of MiB: fields of 32 and 64 bits
    for _ in range(rng.randint(1, 120)):
        name = f"n{rng.randint(0, 60)}"
        if name in rooms and rng.random() < 0.2:
            columns.drop(name)
            del rooms[name]
            continue
        rooms[name] = random_rooms(rng, rng.choice(GPU_SETS), scale)
        assert columns.set(name, rooms[name], fit.FreeSummary.of(rooms[name]))
    assert set(columns.pos) == set(rooms)
    names = list(rooms)
    rng.shuffle(names)
    asked = names[: rng.randint(0, len(names))]
    for _ in range(6):
        needs = random_needs(rng)
        if scale > 1:
            needs = tuple(fit.Need(n.name, n.memory * scale, n.compute, n.kind, n.count, n.memory_percent)
                          for n in needs)
        policy = rng.choice(fit.POLICIES)
        shape = fit.Shape.of(needs)
        expected = fit.judge_all(fit.Shape.of(needs), [fit.FreeSummary.of(rooms[n]) for n in asked], policy)
        assert columns.judge_all(shape, asked, policy) == expected, needs
        # prioritize's scores where the pod fits: score_added's, or None (left to it) only where it caps the units
        # or memory as a percent meets GPUs of several sizes
        fitting = [n for n, judged in zip(asked, expected, strict=True) if judged is None]
        for name, value in zip(fitting, columns.packed(shape, fitting), strict=True):
            free = fit.FreeSummary.of(rooms[name])
            if shape.per_gpu and free.memory_each < 0:
                assert value is None
                continue
            sized = shape.on(free.memory_each) if shape.per_gpu else shape
            added = (sized.steady_memory, sized.steady_compute)
            capped = free[9] is None or added[0] > free[7] or added[1] > free[8]
            assert value == (None if capped else fit.score_added(added, free, fit.PACK)), (name, needs)


@pytest.mark.parametrize(("free", "total", "kept", "width"), [
    (79, 80, True, 2),
    (2**15 - 2, 2**15, True, 2),  # stored as free + 1: the largest a 16-bit field with its guard bit holds
    (2**15 - 1, 2**15, True, 4),
    (2**31, 2**32, True, 8),
    (2**63 - 2, 2**63, True, 8),
    (2**63 - 1, 2**63, False, 2),  # beyond 64 bits: left to judge_all (the columns stay as they were)
])
def test_fields_widen_for_large_units(free: int, total: int, kept: bool, width: int) -> None:
    columns = Columns()
    small = [fit.Room("a", 0, 10, 50, 80, 100)]
    assert columns.set("small", small, fit.FreeSummary.of(small))
    big = [fit.Room("b", 0, free, 100, total, 100), fit.Room("c", 1, 0, 0, total, 100)]
    assert columns.set("big", big, fit.FreeSummary.of(big)) is kept
    assert columns.width == width
    for needs in ((fit.Need("x", 10, 50),), (fit.Need("x", free, 100),), (fit.Need("x", free + 1, 10),),
                  (fit.Need("x", 1, 1, count=2),)):
        shape = fit.Shape.of(needs)
        asked = ["small", "big"] if kept else ["small"]
        frees = [fit.FreeSummary.of([fit.Room("a", 0, 10, 50, 80, 100)])] + ([fit.FreeSummary.of(big)] if kept else [])
        assert columns.judge_all(shape, asked, fit.PACK) == fit.judge_all(shape, frees, fit.PACK)


def test_a_dropped_node_leaves_no_trace_and_its_position_is_reused() -> None:
    columns = Columns()
    full = [fit.Room("a", 0, 80, 100, 80, 100)]
    empty = [fit.Room("a", 0, 0, 0, 80, 100)]
    columns.set("x", full, fit.FreeSummary.of(full))
    columns.set("y", empty, fit.FreeSummary.of(empty))
    shape = fit.Shape.of((fit.Need("c", 40, 50),))
    assert columns.judge_all(shape, ["x", "y"], fit.PACK) == [None, (True, shape.whys[0])]
    where = columns.pos["x"]
    columns.drop("x")
    columns.set("z", empty, fit.FreeSummary.of(empty))
    assert columns.pos["z"] == where
    assert columns.judge_all(shape, ["z", "y"], fit.PACK) == [(True, shape.whys[0])] * 2
    columns.set("z", full, fit.FreeSummary.of(full))  # the same node changed: judged on its new units
    assert columns.judge_all(shape, ["z"], fit.PACK) == [None]
    assert columns.packed(shape, ["z"]) == [fit.score_added((40, 50), fit.FreeSummary.of(full), fit.PACK)] == [5]  # (40/80 + 50/100) / 2


# -- the view: a changed node's answer is judged anew ---------------------------------------------------------------

def _reported(name: str, frees: list[tuple[int, int]]) -> dict[str, Any]:
    n = node(name, [gpu(i, mem=16, mem_free=m, comp=100, comp_free=c) for i, (m, c) in enumerate(frees)])
    doc = json.loads(n["metadata"]["annotations"][NODE_GPU_DEVICES])
    n["metadata"]["annotations"][NODE_GPU_DEVICES] = json.dumps(doc)
    return n


def _fresh(nodes: dict[str, dict[str, Any]], reservations: dict[str, Reservation]) -> ClusterView:
    view = view_of(list(nodes.values()))
    for r in reservations.values():
        view.reserve(r)
    return view


PODS = [pod(containers=[("train", 8, 50)]), pod(containers=[("a", 4, 30), ("b", 4, 30)], sidecars=[("s", 1, 5)]),
        pod(containers=[("train", 12, 100)])]


@pytest.mark.parametrize("seed", range(12))
def test_filter_answers_follow_every_change_of_a_node(seed: int) -> None:
    """Reports change, binds reserve units and are undone, nodes go and come back, in a seeded order; after each
    change every pod shape (asked before: its answers are kept) gets the answer a view built afresh gives."""
    rng = random.Random(seed)

    def frees() -> list[tuple[int, int]]:
        return [(rng.randint(0, 16), rng.choice((0, 30, 50, 100))) for _ in range(rng.randint(1, 4))]

    nodes = {f"n{i}": _reported(f"n{i}", frees()) for i in range(12)}
    view = view_of(list(nodes.values()))
    reservations: dict[str, Reservation] = {}
    changes = {"report": 0, "reserve": 0, "unreserve": 0, "delete": 0}
    for step in range(40):
        for p in PODS:
            names = list(nodes)
            got = filter_nodes(args(p, list(nodes.values())), view)
            want = filter_nodes(args(p, list(nodes.values())), _fresh(nodes, reservations))
            assert (got.node_names, got.failed, got.unresolvable) == (want.node_names, want.failed,
                                                                      want.unresolvable), (seed, step, names)
        kind = rng.choice(("report", "report", "reserve", "unreserve", "delete"))
        name = rng.choice(list(nodes))
        if kind == "report":
            nodes[name] = _reported(name, frees())
            view.apply_node(nodes[name])
        elif kind == "reserve":
            needs = parse_pod_request(rng.choice(PODS)).needs
            fitting = [n for n in nodes if isinstance(fit.place(needs, view.summary(n).rooms or (), fit.PACK),
                                                      fit.Placement)]
            if not fitting:
                continue
            name = rng.choice(fitting)
            placed = fit.place(needs, view.summary(name).rooms or (), fit.PACK)
            assert isinstance(placed, fit.Placement)
            uid = f"uid-{step}"
            reservations[uid] = Reservation(uid, "ml", f"p{step}", needs,
                                            Decision(name, PROFILE_COST_SAVING, utcnow(), dict(placed.gpus)))
            view.reserve(reservations[uid])
        elif kind == "unreserve" and reservations:
            uid = rng.choice(list(reservations))
            del reservations[uid]
            view.unreserve(uid)
        elif kind == "delete" and len(nodes) > 1:
            del nodes[name]
            view.delete_node(name)
            reservations = {u: r for u, r in reservations.items() if r.decision.node != name}
            for uid in [u for u in view.reservations if view.reservations[u].decision.node == name]:
                view.unreserve(uid)
        else:
            continue
        changes[kind] += 1
    assert changes["report"] and changes["reserve"]


def test_a_node_beyond_the_columns_is_judged_one_by_one() -> None:
    """A node whose units need more than 64 bits is not in columns; filter judges it as bind would place."""
    huge = 2**64
    nodes = [node("small", [gpu(0, mem=16, mem_free=16)]), node("huge", [gpu(0, mem=huge, mem_free=huge // 2)]),
             node("full", [gpu(0, mem=huge, mem_free=0)])]
    view = view_of(nodes)
    result = filter_nodes(args(pod(containers=[("train", 8, 50)]), nodes), view)
    assert result.node_names == ["small", "huge"] and set(result.failed) == {"full"}
    assert "huge" not in view._columns.pos and "small" in view._columns.pos
    result = filter_nodes(args(pod(containers=[("train", 8, 50)]), nodes), view)  # its answer kept, asked again
    assert result.node_names == ["small", "huge"] and set(result.failed) == {"full"}
