"""One placement truth, end to end: the real extender decides at bind, the real agents carry it out, under a
kube-scheduler emulator and kubelet emulators that admit pods the way kubelet does (resources of a container in
random order, pods created in the same second). Over many seeds, every container gets exactly its own limits on
the GPU the extender decided, nothing is double-booked, and ending a pod touches nothing else."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from alnair_agent.constants import (
    ENV_ALLOCATION_ID,
    ENV_COMPUTE_LIMIT,
    ENV_MEMORY_LIMIT,
    ENV_VISIBLE_DEVICES,
)
from alnair_agent.node.decision import (
    ALLOCATED_ANNOTATION,
    PLACEMENT_ANNOTATION,
    parse_allocated,
    parse_decision,
)
from alnair_agent.node.fit import percent_units
from alnair_agent.node.gpu_devices import report_of_node
from alnair_agent.node.region import Region
from alnair_standins.apiserver import make_pod
from alnair_standins.cluster import MEM, SM, Cluster, alnair_pod, cluster
from alnair_standins.node import remove_tree, short_tmp

pytestmark = pytest.mark.timeout(120)

GIB = 1 << 30
PROFILES = ("alnair-cost-saving", "alnair-high-performance")


@pytest.fixture
def root():
    path = short_tmp()
    yield path
    remove_tree(path)


def random_pods(rng: random.Random, count: int, budget_memory: int, budget_compute: int) -> list[dict[str, Any]]:
    """Pods of one to three containers (memory-only, compute-only, both) within the given total budget."""
    pods = []
    for n in range(count):
        containers = []
        for k in range(rng.choice((1, 1, 2, 3))):
            shape = rng.choice(("both", "both", "memory", "compute"))
            c: dict[str, Any] = {"name": f"c{k}"}
            if shape in ("both", "memory"):
                c["memory"] = rng.randint(1, 4)
            if shape in ("both", "compute"):
                c["compute"] = rng.choice((5, 10, 20, 30))
            containers.append(c)
        mem = sum(c.get("memory", 0) for c in containers)
        comp = sum(c.get("compute", 0) for c in containers)
        if mem > budget_memory or comp > budget_compute:
            break
        budget_memory -= mem
        budget_compute -= comp
        pods.append(alnair_pod(f"p{n}", containers, profile=rng.choice(PROFILES)))
    return pods


def check_cluster(c: Cluster, gpu_memory_units: dict[str, int]) -> None:
    """Every admitted container: one allocation and one folder per GPU for both resources, its own limits, on the
    GPU(s) the extender decided (a multi-GPU container: distinct GPUs of its node, its units split evenly over
    them, each GPU's region with the per-GPU limits; memory asked as a percent: that share of each GPU, converted
    there); and no GPU holds more units than it has."""
    from alnair_agent.node.edits import part_run_dir
    from alnair_standins.kubelet import ContainerKey

    held: Counter[tuple[str, str]] = Counter()
    for uid, (node_name, adm) in c.admitted().items():
        try:
            pod = c.api.pod(adm.namespace, adm.pod)
        except KeyError:
            continue  # deleted since: kubelet freed its devices
        if pod["metadata"]["uid"] != uid or pod["status"].get("phase") in ("Succeeded", "Failed"):
            continue
        decision = parse_decision(pod["metadata"]["annotations"][PLACEMENT_ANNOTATION])
        assert decision.node == node_name
        node = c.nodes[node_name]
        on_node = set(node.agent.inventory.gpus) if node.agent and node.agent.inventory else set()
        for spec in pod["spec"]["containers"]:
            limits = spec["resources"]["limits"]
            answers = adm.answers.get(spec["name"], {})
            wanted = {r: int(limits.get(r, 0)) for r in (MEM, SM)}
            count = int(limits.get("alnair/vgpu-count", 1))
            percent = int(limits.get("alnair/vgpu-memory-percent", 0))
            each = {r: n // count for r, n in wanted.items()}
            assert set(answers) == {r for r, n in wanted.items() if n}, spec["name"]
            gpus = decision.gpus[spec["name"]]
            memory_on = {g: percent_units(percent, gpu_memory_units[g]) if percent else each[MEM] for g in gpus}
            if percent:
                for g in gpus:
                    held[(g, MEM)] += memory_on[g]
            assert len(gpus) == len(set(gpus)) == count, (spec["name"], gpus)
            assert set(gpus) <= on_node, "a container's GPUs are all on its node"
            envs = [dict(a.envs) for a in answers.values()]
            mounts = [{m.container_path: m.host_path for m in a.mounts} for a in answers.values()]
            assert len({e[ENV_ALLOCATION_ID] for e in envs}) == 1, "one container, one allocation"
            for k in range(count):
                assert len({m[part_run_dir(k)] for m in mounts}) == 1, "one container, one folder per GPU"
            assert len({m[part_run_dir(k)] for m in mounts[:1] for k in range(count)}) == count
            assert {e[ENV_VISIBLE_DEVICES] for e in envs} == {",".join(gpus)}
            for e in envs:  # both answers name the same limits (kubelet merges them first-wins)
                if wanted[MEM] or percent:  # the tightest of its GPUs' (a share differs between GPU sizes)
                    assert e[ENV_MEMORY_LIMIT] == str(min(memory_on.values()) * GIB)
                if wanted[SM]:
                    assert e[ENV_COMPUTE_LIMIT] == str(each[SM] if each[SM] < 100 else 0)
            for k in range(count):
                region = Region.open(Path(mounts[0][part_run_dir(k)]) / "region")
                try:
                    assert (region.memory_limit, region.compute_limit) == (
                        memory_on[gpus[k]] * GIB, each[SM] if 0 < each[SM] < 100 else 0)
                finally:
                    region.close()
            assigned = node.kubelet.assigned[ContainerKey(adm.namespace, adm.pod, spec["name"])]
            for resource, ids in assigned.items():
                assert len(ids) == wanted[resource]
                per_gpu = Counter(i.split("::")[0] for i in ids)
                assert set(per_gpu) == set(gpus) and set(per_gpu.values()) == {each[resource]}, per_gpu
                for gpu, n in per_gpu.items():
                    held[(gpu, resource)] += n
    for (gpu, resource), units in held.items():
        assert units <= (gpu_memory_units[gpu] if resource == MEM else 100), (gpu, resource, units)


def gpu_units(c: Cluster) -> dict[str, int]:
    return {g.uuid: g.units[MEM] for n in c.nodes.values() if n.agent and n.agent.inventory
            for g in n.agent.inventory.gpus.values()}


async def wait_for(predicate, timeout: float = 20.0, what: str = "") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        await asyncio.sleep(0.02)


def no_locks(c: Cluster) -> bool:
    assert c.view is not None
    return all(not c.view.locked(n) for n in c.nodes)


def allocated_everywhere(c: Cluster) -> bool:
    for _uid, (_, adm) in c.admitted().items():
        pod = c.api.pod(adm.namespace, adm.pod)
        if ALLOCATED_ANNOTATION not in pod["metadata"].get("annotations", {}):
            return False
    return True


@pytest.mark.parametrize("seed", range(9))
async def test_every_container_gets_its_own_limits_on_the_decided_gpu(root: Path, seed: int) -> None:
    """Pods created in the same second; kubelet admits each batch of waiting pods in order, in reverse or at
    random, and each container's resources in random order."""
    rng = random.Random(seed)
    order = ("fifo", "reverse", "random")[seed % 3]
    async with cluster(root, {"node-a": "2x16GiB", "node-b": "2x16GiB"}, seed, admission_order=order) as c:
        pods = random_pods(rng, 14, budget_memory=40, budget_compute=300)
        for pod in pods:  # created in the same second, as a ReplicaSet does
            c.api.add_pod(pod)
        await c.settle(len(pods), timeout=60)
        assert c.refused() == {}
        check_cluster(c, gpu_units(c))
        await wait_for(lambda: allocated_everywhere(c), what="allocated annotations")
        for _uid, (_, adm) in c.admitted().items():  # the pod's record names the GPU each container runs on
            pod = c.api.pod(adm.namespace, adm.pod)
            granted = parse_allocated(pod["metadata"]["annotations"][ALLOCATED_ANNOTATION])
            for name, answers in adm.answers.items():
                env = dict(next(iter(answers.values())).envs)
                assert ",".join(granted[name].gpus or (granted[name].gpu,)) == env[ENV_VISIBLE_DEVICES]
                assert granted[name].allocation == env[ENV_ALLOCATION_ID]
        await wait_for(lambda: no_locks(c), what="no node lock left")

        # Ending some pods removes their folders and only theirs.
        admitted = list(c.admitted().values())
        rng.shuffle(admitted)
        ending, staying = admitted[: len(admitted) // 2], admitted[len(admitted) // 2:]
        folders = {adm.pod: {Path(m.host_path).parent for a in adm.answers.values() for r in a.values()
                             for m in r.mounts if m.container_path == "/run/alnair"} for _, adm in admitted}
        for i, (_, adm) in enumerate(ending):
            if i % 2:
                c.api.delete_pod(adm.namespace, adm.pod)
            else:
                c.api.set_phase(adm.namespace, adm.pod, "Succeeded")
        gone = {f for _, adm in ending for f in folders[adm.pod]}
        await wait_for(lambda: not any(f.exists() for f in gone), what="ended pods' folders removed")
        assert all(f.is_dir() for _, adm in staying for f in folders[adm.pod])


async def test_burst_of_fifty_pods_onto_five_nodes_has_no_refusal(root: Path) -> None:
    nodes = {f"node-{i}": "2x16GiB" for i in range(5)}
    rng = random.Random(50)
    async with cluster(root, nodes, seed=50) as c:
        pods = []
        for n in range(50):
            containers = [{"name": "main", "memory": rng.choice((1, 2, 4)), "compute": rng.choice((5, 10, 20))}]
            if n % 5 == 0:
                containers.append({"name": "side", "memory": 1})
            pods.append(alnair_pod(f"burst-{n}", containers, profile=PROFILES[n % 2]))
        for pod in pods:
            c.api.add_pod(pod)
        await c.settle(50, timeout=90)
        assert c.refused() == {}
        assert len(c.admitted()) == 50
        check_cluster(c, gpu_units(c))
        await wait_for(lambda: no_locks(c), what="no node lock left")


def hold_kubelet_after(c: Cluster, node: str, calls: int) -> tuple[asyncio.Event, asyncio.Event]:
    """kubelet stops after its `calls`-th Allocate answer on `node` (before recording it, as kubelet does) until
    released: between two resources of a container, or two containers of a pod. Returns (held, release)."""
    held, release = asyncio.Event(), asyncio.Event()
    answered = 0
    for view in c.nodes[node].kubelet.plugins.values():
        async def allocate(request: Any, _real: Any = view.stub.Allocate, **kwargs: Any) -> Any:
            nonlocal answered
            response = await _real(request, **kwargs)
            answered += 1
            if answered == calls:
                held.set()
                await release.wait()
            return response
        view.stub.Allocate = allocate
    return held, release


@pytest.mark.parametrize("seed", range(12))
async def test_node_report_set_between_a_pods_allocate_calls_counts_all_of_it(root: Path, seed: int) -> None:
    """kubelet allocates a pod one container and one resource at a time, and the agent may report its node in
    between. The pod's confirmation releases the node lock at once, while node reports are rate-limited (here they
    fail for a while): the extender may bind the next pod on that report. It must count every unit of the pod,
    those allocated after it too, or the next pod is refused for them (seen: 1 burst in 16 on a loaded CI)."""
    rng = random.Random(seed)
    async with cluster(root, {"node-a": "2x16GiB"}, seed) as c:
        agent = c.nodes["node-a"].agent
        assert agent is not None and agent.allocator is not None and agent.reconciler is not None
        containers: list[dict[str, Any]] = [{"name": "main", "memory": rng.randint(1, 6),
                                             "compute": rng.choice((5, 10, 20, 30))}]
        side = rng.choice(("memory", "compute", "both", None))
        if side is not None:
            containers.append({"name": "side", **({"memory": rng.randint(1, 4)} if side != "compute" else {}),
                               **({"compute": rng.choice((5, 10))} if side != "memory" else {})})
        calls = sum(1 for spec in containers for r in ("memory", "compute") if r in spec)
        held, release = hold_kubelet_after(c, "node-a", rng.randint(1, calls - 1))
        c.api.add_pod(alnair_pod("first", containers, profile=PROFILES[seed % 2]))
        await asyncio.wait_for(held.wait(), 20)

        # The agent reports its node now, between two of the pod's Allocate calls, and the extender reads it.
        await agent.reconciler.once()
        assert await agent.kubernetes.annotations.flush(5)
        written = report_of_node(c.api.node("node-a"))
        assert c.view is not None
        await wait_for(lambda: c.view.nodes["node-a"].report == written, what="the extender reading the report")
        # No later report reaches the extender while kubelet finishes the pod and the agent confirms it.
        c.api.fail_next("patch_node", status=503, times=1_000_000)
        release.set()
        await c.settle(1, timeout=30)
        assert c.refused() == {}
        await wait_for(lambda: no_locks(c), what="the confirmation releasing the node lock")
        assert c.view.summary("node-a").rooms == tuple(sorted(agent.ledger.rooms(), key=lambda r: r.index))

        # The next pod takes what the extender sees free on the first pod's GPU, and gets it.
        [gpu] = parse_decision(c.api.pod_annotations("default", "first")[PLACEMENT_ANNOTATION]).gpus["main"]
        room = next(r for r in c.view.summary("node-a").rooms or () if r.uuid == gpu)
        rest = {k: n for k, n in (("memory", room.memory_free), ("compute", room.compute_free)) if n}
        c.api.add_pod(alnair_pod("second", [{"name": "main", **rest}]))
        await c.settle(2, timeout=30)
        c.api.clear_failures()
        assert c.refused() == {}
        check_cluster(c, gpu_units(c))


async def one_pod_bound_not_admitted(c: Cluster, name: str) -> tuple[str, str]:
    """Stop every kubelet from admitting, create a pod, and wait until the extender has bound it."""
    for node in c.nodes.values():
        node.driver.paused.clear()
    c.api.add_pod(alnair_pod(name, [{"name": "main", "memory": 3, "compute": 30}]))
    await wait_for(lambda: bool(c.api.pod("default", name)["spec"].get("nodeName")), what="bound")
    pod = c.api.pod("default", name)
    return pod["spec"]["nodeName"], pod["metadata"]["uid"]


def resume(c: Cluster) -> None:
    for node in c.nodes.values():
        node.driver.paused.set()


@pytest.mark.parametrize("restart", ["agent", "extender"])
async def test_restart_between_bind_and_admission_leaves_no_stuck_lock(root: Path, restart: str) -> None:
    async with cluster(root, {"node-a": "2x16GiB"}, seed=7) as c:
        node, uid = await one_pod_bound_not_admitted(c, "first")
        assert c.view is not None and c.view.locked(node) == "default/first"
        c.api.add_pod(alnair_pod("second", [{"name": "main", "memory": 2, "compute": 10}]))
        if restart == "agent":
            await c.stop_agent(node)
            await c.start_agent(node)
        else:
            await c.restart_extender()
            await wait_for(lambda: c.view is not None and c.view.locked(node) == "default/first",
                           what="the lock rebuilt from the pod")
        resume(c)
        await c.settle(2, timeout=30)
        assert c.refused() == {}
        check_cluster(c, gpu_units(c))
        await wait_for(lambda: no_locks(c), what="no node lock left")


async def test_bound_pod_deleted_before_admission_leaks_nothing(root: Path) -> None:
    async with cluster(root, {"node-a": "1x16GiB"}, seed=3) as c:
        node, uid = await one_pod_bound_not_admitted(c, "doomed")
        assert c.view is not None and c.view.locked(node)
        c.api.delete_pod("default", "doomed")
        await wait_for(lambda: not c.view.locked(node), what="lock released by the deletion")
        summary = c.view.summary(node)
        assert summary.rooms is not None and summary.rooms[0].memory_free == 16
        resume(c)
        # The whole GPU is there for the next pod.
        c.api.add_pod(alnair_pod("whole", [{"name": "main", "memory": 16, "compute": 100}]))
        await c.settle(1, timeout=30)
        assert c.refused() == {}
        agent = c.nodes[node].agent
        assert agent is not None and agent.allocator is not None
        assert [a.pod_name for a in agent.ledger.allocations.values()] == ["whole"]


async def test_pod_that_bypasses_the_extender_is_refused_with_the_fix(root: Path) -> None:
    async with cluster(root, {"node-a": "1x16GiB"}, seed=4) as c:
        c.api.add_pod(make_pod("stray", node="node-a", containers=[{"name": "main", "memory": 2, "compute": 10}]))
        await c.settle(1, timeout=30)
        [why] = c.refused().values()
        assert "not placed by alnair-scheduler" in why and "schedulerName" in why
        assert "ALNAIR_PLACE_UNSCHEDULED" in why
        agent = c.nodes["node-a"].agent
        assert agent is not None and agent.allocator is not None and not agent.ledger.allocations


async def test_operator_may_let_the_agent_place_unscheduled_pods(root: Path) -> None:
    async with cluster(root, {"node-a": "2x16GiB"}, seed=5, place_unscheduled=True) as c:
        c.api.add_pod(make_pod("stray", node="node-a", containers=[{"name": "main", "memory": 2, "compute": 10},
                                                                     {"name": "aux", "compute": 20}]))
        await c.settle(1, timeout=30)
        assert c.refused() == {}
        [(_, adm)] = c.admitted().values()
        assert set(adm.answers) == {"main", "aux"}
        await wait_for(lambda: allocated_everywhere(c), what="allocated annotation")


async def test_extender_sends_no_pod_to_a_node_whose_agent_is_gone(root: Path) -> None:
    async with cluster(root, {"node-a": "1x16GiB", "node-b": "1x16GiB"}, seed=6) as c:
        report = json.loads(c.api.node_annotations("node-a")["ai.centaurus.io/gpu-devices"])
        report["heartbeat"] = "2020-01-01T00:00:00.000Z"  # an agent that stopped reporting long ago
        await c.stop_agent("node-a")
        c.api.modify_node = None  # type: ignore[attr-defined]
        node = c.api.node("node-a")
        node["metadata"]["annotations"]["ai.centaurus.io/gpu-devices"] = json.dumps(report)
        c.api._commit_node("node-a", c.api._nodes["node-a"], node)
        assert c.view is not None
        await wait_for(lambda: c.view.summary("node-a").rooms is None, what="stale node out of the view")
        assert "has not reported" in c.view.summary("node-a").error
        for n in range(3):
            c.api.add_pod(alnair_pod(f"p{n}", [{"name": "main", "memory": 2}]))
        await c.settle(3, timeout=30)
        assert {node for node, _ in c.admitted().values()} == {"node-b"}


async def test_units_of_a_deleted_pod_come_back_at_once(root: Path) -> None:
    """No phantom holds: a pod deleted after admission frees its units for the next pod as soon as the pod watch
    or kubelet says so, not a resync later, and the next pod is never refused for them."""
    async with cluster(root, {"node-a": "1x16GiB"}, seed=8, backoff_initial_s=0.2) as c:
        c.api.add_pod(alnair_pod("first", [{"name": "main", "memory": 16, "compute": 100}]))
        await c.settle(1, timeout=30)
        c.api.delete_pod("default", "first")
        c.api.add_pod(alnair_pod("second", [{"name": "main", "memory": 16, "compute": 100}]))
        started = time.monotonic()
        await c.settle(2, timeout=30)
        assert c.refused() == {}
        assert time.monotonic() - started < 10
        check_cluster(c, gpu_units(c))
