"""Several GPUs for one container through DRA: a claim whose allocation names several devices (one request of
`count: 2`, or two requests the container names together) gives the container exactly those GPUs, in GPU index
order, each GPU's limits in its own region, as the device plugin's `alnair/vgpu-count` does; a claim that cannot be
met is refused naming why and leaves nothing made; unprepare frees every GPU of it. Through the real interfaces:
kubelet's DRA calls over unix-socket gRPC (the emulator), claims on the API server stand-in, allocated by the
allocator stand-in as kube-scheduler allocates them, containers made by the emulated runtime from the CDI specs."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path
from typing import Any

import pytest
import yaml
from service_util import wait_until

from alnair_agent.config import parse_sim_gpus
from alnair_agent.constants import (
    CONTAINER_RUN_DIR,
    DRA_DRIVER,
    ENV_COMPUTE_LIMIT,
    ENV_CUDA_DEVICE_ORDER,
    ENV_MEMORY_LIMIT,
    ENV_REGION,
    ENV_REGIONS,
    ENV_VISIBLE_DEVICES,
    USAGE_ANNOTATION,
)
from alnair_agent.node.region import Region
from alnair_standins.dra_allocator import AllocationFailed
from alnair_standins.dra_node import DraNode, dra_node
from alnair_standins.kubelet_dra import Claim, ContainerView, DraCallFailed

GiB = 1 << 30
ROOT = Path(__file__).resolve().parents[1]
INDEX = 'device.attributes["gpu.alnair.centaurus.io"].index == {}'


def uuids(node: DraNode) -> list[str]:
    return [g.uuid for g in sorted(node.running.agent.gpus, key=lambda g: g.index)]


def regions(view: ContainerView) -> list[tuple[int, int]]:
    """(memory limit, compute cap) of each region the container's ALNAIR_REGIONS names, read at its mount's host
    folder, in its order."""
    out = []
    for path in view.envs[ENV_REGIONS].split(","):
        folder, name = path.rsplit("/", 1)
        region = Region.open(Path(view.mounts[folder][0]) / name)
        try:
            out.append((region.memory_limit, region.compute_limit))
        finally:
            region.close()
    return out


def nothing_of(node: DraNode, claim_uid: str) -> None:
    """No record, folder or CDI spec of the claim is left."""
    assert not [a for a in node.running.agent.ledger.allocations.values() if a.claim and a.claim.uid == claim_uid]
    assert not (node.settings.cdi_dir / f"alnair.centaurus.io-gpu_{claim_uid}.json").exists()
    held = {a.id for a in node.running.agent.ledger.allocations.values()}
    assert {p.name for p in node.settings.workspace.iterdir() if not p.name.startswith(".")} == held


async def refusal(node: DraNode, ref: Claim) -> str:
    """One NodePrepareResources call for a claim that must be refused: its error; nothing of it is left made."""
    errors = await node.kubelet.prepare_once(DRA_DRIVER, [ref])
    nothing_of(node, ref.uid)
    return errors[ref.uid]


async def test_a_claim_of_two_gpus_gives_its_container_both_each_with_its_slice_and_unprepare_frees_both(root, api):
    async with dra_node(root, api) as node:
        node.claim("pair", [{"name": "gpus", "memory": "4Gi", "compute": "30", "count": 2}], distinct=[["gpus"]])
        pod = node.pod("p", {"gpu": "pair"}, [("main", [("gpu", None)]), ("side", [("gpu", "gpus")])])
        [claim] = node.schedule(pod, ["pair"])
        results = claim["status"]["allocation"]["devices"]["results"]
        assert sorted(r["device"] for r in results) == ["gpu-0", "gpu-1"]
        views = await node.start(pod)
        main = views["main"]
        g0, g1 = uuids(node)
        assert main.envs[ENV_VISIBLE_DEVICES] == f"{g0},{g1}" and main.envs[ENV_CUDA_DEVICE_ORDER] == "PCI_BUS_ID"
        assert main.envs[ENV_REGIONS] == "/run/alnair/region,/run/alnair-1/region"
        assert main.envs[ENV_REGION] == "/run/alnair/region"
        assert (main.envs[ENV_MEMORY_LIMIT], main.envs[ENV_COMPUTE_LIMIT]) == (str(4 * GiB), "30")
        assert regions(main) == [(4 * GiB, 30), (4 * GiB, 30)]
        assert main.mounts[CONTAINER_RUN_DIR] != main.mounts["/run/alnair-1"]
        assert views["side"].envs == main.envs and views["side"].mounts == main.mounts  # the same request: the same
        assert len(main.cdi_ids) == 1  # one CDI device for the group, not one per GPU to collide
        records = sorted(node.running.agent.ledger.allocations.values(), key=lambda a: a.part)
        assert [(a.gpu_uuid, a.part, a.gpus) for a in records] == [(g0, 0, [g0, g1]), (g1, 1, [g0, g1])]
        rooms = node.running.agent.ledger.rooms()
        assert [(r.memory_free, r.compute_free) for r in rooms] == [(12, 70), (12, 70)]
        # the usage annotation keeps each GPU apart, under the containers that share the group
        await wait_until(lambda: "main,side" in json.loads(
            api.pod_annotations("default", "p").get(USAGE_ANNOTATION, "{}")), 5)
        entry = json.loads(api.pod_annotations("default", "p")[USAGE_ANNOTATION])["main,side"]
        assert [g["gpu"] for g in entry["gpus"]] == [g0, g1] and entry["memory_limit_bytes"] == 8 * GiB
        ref = node.refs(pod)["gpu"]
        await node.finish(pod)
        nothing_of(node, ref.uid)
        assert [(r.memory_free, r.compute_free) for r in node.running.agent.ledger.rooms()] == [(16, 100), (16, 100)]


async def test_two_requests_a_container_names_together_are_its_gpus_in_index_order_each_with_its_limits(root, api):
    """Requests on GPU 1 (8 GiB, 60 %) and GPU 0 (2 GiB, 10 %), allocated in that order: the container naming the
    claim sees GPU 0 first; each region holds its own GPU's slice; the environment's limits (what the shim keeps
    where it must refuse a region) are the tightest of the two."""
    async with dra_node(root, api, sim_gpus=parse_sim_gpus("3x16GiB")) as node:
        node.claim("duo", [{"name": "big", "memory": "8Gi", "compute": "60", "selectors": [INDEX.format(1)]},
                           {"name": "small", "memory": "2Gi", "compute": "10", "selectors": [INDEX.format(0)]}])
        pod = node.pod("p", {"gpu": "duo"}, [("main", [("gpu", None)])])
        [claim] = node.schedule(pod, ["duo"])
        assert [r["device"] for r in claim["status"]["allocation"]["devices"]["results"]] == ["gpu-1", "gpu-0"]
        view = (await node.start(pod))["main"]
        g0, g1, _ = uuids(node)
        assert view.envs[ENV_VISIBLE_DEVICES] == f"{g0},{g1}"
        assert regions(view) == [(2 * GiB, 10), (8 * GiB, 60)]
        assert (view.envs[ENV_MEMORY_LIMIT], view.envs[ENV_COMPUTE_LIMIT]) == (str(2 * GiB), "10")
        # kubelet's answer: every device, by the request containers name, the group's CDI device once
        devices = node.kubelet.prepared[node.refs(pod)["gpu"].uid]
        assert [(list(d.request_names), d.device_name, len(d.cdi_device_ids)) for d in devices] == [
            (["small"], "gpu-0", 1), (["big"], "gpu-1", 0)]
        await node.finish(pod)
        nothing_of(node, node.refs(pod)["gpu"].uid)


async def test_a_two_gpu_claim_survives_agent_and_kubelet_restarts_with_the_same_container(root, api):
    async with dra_node(root, api) as node:
        node.claim("pair", [{"name": "gpus", "memory": "3Gi", "compute": "20", "count": 2}], distinct=[["gpus"]])
        pod = node.pod("p", {"gpu": "pair"}, [("main", [("gpu", None)])])
        node.schedule(pod, ["pair"])
        await node.restart_agent()  # between allocation and prepare
        before = (await node.start(pod))["main"]
        ref = node.refs(pod)["gpu"]
        ids = node.kubelet.cdi_ids(ref.uid)
        (node.settings.cdi_dir / f"alnair.centaurus.io-gpu_{ref.uid}.json").unlink()  # a tmpfs cleared meanwhile
        await node.restart_agent()  # the spec is rebuilt from the records
        since = sum(d == DRA_DRIVER for d, _ in node.kubelet.registrations)
        await node.kubelet.restart()
        await node.kubelet.wait_registered(DRA_DRIVER, since=since)
        assert await node.kubelet.prepare_once(DRA_DRIVER, [ref]) == {}  # kubelet's retry: the same devices
        assert node.kubelet.cdi_ids(ref.uid) == ids
        after = node.kubelet.start_container("default", "p", "main", [(ref, None)])
        assert after.envs == before.envs and after.mounts == before.mounts
        assert len(node.running.agent.ledger.allocations) == 2
        await node.finish(pod)
        nothing_of(node, ref.uid)


async def test_a_claim_naming_one_gpu_twice_is_refused_with_the_fix_and_leaves_nothing(root, api):
    async with dra_node(root, api) as node:
        node.claim("twice", [{"name": "gpus", "memory": "2Gi", "count": 2}])  # no distinctAttribute
        pod = node.pod("p", {"gpu": "twice"}, [("main", [("gpu", None)])])
        [claim] = node.schedule(pod, ["twice"])
        assert [r["device"] for r in claim["status"]["allocation"]["devices"]["results"]] == ["gpu-0", "gpu-0"]
        error = await refusal(node, node.refs(pod)["gpu"])
        assert "name device gpu-0 twice" in error and "distinctAttribute: gpu.alnair.centaurus.io/uuid" in error


async def test_containers_naming_overlapping_sets_of_requests_are_refused_naming_both(root, api):
    async with dra_node(root, api) as node:
        node.claim("duo", [{"name": "a", "memory": "2Gi"}, {"name": "b", "memory": "2Gi"}], distinct=[[]])
        pod = node.pod("p", {"gpu": "duo"}, [("whole", [("gpu", None)]), ("part", [("gpu", "a")])])
        node.schedule(pod, ["duo"])
        error = await refusal(node, node.refs(pod)["gpu"])
        assert re.search(r"container p/whole takes requests 'a', 'b' of it together and container p/part takes 'a'",
                         error), error


async def test_a_group_the_ledger_cannot_hold_whole_is_refused_and_what_was_held_stays(root, api):
    """kube-scheduler's books and the agent's ledger disagree (a forged or stale allocation): the second GPU of the
    claim has no room. The first GPU's slice, made a moment before, goes again; another claim's slice stays."""
    async with dra_node(root, api) as node:
        node.claim("other", [{"name": "gpu", "memory": "14Gi", "selectors": [INDEX.format(1)]}])
        other = node.pod("o", {"gpu": "other"}, [("main", [("gpu", None)])])
        node.schedule(other, ["other"])
        kept = (await node.start(other))["main"]
        node.claim("pair", [{"name": "gpus", "memory": "4Gi", "count": 2}], distinct=[["gpus"]])
        pod = node.pod("p", {"gpu": "pair"}, [("main", [("gpu", None)])])
        ref = node.refs(pod)["gpu"]
        forged: dict[str, Any] = {"allocation": {"devices": {"results": [
            {"request": "gpus", "driver": DRA_DRIVER, "pool": "node-1", "device": f"gpu-{i}",
             "shareID": f"0b7c5f6e-6f0f-4f55-9b43-3f2a0d6f0a1{i}", "consumedCapacity": {"memory": "4Gi",
                                                                                        "compute": "0"}}
            for i in (0, 1)]}}, "reservedFor": [{"resource": "pods", "name": "p", "uid": pod["metadata"]["uid"]}]}
        api.set_claim_status("default", "pair", forged)
        with pytest.raises(DraCallFailed, match="more than GPU .* has free in the agent's ledger"):
            await node.kubelet.prepare(DRA_DRIVER, [ref], attempts=2)
        nothing_of(node, ref.uid)
        again = node.start_containers(other)["main"]  # the other claim's container: as it was
        assert again.envs == kept.envs and again.mounts == kept.mounts
        assert [(r.memory_free, r.compute_free) for r in node.running.agent.ledger.rooms()] == [(16, 100), (2, 100)]


async def test_a_claim_of_two_requests_waits_for_its_pod_then_refuses_until_the_watch_shows_it(root, api):
    """Which requests a container takes together is in its pod's spec: not shown by the pod watch (here: reserved for
    a pod the API server does not have), the prepare says so and makes nothing; kubelet calls again."""
    async with dra_node(root, api) as node:
        node.claim("duo", [{"name": "a", "memory": "2Gi"}, {"name": "b", "memory": "2Gi"}], distinct=[[]])
        claim = api.claim("default", "duo")
        status = {"allocation": node.allocator.allocate(claim, node.node, node.slices()),
                  "reservedFor": [{"resource": "pods", "name": "ghost", "uid": "00000000-0000-4000-8000-000000000009"}]}
        api.set_claim_status("default", "duo", status)
        error = await refusal(node, Claim("default", claim["metadata"]["uid"], "duo"))
        assert "has 2 requests of gpu.alnair.centaurus.io (a, b)" in error
        assert "pod it is reserved for (default/ghost), which the agent's pod watch does not show yet" in error


async def test_more_gpus_than_the_node_has_stays_unallocated(root, api):
    async with dra_node(root, api) as node:
        node.claim("wide", [{"name": "gpus", "memory": "1Gi", "count": 3}], distinct=[["gpus"]])
        pod = node.pod("p", {"gpu": "wide"}, [("main", [("gpu", None)])])
        with pytest.raises(AllocationFailed):  # kube-scheduler leaves the pod Pending; nothing reaches the node
            node.schedule(pod, ["wide"])
        assert not node.running.agent.ledger.allocations


def readme_two_gpu_claim() -> dict[str, Any]:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- dra-two-gpus -->\n```yaml\n(.*?)```", readme, re.S)
    assert block is not None, "the README's two-GPU claim example is marked <!-- dra-two-gpus -->"
    return yaml.safe_load(block.group(1))


async def test_the_readmes_two_gpu_claim_gives_a_container_two_gpus(root, api):
    example = readme_two_gpu_claim()
    import kubernetes_validate

    kubernetes_validate.validate(example, "1.36", strict=True)
    assert example["kind"] == "ResourceClaimTemplate"
    async with dra_node(root, api) as node:
        claim = api.add_claim({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                               "metadata": {"name": "from-readme", "namespace": "default"},
                               "spec": example["spec"]["spec"]})
        pod = node.pod("p", {"gpu": claim["metadata"]["name"]}, [("main", [("gpu", None)])])
        node.schedule(pod, ["from-readme"])
        view = (await node.start(pod))["main"]
        assert view.envs[ENV_VISIBLE_DEVICES] == ",".join(uuids(node))
        assert len(set(regions(view))) == 1 and len(regions(view)) == 2
        await node.finish(pod)


async def test_a_first_available_subrequest_of_two_gpus_reaches_the_container_naming_its_request(root, api):
    """kubelet matches a container's `request` against the answer's request names: a firstAvailable result answers
    "<request>/<subrequest>", and the answer names "<request>", as kubelet's own plugin helper strips it."""
    async with dra_node(root, api) as node:
        big = {"name": "big", "deviceClassName": "gpu.alnair.centaurus.io", "count": 2,
               "capacity": {"requests": {"memory": "40Gi"}}}  # fits no 16 GiB GPU: the next one is taken
        small = {"name": "small", "deviceClassName": "gpu.alnair.centaurus.io", "count": 2,
                 "capacity": {"requests": {"memory": "2Gi", "compute": "20"}}}
        api.add_claim({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                       "metadata": {"name": "fa", "namespace": "default"},
                       "spec": {"devices": {"requests": [{"name": "gpus", "firstAvailable": [big, small]}],
                                            "constraints": [{"distinctAttribute": "gpu.alnair.centaurus.io/uuid"}]}}})
        pod = node.pod("p", {"gpu": "fa"}, [("main", [("gpu", "gpus")])])
        [claim] = node.schedule(pod, ["fa"])
        assert {r["request"] for r in claim["status"]["allocation"]["devices"]["results"]} == {"gpus/small"}
        view = (await node.start(pod))["main"]
        assert view.envs[ENV_VISIBLE_DEVICES] == ",".join(uuids(node))
        assert regions(view) == [(2 * GiB, 20), (2 * GiB, 20)]
        assert {tuple(d.request_names) for d in node.kubelet.prepared[node.refs(pod)["gpu"].uid]} == {("gpus",)}
        await node.finish(pod)


def host_region(view: ContainerView) -> Path:
    folder, name = view.envs[ENV_REGION].rsplit("/", 1)
    return Path(view.mounts[folder][0]) / name


async def test_a_claims_pod_annotated_latency_gets_the_latency_class_and_its_neighbour_holds_for_it(root, api):
    """The latency class composes with the DRA front-end: the policy is the pod's annotation, read by the same
    dispatcher for a claim's slice as for a device plugin container's. A claim's container in a pod annotated
    `latency` gets no window and a board slot; a strict claim's container on the same GPU gets a window and, once the
    latency container has launched (its slot's counter, as the shim writes it), the hold mask naming that slot."""
    from alnair_agent.constants import COMPUTE_POLICY_ANNOTATION
    from alnair_agent.node.region_layout import (
        BOARD_FILE_NAME,
        CLASS_LATENCY,
        CLASS_TURNS,
        CTYPES,
        SLOT_FIELDS,
        absolute_offset,
    )
    from alnair_standins.dra_node import make_claim_pod

    async with dra_node(root, api) as node:
        sel = [INDEX.format(0)]
        node.claim("svc", [{"name": "gpu", "memory": "4Gi", "compute": "30", "selectors": sel}])
        node.claim("trainer", [{"name": "gpu", "memory": "4Gi", "compute": "70", "selectors": sel}])
        svc = make_claim_pod("svc", {"gpu": "svc"}, [("main", [("gpu", None)])], node=node.node)
        svc["metadata"]["annotations"] = {COMPUTE_POLICY_ANNOTATION: "latency"}
        node.pods["svc"] = api.add_pod(svc)
        trainer = node.pod("trainer", {"gpu": "trainer"}, [("main", [("gpu", None)])])
        node.schedule(node.pods["svc"], ["svc"])
        node.schedule(trainer, ["trainer"])
        views = {"svc": (await node.start(node.pods["svc"]))["main"], "trainer": (await node.start(trainer))["main"]}
        paths = {k: host_region(v) for k, v in views.items()}

        def agent(name: str) -> dict[str, int]:
            r = Region.open(paths[name])
            try:
                return r.read_agent_block()
            finally:
                r.close()

        await wait_until(lambda: agent("svc")["compute_class"] == CLASS_LATENCY, timeout=10)
        assert agent("svc")["turn_length_ns"] == 0  # no window: it launches at once
        await wait_until(lambda: agent("trainer")["turn_length_ns"] > 0, timeout=10)
        assert agent("trainer")["compute_class"] == CLASS_TURNS
        assert (paths["trainer"].parent / BOARD_FILE_NAME).exists()  # the board it reads, in its own folder
        # the latency container launches (what its shim counts in its slot): its neighbour holds for its board slot
        start = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        with open(paths["svc"], "r+b") as f:
            for field, value in (("pid", os.getpid()), ("start_time", start), ("launches", 10)):
                ctype = next(x.ctype for x in SLOT_FIELDS if x.name == field)
                f.seek(absolute_offset("alnair_region_slot", field, 0))
                f.write(struct.pack("<" + CTYPES[ctype][0], value))
        await wait_until(lambda: agent("trainer")["hold_mask"] != 0, timeout=10)
        assert agent("trainer")["hold_pct"] == 60  # twice the latency caps
