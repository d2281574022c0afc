"""Over many seeds, the whole DRA path as a cluster runs it: pods of 1-3 containers with claims of their own, a claim
shared by two containers, claims of two requests (a container each, or one container taking both), claims of two
GPUs (`count: 2`), memory-only and compute-only claims; kube-scheduler (the allocator stand-in) allocating them on
the node's ResourceSlice, kubelet (the emulator) preparing, starting and unpreparing them in random order, the agent
or kubelet restarting between allocation and prepare. After every step:
  - every running container has exactly its claim's slices: the GPUs the allocation names, in GPU index order, each
    region it mounts holding that GPU's consumed memory and compute, its environment the (tightest) limits;
  - no GPU is over its capacities, neither in kube-scheduler's books (the claims) nor in the agent's ledger;
  - a claim's CDI spec and folders exist while it is prepared and are gone after unprepare;
  - nothing of a live (prepared) claim is ever removed.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from alnair_agent.config import parse_sim_gpus
from alnair_agent.constants import (
    CDI_SPEC_PREFIX,
    CONTAINER_RUN_DIR,
    ENV_COMPUTE_LIMIT,
    ENV_MEMORY_LIMIT,
    ENV_REGIONS,
    ENV_VISIBLE_DEVICES,
    REGION_FILE_NAME,
)
from alnair_agent.dra.quantity import parse_quantity
from alnair_agent.node.region import Region
from alnair_standins.dra_allocator import AllocationFailed
from alnair_standins.dra_node import DraNode, dra_node
from alnair_standins.kubelet_dra import ContainerView

GiB = 1 << 30
SEEDS = range(24)
MULTI_GPU = ("two-gpus", "both-requests")  # claims one container takes whole, over distinct GPUs


def random_request(rng: random.Random, name: str) -> dict[str, Any]:
    kind = rng.choice(["both", "both", "memory", "compute"])
    r: dict[str, Any] = {"name": name}
    if kind in ("both", "memory"):
        r["memory"] = rng.choice(["1Gi", "2Gi", "3Gi", "4Gi", "1536Mi", "6Gi", "8Gi"])
    if kind in ("both", "compute"):
        r["compute"] = str(rng.choice([5, 10, 20, 25, 30, 50, 70, 100]))
    return r


def random_pod(rng: random.Random, i: int) -> tuple[list[tuple[str, list[dict[str, Any]]]], dict[str, str],
                                                   list[tuple[str, list[tuple[str, str | None]]]]]:
    """(claims to create: (name, requests)), the pod's claim entries, its containers and what each names."""
    shape = rng.choice(["own", "own", "shared", "two-requests", "two-gpus", "both-requests"])
    n = rng.randint(1, 3)
    containers = [f"c{j}" for j in range(n)]
    if shape in ("two-gpus", "both-requests"):  # one container over two GPUs, the others a claim each
        claim = f"pod{i}-{shape}"
        if shape == "two-gpus":
            requests = [{**random_request(rng, "gpus"), "count": 2}]
        else:
            requests = [random_request(rng, "a"), random_request(rng, "b")]
        claims = [(claim, requests)]
        entries = {"gpu": claim}
        refs = [(containers[0], [("gpu", None)])]
        for c in containers[1:]:
            claims.append((f"pod{i}-{c}", [random_request(rng, "gpu")]))
            entries[c] = f"pod{i}-{c}"
            refs.append((c, [(c, None)]))
        return claims, entries, refs
    if shape == "shared" and n >= 2:
        claim = f"pod{i}-shared"
        claims = [(claim, [random_request(rng, "gpu")])]
        entries = {"gpu": claim}
        refs = [(containers[0], [("gpu", None)]), (containers[1], [("gpu", "gpu")])]
        for c in containers[2:]:
            claims.append((f"pod{i}-{c}", [random_request(rng, "gpu")]))
            entries[c] = f"pod{i}-{c}"
            refs.append((c, [(c, None)]))
        return claims, entries, refs
    if shape == "two-requests" and n >= 2:
        claim = f"pod{i}-two"
        claims = [(claim, [random_request(rng, "a"), random_request(rng, "b")])]
        refs = [(containers[0], [("gpu", "a")]), (containers[1], [("gpu", "b")])]
        entries = {"gpu": claim}
        for c in containers[2:]:
            claims.append((f"pod{i}-{c}", [random_request(rng, "gpu")]))
            entries[c] = f"pod{i}-{c}"
            refs.append((c, [(c, None)]))
        return claims, entries, refs
    claims = [(f"pod{i}-{c}", [random_request(rng, "gpu")]) for c in containers]
    return claims, {c: f"pod{i}-{c}" for c in containers}, [(c, [(c, None)]) for c in containers]


def expected(node: DraNode, pod: dict[str, Any]) -> dict[str, list[tuple[str, int, int]]]:
    """Per container: (GPU UUID, memory bytes, compute percent) of each result of its claim it takes, in GPU index
    order."""
    uuids = {d["name"]: d["attributes"]["uuid"]["string"] for s in node.slices() for d in s["spec"]["devices"]}
    uuids |= {f"gpu-{g.index}": g.uuid for g in node.running.agent.gpus}  # devices out of the slice since
    ns = pod["metadata"]["namespace"]
    entries = {e["name"]: e["resourceClaimName"] for e in pod["spec"]["resourceClaims"]}
    out = {}
    for c in pod["spec"]["containers"]:
        [ref] = c["resources"]["claims"]
        claim = node.api.claim(ns, entries[ref["name"]])
        results = claim["status"]["allocation"]["devices"]["results"]
        mine = sorted((r for r in results if ref.get("request") in (None, r["request"])),
                      key=lambda r: int(r["device"].split("-")[1]))
        out[c["name"]] = [(uuids[r["device"]], int(parse_quantity(r["consumedCapacity"]["memory"])),
                           int(parse_quantity(r["consumedCapacity"]["compute"]))) for r in mine]
    return out


def check_container(view: ContainerView, want: list[tuple[str, int, int]]) -> None:
    assert view.envs[ENV_VISIBLE_DEVICES] == ",".join(gpu for gpu, _, _ in want)
    caps = [compute if 0 < compute < 100 else 0 for _, _, compute in want]
    memory = min((m for _, m, _ in want if m), default=0)  # one GPU: its own; several: the tightest
    cap = min((c for c in caps if c), default=0)
    assert view.envs.get(ENV_MEMORY_LIMIT) == (str(memory) if any(m for _, m, _ in want) else None)
    assert view.envs.get(ENV_COMPUTE_LIMIT) == (str(cap) if any(c for _, _, c in want) else None)
    folders = [CONTAINER_RUN_DIR] + [f"{CONTAINER_RUN_DIR}-{k}" for k in range(1, len(want))]
    if len(want) > 1:
        assert view.envs[ENV_REGIONS] == ",".join(f"{f}/{REGION_FILE_NAME}" for f in folders)
    assert len({view.mounts[f][0] for f in folders}) == len(want)
    for folder, (_, m, _), c in zip(folders, want, caps, strict=True):
        region = Region.open(Path(view.mounts[folder][0]) / REGION_FILE_NAME)
        try:
            assert (region.memory_limit, region.compute_limit) == (m, c)
        finally:
            region.close()


def check_capacity(node: DraNode) -> None:
    """No device over its capacity in the claims, and the agent's ledger agrees (never below zero)."""
    held: dict[str, list[int]] = {}
    for claim in node.api.claims():
        for r in (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []:
            h = held.setdefault(r["device"], [0, 0])
            h[0] += int(parse_quantity(r["consumedCapacity"]["memory"]))
            h[1] += int(parse_quantity(r["consumedCapacity"]["compute"]))
    for g in node.running.agent.gpus:
        memory, compute = held.get(f"gpu-{g.index}", [0, 0])
        assert memory <= (g.memory_bytes // GiB) * GiB and compute <= 100
    for room in node.running.agent.ledger.rooms():
        assert room.memory_free >= 0 and room.compute_free >= 0


def check_ledger(node: DraNode, prepared: set[str], finished: set[str]) -> None:
    records = [a for a in node.running.agent.ledger.allocations.values() if a.claim is not None]
    by_claim = {a.claim.uid for a in records if a.claim is not None}
    assert prepared <= by_claim, "a prepared claim lost its slice"
    assert not (finished & by_claim), "an unprepared claim kept its slice"
    for a in records:
        assert (node.settings.workspace / a.id / "run" / REGION_FILE_NAME).is_file()
    specs = {p.name[len(CDI_SPEC_PREFIX):-len(".json")] for p in node.settings.cdi_dir.glob(CDI_SPEC_PREFIX + "*")}
    assert prepared <= specs and not (finished & specs)


@pytest.mark.parametrize("seed", SEEDS)
async def test_every_container_gets_exactly_its_claims_slice_whatever_the_order(root, api, seed):
    rng = random.Random(seed)
    gpus = ",".join(f"{rng.choice([8, 12, 16, 24])}GiB" for _ in range(rng.randint(2, 3)))
    async with dra_node(root, api, sim_gpus=parse_sim_gpus(gpus)) as node:
        scheduled: list[dict[str, Any]] = []  # allocated, not started yet
        running: list[dict[str, Any]] = []
        prepared: set[str] = set()  # claim UIDs prepared and not unprepared
        finished: set[str] = set()
        for i in range(rng.randint(4, 7)):
            claims, entries, refs = random_pod(rng, i)
            for name, requests in claims:
                node.claim(name, requests, distinct=[[]] if name.endswith(MULTI_GPU) else None)
            pod = node.pod(f"pod{i}", entries, refs)
            try:
                node.schedule(pod, list(dict.fromkeys(entries.values())))
                scheduled.append(pod)
            except AllocationFailed:
                pass  # no room on the node: kube-scheduler leaves it pending
            check_capacity(node)
        while scheduled or running:
            roll = rng.random()
            if roll < 0.12:
                await node.restart_agent()  # between allocation and prepare, or with claims prepared
            elif roll < 0.22:
                await node.kubelet.restart()
            elif scheduled and (not running or roll < 0.62):
                pod = scheduled.pop(rng.randrange(len(scheduled)))
                views = await node.start(pod)
                for name, want in expected(node, pod).items():
                    check_container(views[name], want)
                prepared |= {ref.uid for ref in node.refs(pod).values()}
                running.append(pod)
            elif running:
                pod = running.pop(rng.randrange(len(running)))
                uids = {ref.uid for ref in node.refs(pod).values()}
                await node.finish(pod)
                prepared -= uids
                finished |= uids
            check_capacity(node)
            check_ledger(node, prepared, finished)
            for pod in running:  # containers still running keep exactly their slices
                want = expected(node, pod)
                for cname, view in node.start_containers(pod).items():
                    check_container(view, want[cname])
        assert not [a for a in node.running.agent.ledger.allocations.values() if a.claim is not None]
