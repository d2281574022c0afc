"""The DRA front-end through its real interfaces: kubelet's plugin watcher and NodePrepareResources over unix-socket
gRPC (the DRA kubelet emulator), ResourceSlices and ResourceClaims on the API server stand-in through the real
kubernetes-asyncio client, claims allocated by the allocator stand-in as kube-scheduler allocates them, containers
made by the emulated runtime from the CDI specs the agent writes."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from service_util import wait_until

from alnair_agent.constants import (
    CONTAINER_MPS_PIPE_DIR,
    CONTAINER_MPS_SHM_DIR,
    CONTAINER_RUN_DIR,
    CONTAINER_SHIM_DIR,
    DRA_DRIVER,
    ENV_ALLOCATION_ID,
    ENV_COMPUTE_LIMIT,
    ENV_MEMORY_LIMIT,
    ENV_MPS_PIPE_DIRECTORY,
    ENV_REGION,
    ENV_VISIBLE_DEVICES,
    REGION_FILE_NAME,
    RESOURCE_COMPUTE,
    RESOURCE_MEMORY,
    USAGE_ANNOTATION,
)
from alnair_agent.dra.capacity import slice_name
from alnair_agent.node.region import Region
from alnair_standins.apiserver_process import ApiServerProcess
from alnair_standins.dra_allocator import AllocationFailed
from alnair_standins.dra_node import dra_node
from alnair_standins.kubelet import KubeletEmulator
from alnair_standins.kubelet_dra import Claim, DraKubeletEmulator
from alnair_standins.node import node_settings, registered, running_agent

GiB = 1 << 30


def region_limits(node, view) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    host = view.mounts[CONTAINER_RUN_DIR][0]
    region = Region.open(__import__("pathlib").Path(host) / REGION_FILE_NAME)
    try:
        return region.memory_limit, region.compute_limit
    finally:
        region.close()


async def test_the_slice_offers_each_gpu_with_consumable_memory_and_compute(root, api):
    async with dra_node(root, api) as node:
        [s] = node.slices()
        spec = s["spec"]
        assert s["metadata"]["name"] == slice_name("node-1")
        assert spec["driver"] == DRA_DRIVER and spec["nodeName"] == "node-1"
        assert spec["pool"] == {"name": "node-1", "generation": 1, "resourceSliceCount": 1}
        assert [d["name"] for d in spec["devices"]] == ["gpu-0", "gpu-1"]
        gpu0 = spec["devices"][0]
        assert gpu0["allowMultipleAllocations"] is True
        assert gpu0["capacity"]["memory"] == {"value": "16Gi", "requestPolicy": {
            "default": "0", "validRange": {"min": "0", "max": "16Gi", "step": "1Gi"}}}
        assert gpu0["capacity"]["compute"] == {"value": "100", "requestPolicy": {
            "default": "0", "validRange": {"min": "0", "max": "100", "step": "1"}}}
        assert set(gpu0["attributes"]) == {"uuid", "index", "productName", "memory"}
        assert gpu0["attributes"]["index"] == {"int": 0} and gpu0["attributes"]["memory"] == {"int": 16 * GiB}
        assert gpu0["attributes"]["uuid"]["string"] == node.running.agent.gpus[0].uuid


async def test_a_claim_of_4_gib_and_30_percent_gives_its_container_that_slice_and_unprepare_removes_it(root, api):
    async with dra_node(root, api) as node:
        node.claim("c1", [{"name": "gpu", "memory": "4Gi", "compute": "30"}])
        pod = node.pod("p1", {"gpu": "c1"}, [("main", [("gpu", None)])])
        [claim] = node.schedule(pod, ["c1"])
        [result] = claim["status"]["allocation"]["devices"]["results"]
        assert result["consumedCapacity"] == {"memory": "4Gi", "compute": "30"}
        views = await node.start(pod)
        env = views["main"].envs
        assert env[ENV_MEMORY_LIMIT] == str(4 * GiB) and env[ENV_COMPUTE_LIMIT] == "30"
        gpu = next(g for g in node.running.agent.gpus if f"gpu-{g.index}" == result["device"])
        assert env[ENV_VISIBLE_DEVICES] == gpu.uuid
        assert region_limits(node, views["main"]) == (4 * GiB, 30)
        [alloc] = node.running.agent.ledger.allocations.values()
        assert alloc.claim is not None and alloc.claim.name == "c1" and alloc.pod_name == "p1"
        folder = node.settings.workspace / alloc.id
        cdi = node.settings.cdi_dir / f"alnair.centaurus.io-gpu_{claim['metadata']['uid']}.json"
        assert folder.is_dir() and cdi.is_file()
        await node.finish(pod)
        assert not node.running.agent.ledger.allocations
        assert not folder.exists() and not cdi.exists()


@pytest.mark.parametrize("mps", [False, True])
async def test_dra_containers_get_exactly_the_env_and_mounts_allocate_gives(root, api, mps):
    """Allocate (device plugin) and the CDI spec (DRA) for 4 GiB + 30 %: the same variables and mounts, only the
    allocation's own id (and where it lives) differ; with the MPS folders set both give them."""
    pipes, shm = (root / "mps-pipes", root / "mps-shm") if mps else (None, None)
    dp_root = root / "dp"
    dp_settings = node_settings(dp_root, mps_pipe_dir=pipes, mps_shm_dir=shm)
    async with KubeletEmulator(dp_settings.device_plugin_dir, dp_settings.pod_resources_socket) as kubelet:
        async with running_agent(dp_settings):
            await registered(kubelet)
            answers = await kubelet.admit("default", "p", "main", {RESOURCE_MEMORY: 4, RESOURCE_COMPUTE: 30})
    dp_env = {k: v for a in answers.values() for k, v in a.envs.items()}
    dp_mounts = {m.container_path: (m.host_path, m.read_only) for a in answers.values() for m in a.mounts}
    async with dra_node(root / "dra", api, mps_pipe_dir=pipes, mps_shm_dir=shm) as node:
        node.claim("c1", [{"name": "gpu", "memory": "4Gi", "compute": "30"}])
        pod = node.pod("p1", {"gpu": "c1"}, [("main", [("gpu", None)])])
        node.schedule(pod, ["c1"])
        view = (await node.start(pod))["main"]

    def normal(env, mounts, settings):  # type: ignore[no-untyped-def]
        alloc_id = env[ENV_ALLOCATION_ID]
        env = {k: ("<id>" if k == ENV_ALLOCATION_ID else "<gpu>" if k == ENV_VISIBLE_DEVICES else v)
               for k, v in env.items()}
        mounts = {c: (h.replace(str(settings.workspace), "<ws>").replace(str(settings.shim_dir), "<lib>")
                      .replace(alloc_id, "<id>"), ro) for c, (h, ro) in mounts.items()}
        return env, mounts

    assert normal(view.envs, view.mounts, node.settings) == normal(dp_env, dp_mounts, dp_settings)
    assert set(view.mounts) == {CONTAINER_RUN_DIR, CONTAINER_SHIM_DIR} | ({CONTAINER_MPS_PIPE_DIR, CONTAINER_MPS_SHM_DIR} if mps else set())
    assert view.mounts[CONTAINER_SHIM_DIR] == (str(node.settings.shim_dir), True)
    if mps:
        assert view.mounts[CONTAINER_MPS_PIPE_DIR] == (str(pipes), False)
        assert view.mounts[CONTAINER_MPS_SHM_DIR] == (str(shm), False)
        assert view.envs[ENV_MPS_PIPE_DIRECTORY] == CONTAINER_MPS_PIPE_DIR
    assert view.mounts[CONTAINER_RUN_DIR][1] is False


async def test_a_claim_shared_by_two_containers_gives_both_one_slice(root, api):
    async with dra_node(root, api) as node:
        node.claim("shared", [{"name": "gpu", "memory": "6Gi", "compute": "50"}])
        pod = node.pod("p1", {"gpu": "shared"}, [("reader", [("gpu", None)]), ("writer", [("gpu", "gpu")])])
        node.schedule(pod, ["shared"])
        views = await node.start(pod)
        a, b = views["reader"], views["writer"]
        assert a.envs == b.envs and a.mounts == b.mounts  # one folder, one region, one set of limits
        assert a.envs[ENV_MEMORY_LIMIT] == str(6 * GiB) and a.envs[ENV_REGION] == "/run/alnair/region"
        [alloc] = node.running.agent.ledger.allocations.values()
        async def named() -> None:
            while alloc.container != "reader,writer":
                await asyncio.sleep(0.02)
        await asyncio.wait_for(named(), 5)  # both containers' processes count as the slice's, in the usage key


@pytest.mark.parametrize("request_, memory, compute", [
    ({"name": "gpu", "memory": "2Gi"}, str(2 * GiB), None),  # memory only: no compute cap
    ({"name": "gpu", "compute": "25"}, None, "25"),  # compute only: no memory cap
    ({"name": "gpu", "memory": "1500Mi", "compute": "100"}, str(2 * GiB), "0"),  # rounded up; 100 % is no cap
])
async def test_memory_only_and_compute_only_claims(root, api, request_, memory, compute):
    async with dra_node(root, api) as node:
        node.claim("c", [request_])
        pod = node.pod("p", {"gpu": "c"}, [("main", [("gpu", None)])])
        node.schedule(pod, ["c"])
        env = (await node.start(pod))["main"].envs
        assert env.get(ENV_MEMORY_LIMIT) == memory and env.get(ENV_COMPUTE_LIMIT) == compute


async def test_kube_scheduler_never_books_a_gpu_past_its_capacity_and_the_ledger_agrees(root, api):
    async with dra_node(root, api) as node:
        for i in range(4):  # 4 x 8 GiB: two GPUs of 16 GiB are full
            node.claim(f"c{i}", [{"name": "gpu", "memory": "8Gi", "compute": "10"}])
            pod = node.pod(f"p{i}", {"gpu": f"c{i}"}, [("main", [("gpu", None)])])
            node.schedule(pod, [f"c{i}"])
            await node.start(pod)
        node.claim("c4", [{"name": "gpu", "memory": "1Gi"}])
        pod = node.pod("p4", {"gpu": "c4"}, [("main", [("gpu", None)])])
        with pytest.raises(AllocationFailed):
            node.schedule(pod, ["c4"])
        rooms = node.running.agent.ledger.rooms()
        assert [r.memory_free for r in rooms] == [0, 0] and [r.compute_free for r in rooms] == [80, 80]


async def test_prepare_is_idempotent(root, api):
    async with dra_node(root, api) as node:
        node.claim("c1", [{"name": "gpu", "memory": "4Gi"}])
        pod = node.pod("p1", {"gpu": "c1"}, [("main", [("gpu", None)])])
        node.schedule(pod, ["c1"])
        ref = node.refs(pod)["gpu"]
        for _ in range(3):  # kubelet retries after a timeout, or after its own restart
            assert await node.kubelet.prepare_once(DRA_DRIVER, [ref]) == {}
        assert len(node.running.agent.ledger.allocations) == 1
        first = node.kubelet.cdi_ids(ref.uid)
        (node.settings.cdi_dir / f"alnair.centaurus.io-gpu_{ref.uid}.json").unlink()  # lost (a tmpfs cleared)
        assert await node.kubelet.prepare_once(DRA_DRIVER, [ref]) == {}
        assert node.kubelet.cdi_ids(ref.uid) == first
        node.start_containers(pod)  # resolvable again


async def test_a_1_34_kubelet_speaking_only_v1beta1_is_served(root, api):
    async with dra_node(root, api) as node:
        old = DraKubeletEmulator(node.settings.plugins_registry_dir, node.settings.cdi_dir,
                                 services=("v1beta1.DRAPlugin",))
        async with old:
            await old.wait_registered(DRA_DRIVER)
            assert old.registrations == [(DRA_DRIVER, "v1beta1.DRAPlugin")]
            assert node.kubelet.registrations[0] == (DRA_DRIVER, "v1.DRAPlugin")
            node.claim("c1", [{"name": "gpu", "memory": "4Gi", "compute": "20"}])
            pod = node.pod("p1", {"gpu": "c1"}, [("main", [("gpu", None)])])
            node.schedule(pod, ["c1"])
            ref = node.refs(pod)["gpu"]
            await old.prepare(DRA_DRIVER, [ref])
            view = old.start_container("default", "p1", "main", [(ref, None)])
            assert view.envs[ENV_COMPUTE_LIMIT] == "20"
            await old.unprepare(DRA_DRIVER, [ref])
            assert not node.running.agent.ledger.allocations


async def test_unprepare_writes_the_final_usage_before_the_folder_goes(root, api):
    async with dra_node(root, api) as node:
        node.claim("c1", [{"name": "gpu", "memory": "4Gi", "compute": "30"}])
        pod = node.pod("p1", {"gpu": "c1"}, [("main", [("gpu", None)])])
        node.schedule(pod, ["c1"])
        await node.start(pod)
        [alloc] = node.running.agent.ledger.allocations.values()

        async def named() -> None:
            while alloc.container != "main":
                await asyncio.sleep(0.02)
        await asyncio.wait_for(named(), 5)
        api.fail_next("patch_pod", status=503, times=1000)  # the API server refuses the final write
        with pytest.raises(Exception, match="final usage figures"):
            await node.kubelet.unprepare(DRA_DRIVER, [node.refs(pod)["gpu"]], attempts=2)
        assert (node.settings.workspace / alloc.id).is_dir()  # kept while the figures are not written
        api.clear_failures()
        await node.finish(pod)
        usage = json.loads(api.pod_annotations("default", "p1")[USAGE_ANNOTATION])
        assert usage["main"]["state"] == "ended" and usage["main"]["memory_limit_bytes"] == 4 * GiB
        assert not (node.settings.workspace / alloc.id).exists()


async def test_an_unhealthy_gpu_leaves_the_slice_and_comes_back(root, api):
    async with dra_node(root, api) as node:
        node.running.backend.inject_health(1, False, "xid 79")

        async def devices(names: list[str]) -> None:
            while [d["name"] for d in node.slices()[0]["spec"]["devices"]] != names:
                await asyncio.sleep(0.02)
        await asyncio.wait_for(devices(["gpu-0"]), 5)
        assert node.slices()[0]["spec"]["pool"]["generation"] == 2
        node.running.backend.inject_health(1, True)
        await asyncio.wait_for(devices(["gpu-0", "gpu-1"]), 5)
        assert node.slices()[0]["spec"]["pool"]["generation"] == 3


async def test_the_slice_comes_back_after_kubelet_wipes_it_and_a_restart_rewrites_nothing(root, api):
    async with dra_node(root, api):
        name = slice_name("node-1")
        api.delete_resource_slice(name)  # kubelet at its start, or after the plugin was away 30 s

        async def back() -> None:
            while api.resource_slice(name) is None:
                await asyncio.sleep(0.02)
        await asyncio.wait_for(back(), 5)
        writes = len(api.slice_writes)
        await asyncio.sleep(0.3)  # several passes: nothing changed, nothing written
        assert len(api.slice_writes) == writes
    before = len(api.slice_writes)
    async with dra_node(root, api):  # the agent restarts: its slice is as it left it
        await asyncio.sleep(0.3)
    assert len(api.slice_writes) == before


async def test_a_container_naming_one_request_gets_only_that_requests_slice(root, api):
    async with dra_node(root, api) as node:
        node.claim("two", [{"name": "train", "memory": "8Gi", "compute": "60"},
                           {"name": "eval", "memory": "2Gi", "compute": "10"}])
        pod = node.pod("p", {"gpu": "two"}, [("trainer", [("gpu", "train")]), ("evaluator", [("gpu", "eval")])])
        node.schedule(pod, ["two"])
        views = await node.start(pod)
        assert views["trainer"].envs[ENV_MEMORY_LIMIT] == str(8 * GiB)
        assert views["evaluator"].envs[ENV_COMPUTE_LIMIT] == "10"
        assert views["trainer"].mounts[CONTAINER_RUN_DIR] != views["evaluator"].mounts[CONTAINER_RUN_DIR]
        assert len(node.running.agent.ledger.allocations) == 2


async def test_an_agent_restart_after_prepare_keeps_the_slice_and_its_spec(root, api):
    async with dra_node(root, api) as node:
        node.claim("c1", [{"name": "gpu", "memory": "4Gi", "compute": "30"}])
        pod = node.pod("p1", {"gpu": "c1"}, [("main", [("gpu", None)])])
        node.schedule(pod, ["c1"])
        before = (await node.start(pod))["main"]
        ref = node.refs(pod)["gpu"]
    (root / "cdi" / f"alnair.centaurus.io-gpu_{ref.uid}.json").unlink()  # a node tmpfs cleared meanwhile
    (root / "cdi" / "alnair.centaurus.io-gpu_00000000-dead-beef-0000-000000000000.json").write_text("{}")
    async with dra_node(root, api) as node:
        await node.kubelet.prepare(DRA_DRIVER, [ref])  # a new kubelet too: it prepares the claim again
        after = node.kubelet.start_container("default", "p1", "main", [(ref, None)])
        assert after.envs == before.envs and after.mounts == before.mounts
        assert len(node.running.agent.ledger.allocations) == 1
        assert not (root / "cdi" / "alnair.centaurus.io-gpu_00000000-dead-beef-0000-000000000000.json").exists()
        await node.finish(pod)
        assert not node.running.agent.ledger.allocations


async def test_a_claim_kubelet_forgot_is_retired_once_gone_from_the_api_and_pod_resources(root, api):
    async with dra_node(root, api) as node:
        node.claim("c1", [{"name": "gpu", "memory": "4Gi"}])
        pod = node.pod("p1", {"gpu": "c1"}, [("main", [("gpu", None)])])
        node.schedule(pod, ["c1"])
        await node.start(pod)
        cleanup = node.running.agent.dra.cleanup
        list_claims = node.running.agent.list_claims
        assert await cleanup.collect_orphans(list_claims) == 0  # in use: kept
        node.kubelet.stop_pod("default", "p1")
        assert await cleanup.collect_orphans(list_claims) == 0  # still allocated as recorded: kept
        api.delete_claim("default", "c1")
        api.delete_pod("default", "p1")
        assert await cleanup.collect_orphans(list_claims) == 1
        assert not node.running.agent.ledger.allocations


async def test_prepare_waits_for_nothing_when_kubelet_names_a_claim_of_another_driver_only(root, api):
    async with dra_node(root, api) as node:
        claim = api.add_claim({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                               "metadata": {"name": "nic", "namespace": "default"},
                               "spec": {"devices": {"requests": []}}})
        api.set_claim_status("default", "nic", {"allocation": {"devices": {"results": [
            {"request": "nic", "driver": "nic.example.com", "pool": "node-1", "device": "eth1"}]}}})
        ref = Claim("default", claim["metadata"]["uid"], "nic")
        assert await node.kubelet.prepare_once(DRA_DRIVER, [ref]) == {}
        assert node.kubelet.prepared[ref.uid] == [] and not node.running.agent.ledger.allocations


async def test_the_agent_process_prepares_claims_and_keeps_them_through_a_kill(root):
    """`python -m alnair_agent.main` with ALNAIR_FRONTEND=dra and a KUBECONFIG (the production wiring), the API server
    stand-in in a process of its own: a claim is prepared, survives a SIGKILL of the agent (the record and spec were
    on disk before the answer), is prepared again with the same devices, and its folder goes with the unprepare."""
    async with ApiServerProcess() as api, dra_node(root, api, process=True) as node:
        with pytest.raises(KeyError):
            api.claim("default", "none")  # a hook's own error comes back through the pipe
        node.claim("c1", [{"name": "gpu", "memory": "4Gi", "compute": "30"}])
        pod = node.pod("p1", {"gpu": "c1"}, [("main", [("gpu", None)])])
        node.schedule(pod, ["c1"])
        before = (await node.start(pod))["main"]
        assert before.envs[ENV_MEMORY_LIMIT] == str(4 * GiB) and before.envs[ENV_COMPUTE_LIMIT] == "30"
        assert region_limits(node, before) == (4 * GiB, 30)
        assert node.process is not None and node.process.proc is not None
        node.process.proc.kill()
        await asyncio.to_thread(node.process.proc.wait, 10)
        await node.start_agent()
        ref = node.refs(pod)["gpu"]
        ids = node.kubelet.cdi_ids(ref.uid)
        assert await node.kubelet.prepare_once(DRA_DRIVER, [ref]) == {}  # kubelet's retry after the restart
        assert node.kubelet.cdi_ids(ref.uid) == ids
        after = node.kubelet.start_container("default", "p1", "main", [(ref, None)])
        assert after.envs == before.envs and after.mounts == before.mounts
        await node.finish(pod)
        assert not list(node.settings.workspace.glob("*/allocation.json"))
        assert not list(node.settings.cdi_dir.glob("*.json"))


async def test_a_prepare_takes_a_slice_folder_and_a_spec_file_made_ahead_and_none_outlives_the_agent(root, api):
    """The front-end keeps folders and spec files made ahead (off the prepare's path): a prepare renames them into
    place, they are made again, and the agent's stop removes what is left (its restart would, too)."""
    from alnair_agent.dra.spares import SPARES

    ws, cdi = root / "ws", root / "cdi"

    def inode(path: Path) -> int | None:
        try:
            return path.stat().st_ino
        except FileNotFoundError:  # being made (or taken) right now
            return None

    def spares() -> tuple[dict[str, int], dict[str, int]]:
        """(spare folder -> its region's inode, spare spec file -> its inode), of the complete ones"""
        names = os.listdir(ws / ".spares") if (ws / ".spares").exists() else []
        folders = {f: i for f in names if (i := inode(ws / ".spares" / f / "run" / REGION_FILE_NAME)) is not None}
        return folders, {n: i for n in os.listdir(cdi) if n.startswith(".spare-") and (i := inode(cdi / n))}

    async with dra_node(root, api) as node:
        await wait_until(lambda: [len(x) for x in spares()] == [SPARES, SPARES])
        folders, files = spares()
        node.claim("c1", [{"name": "gpu", "memory": "4Gi", "compute": "30"}])
        pod = node.pod("p1", {"gpu": "c1"}, [("main", [("gpu", None)])])
        node.schedule(pod, ["c1"])
        view = (await node.start(pod))["main"]
        assert region_limits(node, view) == (4 * GiB, 30)
        [alloc] = node.running.agent.ledger.allocations.values()
        assert (ws / alloc.id / "run" / REGION_FILE_NAME).stat().st_ino in folders.values()
        spec = cdi / f"alnair.centaurus.io-gpu_{node.refs(pod)['gpu'].uid}.json"
        assert spec.stat().st_ino in files.values()
        await wait_until(lambda: [len(x) for x in spares()] == [SPARES, SPARES])  # made again
        now_folders, now_files = spares()
        assert len(set(folders) - set(now_folders)) == 1 and len(set(files) - set(now_files)) == 1
        await node.finish(pod)
    assert spares() == ({}, {})
