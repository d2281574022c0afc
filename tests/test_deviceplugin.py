"""The device plugin as kubelet sees it: real gRPC over unix sockets against the kubelet emulator."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import grpc
import pytest

from alnair_agent.app import Kubernetes
from alnair_agent.constants import (
    ENV_COMPUTE_LIMIT,
    ENV_MEMORY_LIMIT,
    ENV_REGION,
    ENV_VISIBLE_DEVICES,
    HEALTHY,
    NODE_GPU_DEVICES,
    RESOURCE_COMPUTE,
    RESOURCE_MEMORY,
    UNHEALTHY,
    USAGE_ANNOTATION,
)
from alnair_agent.node.region import Region
from alnair_standins.apiserver import FakeApiServer, make_pod
from alnair_standins.crashloop import Episode, run_episode
from alnair_standins.gpu import sim_uuid
from alnair_standins.kubelet import AdmissionError, KubeletEmulator
from alnair_standins.node import (
    NODE,
    gpu_of,
    kubernetes_for,
    node_settings,
    registered,
    running_agent,
)

GIB = 1 << 30
MEM, SM = RESOURCE_MEMORY, RESOURCE_COMPUTE


@pytest.fixture
async def kubelet(root: Path):
    async with KubeletEmulator(root / "dp", root / "pr" / "kubelet.sock") as k:
        yield k


@pytest.fixture
async def k8s(api: FakeApiServer):
    clients: list = []
    def make() -> Kubernetes:
        clients.append(api.api_client())
        return kubernetes_for(clients[-1])

    yield make
    for client in clients:
        await client.close()


async def admit_pod(api: FakeApiServer, kubelet: KubeletEmulator, name: str, memory: int, compute: int,
                    container: str = "main", restart_policy: str = "Always") -> dict:
    """Bind a pod asking for memory/compute to the node, then admit its container as kubelet does."""
    containers = [{"name": container, **({"memory": memory} if memory else {}), **({"compute": compute} if compute else {})}]
    api.add_pod(make_pod(name, node=NODE, containers=containers, restart_policy=restart_policy))
    return await kubelet.admit("default", name, container, {MEM: memory, SM: compute})


async def test_registers_both_resources_with_device_counts(root, kubelet):
    settings = node_settings(root)  # 2 x 16 GiB, 1 GiB units
    async with running_agent(settings):
        await registered(kubelet)
        assert sorted(kubelet.registrations) == sorted([MEM, SM])
        assert len(kubelet.plugins[MEM].devices) == 32
        assert len(kubelet.plugins[SM].devices) == 200
        for resource in (MEM, SM):
            assert kubelet.plugins[resource].options.get_preferred_allocation_available
            ids = kubelet.plugins[resource].devices
            assert {gpu_of(i) for i in ids} == {sim_uuid(0, NODE), sim_uuid(1, NODE)}
            assert set(ids.values()) == {HEALTHY}


@pytest.mark.parametrize(("policy", "expected_gpus"), [
    ("binpack", [0, 0, 0]),
    ("spread", [0, 1, 0]),
])
async def test_policy_places_three_containers(root, kubelet, api, k8s, policy, expected_gpus):
    async with running_agent(node_settings(root, gpu_policy=policy), k8s()):
        await registered(kubelet)
        placed = []
        for n in range(3):
            answers = await admit_pod(api, kubelet, f"pod-{n}", memory=4, compute=30)
            placed.append(answers[MEM].envs[ENV_VISIBLE_DEVICES])
        assert placed == [sim_uuid(i, NODE) for i in expected_gpus]


async def test_memory_and_compute_of_one_container_land_on_one_gpu(root, kubelet, api, k8s):
    async with running_agent(node_settings(root), k8s()) as running:
        await registered(kubelet)
        # GPU 0 gets most of its compute taken; binpack would put the next container's memory there, but its
        # compute no longer fits on GPU 0: both resources must go to GPU 1 together.
        await admit_pod(api, kubelet, "busy", memory=2, compute=90)
        answers = await admit_pod(api, kubelet, "next", memory=4, compute=20)
        held = kubelet.assigned[next(k for k in kubelet.assigned if k.pod == "next")]
        assert {gpu_of(i) for ids in held.values() for i in ids} == {sim_uuid(1, NODE)}
        env_mem, env_sm = answers[MEM].envs, answers[SM].envs
        assert env_mem == env_sm  # kubelet merges both answers: they must agree
        assert env_mem[ENV_VISIBLE_DEVICES] == sim_uuid(1, NODE)
        assert env_mem[ENV_MEMORY_LIMIT] == str(4 * GIB)
        assert env_mem[ENV_COMPUTE_LIMIT] == "20"
        assert env_mem[ENV_REGION] == "/run/alnair/region"
        mounts = {m.container_path: (m.host_path, m.read_only) for m in answers[MEM].mounts}
        host_ws, ro = mounts["/run/alnair"]
        assert not ro and mounts["/opt/alnair/lib"] == (str(root / "lib"), True)
        region = Region.open(Path(host_ws) / "region")
        try:
            assert (region.memory_limit, region.compute_limit) == (4 * GIB, 20)
        finally:
            region.close()
        alloc = next(a for a in running.agent.ledger.allocations.values() if a.pod_name == "next")
        assert (alloc.namespace, alloc.container, alloc.gpu_uuid) == ("default", "main", sim_uuid(1, NODE))


async def test_request_larger_than_any_gpu_is_refused_clearly(root, kubelet, api, k8s):
    async with running_agent(node_settings(root), k8s()):
        await registered(kubelet)
        with pytest.raises(AdmissionError) as err:
            await admit_pod(api, kubelet, "huge", memory=20, compute=10)  # 32 GiB free on the node, 16 per GPU
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than any single GPU" in err.value.details
        assert "20 memory + 10 compute units" in err.value.details
        assert not kubelet.assigned  # nothing half-allocated


async def test_kubelet_restart_reregisters_within_one_second(root, kubelet):
    async with running_agent(node_settings(root)):
        await registered(kubelet)
        before = len(kubelet.registrations)
        await kubelet.restart()
        started = time.monotonic()
        await kubelet.wait_for(lambda k: len(k.registrations) >= before + 2, timeout=1.0)
        await registered(kubelet, timeout=1.0)
        assert time.monotonic() - started <= 1.0
        answers = await kubelet.admit("default", "after-restart", "main", {MEM: 1, SM: 10})
        assert answers[MEM].envs[ENV_VISIBLE_DEVICES]


async def test_a_stopped_grpc_server_removes_whatever_file_holds_its_socket_path(tmp_path):
    """The gRPC behaviour the device plugin works around (deviceplugin.py's docstring): a server that stops unlinks
    its socket's path even when another server's socket is there by then."""
    path = tmp_path / "p.sock"
    old = grpc.aio.server()
    old.add_insecure_port(f"unix://{path}")
    await old.start()
    path.unlink()  # a kubelet restart empties the folder
    new = grpc.aio.server()
    new.add_insecure_port(f"unix://{path}")
    await new.start()
    await old.stop(grace=None)
    assert not path.exists()
    await new.stop(grace=None)


async def test_each_reserve_after_a_kubelet_restart_binds_new_socket_names(root, kubelet):
    """So no server of an earlier serve, stopping, can remove the sockets kubelet is about to dial; a previous
    generation's leftovers go, and the endpoint kubelet dials is the one served."""
    async with running_agent(node_settings(root)) as running:
        await registered(kubelet)
        plugin = running.agent.plugin
        names = [{r: plugin.socket_name(r) for r in (MEM, SM)}]
        for _ in range(2):
            await kubelet.restart()
            await registered(kubelet, timeout=2.0)
            await kubelet.wait_for(lambda k: all(k.plugins[r].endpoint == plugin.socket_name(r) for r in (MEM, SM)))
            names.append({r: plugin.socket_name(r) for r in (MEM, SM)})
        assert names[0] == {MEM: "alnair-vgpu-memory.sock", SM: "alnair-vgpu-compute.sock"}
        assert len({n[MEM] for n in names}) == 3 and len({n[SM] for n in names}) == 3
        assert sorted(p.name for p in root.joinpath("dp").glob("alnair-*.sock")) == sorted(names[-1].values())
        answers = await kubelet.admit("default", "after-restarts", "main", {MEM: 1, SM: 10})
        assert answers[MEM].envs[ENV_VISIBLE_DEVICES]
    assert not list(root.joinpath("dp").glob("alnair-*.sock"))  # the agent's stop removed its current sockets


# Seeds of crash-loop timing (tests/crashloop.py): 1-3.5 s of a kubelet dying at start or refusing Register, then one
# that stays. Before the fix the agent slept through its backoff (up to 5 s) meanwhile: 7 of these 10 took over 1 s.
CRASH_LOOP_SEEDS = {False: range(6), True: range(100, 104)}


@pytest.mark.slow
@pytest.mark.parametrize("same_inode", [False, True], ids=["new-inode", "inode-reused"])
async def test_kubelet_crash_loop_then_back_registers_within_one_second(root, kubelet, monkeypatch, same_inode):
    """However long kubelet crash-looped, and whatever the agent's backoff had grown to, the kubelet that stays up
    has both resources registered within 1 s. `inode-reused`: every kubelet.sock looks like the same file (the same
    inode, as a filesystem that reuses a freed one at once gives, and no other sign of a new file): only the other
    signs of a new kubelet are left."""
    if same_inode:
        import alnair_agent.kubelet.deviceplugin as deviceplugin

        monkeypatch.setattr(deviceplugin, "_identity", lambda path: (1, 1) if path.exists() else None)
    async with running_agent(node_settings(root)) as running:
        await registered(kubelet)
        outcomes = [await run_episode(kubelet, Episode.draw(seed, down_s=(1.0, 3.5)))
                    for seed in CRASH_LOOP_SEEDS[same_inode]]
        slow = [o for o in outcomes if o.reregister_s > 1.0]
        assert not slow, f"registered more than 1 s after kubelet was back: {slow}"
        answers = await kubelet.admit("default", "after-crash-loop", "main", {MEM: 1, SM: 10})
        assert answers[MEM].envs[ENV_VISIBLE_DEVICES]
        assert running.agent.plugin.registered.is_set()


async def test_gpu_unhealthy_and_back_sends_two_updates(root, kubelet):
    async with running_agent(node_settings(root)) as running:
        await registered(kubelet)
        first = {r: len(kubelet.plugins[r].updates) for r in (MEM, SM)}
        running.backend.inject_health(1, healthy=False, reason="xid 79")
        await kubelet.wait_for(lambda k: all(len(k.plugins[r].updates) == first[r] + 1 for r in (MEM, SM)))
        for r in (MEM, SM):
            devices = kubelet.plugins[r].devices
            assert {h for i, h in devices.items() if gpu_of(i) == sim_uuid(1, NODE)} == {UNHEALTHY}
            assert {h for i, h in devices.items() if gpu_of(i) == sim_uuid(0, NODE)} == {HEALTHY}
        running.backend.inject_health(1, healthy=True, reason="recovered")
        await kubelet.wait_for(lambda k: all(len(k.plugins[r].updates) == first[r] + 2 for r in (MEM, SM)))
        assert set(kubelet.plugins[MEM].devices.values()) == {HEALTHY}


@pytest.mark.parametrize(("resource", "device_id", "says"), [
    (MEM, "GPU-00000000-dead-beef-0000-000000000000::mem::0", "not on this node"),
    (MEM, "not-a-device", "is not <GPU-UUID>::<kind>::<n>"),
    (MEM, f"{sim_uuid(0, NODE)}::sm::0", "is not a alnair/vgpu-memory device"),
    (SM, f"{sim_uuid(0, NODE)}::mem::0", "is not a alnair/vgpu-compute device"),
    (MEM, f"{sim_uuid(0, NODE)}::mem::16", "out of range"),
    (SM, f"{sim_uuid(1, NODE)}::sm::-1", "out of range"),
    (MEM, f"{sim_uuid(0, NODE)}::mem::\u00b9", "out of range"),  # a digit to str.isdigit(), not to int()
])
async def test_device_ids_not_ours_are_invalid_argument(root, kubelet, resource, device_id, says):
    async with running_agent(node_settings(root)) as running:
        await registered(kubelet)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await kubelet.allocate_raw(resource, [device_id])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert says in err.value.details()
        assert not running.agent.ledger.allocations  # nothing recorded for a refused request


async def test_ended_container_workspace_removed_live_one_kept(root, kubelet, api, k8s):
    settings = node_settings(root)
    async with running_agent(settings, k8s()) as running:
        await registered(kubelet)
        done = await admit_pod(api, kubelet, "job", memory=2, compute=20, restart_policy="Never")
        live = await admit_pod(api, kubelet, "server", memory=2, compute=20)
        ws_done = Path(next(m.host_path for m in done[MEM].mounts if m.container_path == "/run/alnair"))
        ws_live = Path(next(m.host_path for m in live[MEM].mounts if m.container_path == "/run/alnair"))
        assert ws_done.is_dir() and ws_live.is_dir()
        api.set_container_running("default", "server", "main")
        api.set_container_terminated("default", "job", "main", exit_code=0)
        for _ in range(3):  # kubelet still reports the ended pod's devices: its folder stays
            await running.agent.reconciler.once()
        assert ws_done.is_dir()
        kubelet.remove_pod("default", "job")  # kubelet's pod-resources lists active pods only
        deadline = time.monotonic() + 20  # generous: CI shares 2 cores
        while ws_done.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not ws_done.exists()
        assert ws_live.is_dir()
        figures = json.loads(api.pod_annotations("default", "job")[USAGE_ANNOTATION])["main"]
        assert figures["state"] == "ended"
        assert figures["memory_limit_bytes"] == 2 * GIB and figures["compute_limit_percent"] == 20
        assert [a.pod_name for a in running.agent.ledger.allocations.values()] == ["server"]


async def test_node_annotation_tells_the_scheduler_what_is_free(root, kubelet, api, k8s):
    api.add_node(NODE)
    async with running_agent(node_settings(root), k8s()):
        await registered(kubelet)
        await admit_pod(api, kubelet, "a", memory=3, compute=40)
        deadline = time.monotonic() + 20  # generous: CI shares 2 cores
        while time.monotonic() < deadline:
            raw = api.node_annotations(NODE).get(NODE_GPU_DEVICES)
            if raw and json.loads(raw)["gpus"][0]["memoryUnitsFree"] == 13:
                break
            await asyncio.sleep(0.05)
        devices = json.loads(api.node_annotations(NODE)[NODE_GPU_DEVICES])
        assert devices["memoryUnitMiB"] == 1024
        assert [(g["uuid"], g["memoryUnits"], g["memoryUnitsFree"], g["computeUnitsFree"], g["healthy"])
                for g in devices["gpus"]] == [(sim_uuid(0, NODE), 16, 13, 60, True), (sim_uuid(1, NODE), 16, 16, 100, True)]


async def test_refused_second_resource_abandons_the_half_made_allocation(root, kubelet):
    # Without an API server the agent places memory knowing nothing of the compute that follows.
    async with running_agent(node_settings(root)) as running:
        await registered(kubelet)
        await kubelet.admit("default", "hog", "main", {MEM: 1, SM: 95})  # GPU 0: 5 % compute left
        with pytest.raises(AdmissionError) as err:
            await kubelet.admit("default", "late", "main", {MEM: 4, SM: 20})  # binpack: memory to GPU 0
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "the container needs 20 there" in err.value.details
        assert len(running.agent.ledger.allocations) == 1  # the half-made allocation is gone
        assert len(list((root / "ws").iterdir())) == 1
        # kubelet frees what it gave the failed pod; those units are usable at once.
        kubelet.remove_pod("default", "late")
        answers = await kubelet.admit("default", "small", "main", {MEM: 15, SM: 5})
        assert answers[MEM].envs[ENV_VISIBLE_DEVICES] == sim_uuid(0, NODE)


async def test_app_container_reuses_its_init_containers_devices(root, kubelet, api, k8s):
    pod = make_pod("staged", node=NODE, restart_policy="Never",
                   init_containers=[{"name": "prepare", "memory": 2, "compute": 10}],
                   containers=[{"name": "main", "memory": 2, "compute": 10}])
    api.add_pod(pod)
    async with running_agent(node_settings(root), k8s()) as running:
        await registered(kubelet)
        # kubelet allocates every container at admission, before any runs, reusing the init container's devices.
        init = await kubelet.admit("default", "staged", "prepare", {MEM: 2, SM: 10})
        main = await kubelet.admit("default", "staged", "main", {MEM: 2, SM: 10}, reuse_from="prepare")
        api.set_container_terminated("default", "staged", "prepare", exit_code=0, init=True)
        held = kubelet.assigned
        keys = {k.container: k for k in held}
        assert held[keys["main"]] == held[keys["prepare"]]  # kubelet reused the very same device IDs
        assert main[MEM].envs[ENV_VISIBLE_DEVICES] == init[MEM].envs[ENV_VISIBLE_DEVICES]
        by_container = {a.container: a for a in running.agent.ledger.allocations.values()}
        assert by_container["main"].all_ids() == {i for ids in held[keys["main"]].values() for i in ids}
        assert not by_container.get("prepare") or not by_container["prepare"].all_ids()


async def test_container_cannot_hurt_the_agent_through_its_folder(root, kubelet, api, k8s):
    """The container's /run/alnair is writable by it: a truncated region, a region replaced by a link to a host
    file, and garbage in the slots must neither crash the agent nor make it write outside the folder."""
    victim = root / "host-file"
    victim.write_bytes(b"precious")
    async with running_agent(node_settings(root), k8s()) as running:
        await registered(kubelet)
        answers = [await admit_pod(api, kubelet, f"evil-{n}", memory=1, compute=10) for n in range(3)]
        folders = [Path(next(m.host_path for m in a[MEM].mounts if m.container_path == "/run/alnair")) for a in answers]
        assert all(not (f / "allocation.json").exists() for f in folders)  # the record is out of reach
        await running.agent.reconciler.once()  # the agent now holds every region open
        (folders[0] / "region").write_bytes(b"short")  # truncated under the agent
        (folders[1] / "region").unlink()
        (folders[1] / "region").symlink_to(victim)  # a link to a host file
        with open(folders[2] / "region", "r+b") as f:  # slots full of lies
            f.seek(128)
            f.write(b"\xff" * 64 * 64)
        for _ in range(10):
            await running.agent.reconciler.once()
            running.agent.reconciler.beat()
            await asyncio.sleep(0.05)
        assert victim.read_bytes() == b"precious"
        assert not running.task.done()
        assert len(running.agent.ledger.allocations) == 3


async def test_preferred_allocation_always_includes_what_kubelet_must_include(root, kubelet, api, k8s):
    """v1beta1: GetPreferredAllocation's answer contains must_include_deviceIDs (kubelet already gave them to the
    container: here an init container's devices handed on to an app container that asks for more)."""
    pod = make_pod("grow", node=NODE, restart_policy="Never",
                   init_containers=[{"name": "prepare", "memory": 2}], containers=[{"name": "main", "memory": 5}])
    api.add_pod(pod)
    async with running_agent(node_settings(root), k8s()):
        await registered(kubelet)
        await kubelet.admit("default", "grow", "prepare", {MEM: 2})
        await kubelet.admit("default", "grow", "main", {MEM: 5}, reuse_from="prepare")
        keys = {k.container: k for k in kubelet.assigned}
        main, prepare = kubelet.assigned[keys["main"]][MEM], kubelet.assigned[keys["prepare"]][MEM]
        assert set(prepare) <= set(main) and len(main) == 5  # kubelet checks the answer holds them, too
        assert len({i.split("::")[0] for i in main}) == 1


async def test_an_admission_nobody_can_identify_stalls_no_other(root, kubelet, api, k8s):
    """An Allocate for a pod the agent cannot find waits briefly for the pod watch, without holding up the
    admissions the agent can serve meanwhile."""
    async with running_agent(node_settings(root), k8s()) as running:
        await registered(kubelet)
        running.agent.allocator.pod_wait_s = 1.5
        ghost = asyncio.create_task(kubelet.admit("default", "ghost", "main", {MEM: 3}))  # no such pod
        await asyncio.sleep(0.05)
        started = time.monotonic()
        await admit_pod(api, kubelet, "real", memory=2, compute=10)
        assert time.monotonic() - started < 1.0
        with pytest.raises(AdmissionError) as err:
            await ghost
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "cannot tell which pod kubelet is admitting" in err.value.details


async def test_api_outage_holds_no_reconcile_pass_and_loses_no_final_figures(root, kubelet, api, k8s):
    from alnair_agent.node.reconcile import FINAL_FLUSH_S

    async with running_agent(node_settings(root, resync_interval_s=60.0), k8s()) as running:
        await registered(kubelet)
        folders = []
        for n in range(3):
            answers = await admit_pod(api, kubelet, f"job-{n}", memory=1, compute=5, restart_policy="Never")
            folders.append(Path(next(m.host_path for m in answers[MEM].mounts if m.container_path == "/run/alnair")))
        await running.agent.reconciler.once()
        api.fail_next("patch_pod", status=503, times=10_000)  # the API server is down for pods
        for n in range(3):
            api.set_container_terminated("default", f"job-{n}", "main", exit_code=0)
            kubelet.remove_pod("default", f"job-{n}")
        await asyncio.sleep(0.3)  # the watch sees the ends
        started = time.monotonic()
        await running.agent.reconciler.once()
        assert time.monotonic() - started < FINAL_FLUSH_S + 1.0  # one bounded wait, not one per container
        assert all(f.is_dir() for f in folders)  # kept until their last figures are written
        api.clear_failures()
        deadline = time.monotonic() + 20
        while any(f.exists() for f in folders) and time.monotonic() < deadline:
            await running.agent.reconciler.once()
            await asyncio.sleep(0.1)
        assert not any(f.exists() for f in folders)
        for n in range(3):
            entry = json.loads(api.pod_annotations("default", f"job-{n}")[USAGE_ANNOTATION])["main"]
            assert entry["state"] == "ended"


async def test_kubelets_record_corrects_an_allocations_identity(root, kubelet, api, k8s):
    """pod-resources is the truth about who holds what: a record whose devices kubelet reports for another
    container is rewritten to that container, and its folder is kept while kubelet reports it."""
    from alnair_standins.kubelet import ContainerKey

    async with running_agent(node_settings(root), k8s()) as running:
        await registered(kubelet)
        await admit_pod(api, kubelet, "recorded", memory=2, compute=10)
        truth = api.add_pod(make_pod("truth", node=NODE, containers=[{"name": "worker", "memory": 2, "compute": 10}]))
        key = next(k for k in kubelet.assigned if k.pod == "recorded")
        kubelet.assigned[ContainerKey("default", "truth", "worker")] = kubelet.assigned.pop(key)
        await running.agent.reconciler.once()
        [alloc] = running.agent.ledger.allocations.values()
        assert (alloc.pod_name, alloc.container, alloc.pod_uid) == ("truth", "worker", truth["metadata"]["uid"])
        api.delete_pod("default", "recorded")  # the pod the record first named is gone: nothing of truth's goes
        for _ in range(3):
            await running.agent.reconciler.once()
        assert [a.pod_name for a in running.agent.ledger.allocations.values()] == ["truth"]


def test_simulated_gpus_of_two_nodes_never_share_a_uuid():
    assert {sim_uuid(i, "node-a") for i in range(4)}.isdisjoint({sim_uuid(i, "node-b") for i in range(4)})


@pytest.mark.parametrize("mps", [False, True])
async def test_with_an_mps_pipe_folder_every_container_is_an_mps_client(root, kubelet, api, k8s, mps):
    """ALNAIR_MPS_PIPE_DIR and ALNAIR_MPS_SHM_DIR: both resources' answers (they must agree: kubelet merges them)
    name the pipe folder to CUDA and mount it writable (a client makes its own pipes there), and mount the server's
    /dev/shm, for a one-GPU container and a container whose GPU is shared; without them neither appears."""
    from alnair_agent.constants import CONTAINER_MPS_PIPE_DIR, CONTAINER_MPS_SHM_DIR, ENV_MPS_PIPE_DIRECTORY

    pipes, shm = root / "mps-pipes", root / "mps-shm"
    settings = node_settings(root, mps_pipe_dir=pipes if mps else None, mps_shm_dir=shm if mps else None)
    async with running_agent(settings, k8s()):
        await registered(kubelet)
        for n in range(2):  # the second one shares the first's GPU (binpack)
            answers = await admit_pod(api, kubelet, f"pod-{n}", memory=4, compute=30)
            envs = [answers[MEM].envs, answers[SM].envs]
            assert envs[0] == envs[1]
            mounts = {m.container_path: (m.host_path, m.read_only) for m in answers[MEM].mounts}
            if mps:
                assert envs[0][ENV_MPS_PIPE_DIRECTORY] == CONTAINER_MPS_PIPE_DIR
                assert mounts[CONTAINER_MPS_PIPE_DIR] == (str(pipes), False)
                assert mounts[CONTAINER_MPS_SHM_DIR] == (str(shm), False)
            else:
                assert ENV_MPS_PIPE_DIRECTORY not in envs[0]
                assert CONTAINER_MPS_PIPE_DIR not in mounts and CONTAINER_MPS_SHM_DIR not in mounts
