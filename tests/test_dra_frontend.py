"""How a node chooses its front-end (ALNAIR_FRONTEND, and `auto` by what the API server serves), and that a GPU is
never offered by both: a switch leaves what the other front-end holds counted in the one ledger."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from alnair_agent.config import ConfigError
from alnair_agent.constants import (
    DRA_DRIVER,
    DRA_PLUGIN_TYPE,
    DRA_SERVICES,
    ENV_MEMORY_LIMIT,
    RESOURCE_COMPUTE,
    RESOURCE_MEMORY,
)
from alnair_agent.dra import frontend
from alnair_agent.dra.capacity import slice_name
from alnair_agent.kube.resourceapi import ResourceApi
from alnair_agent.proto import pluginregistration_pb2 as reg
from alnair_agent.proto import pluginregistration_pb2_grpc as reg_grpc
from alnair_standins.apiserver import make_pod
from alnair_standins.dra_node import device_class, dra_node
from alnair_standins.kubelet import KubeletEmulator
from alnair_standins.kubelet_dra import DraKubeletEmulator
from alnair_standins.node import (
    NODE,
    kubernetes_for,
    node_settings,
    registered,
    running_agent,
)


async def choose(api, wanted: str, root) -> frontend.Choice:  # type: ignore[no-untyped-def]
    client = api.api_client()
    try:
        return await frontend.choose(node_settings(root, frontend=wanted), ResourceApi(client))
    finally:
        await client.close()


async def test_auto_chooses_dra_only_where_the_api_server_serves_it_and_the_cluster_opted_in(root, api):
    no_class = await choose(api, "auto", root)
    assert no_class.frontend == "device-plugin" and "DeviceClass gpu.alnair.centaurus.io does not exist" in no_class.reason
    api.add_device_class(device_class())
    ok = await choose(api, "auto", root)
    assert ok.frontend == "dra" and "consumable capacity" in ok.reason
    assert not api.resource_slices()  # the check was a dry run
    api.consumable_capacity = False  # an API server without DRAConsumableCapacity drops the fields
    old = await choose(api, "auto", root)
    assert old.frontend == "device-plugin" and "DRAConsumableCapacity" in old.reason
    api.serve_dra = False  # Kubernetes before 1.34
    older = await choose(api, "auto", root)
    assert older.frontend == "device-plugin" and "does not serve resource.k8s.io/v1" in older.reason
    assert (await frontend.choose(node_settings(root), None)).frontend == "device-plugin"  # no API server


async def test_an_explicit_choice_wins_and_an_impossible_dra_says_why(root, api):
    api.add_device_class(device_class())
    assert (await choose(api, "device-plugin", root)).frontend == "device-plugin"
    api.consumable_capacity = False
    with pytest.raises(ConfigError, match="ALNAIR_FRONTEND=dra cannot be served: .*DRAConsumableCapacity"):
        await choose(api, "dra", root)
    with pytest.raises(ConfigError, match="ALNAIR_FRONTEND=dra cannot be served: no API server"):
        await frontend.choose(node_settings(root, frontend="dra"), None)


async def test_a_dra_node_offers_no_device_plugin_and_a_device_plugin_node_no_slice(root, api):
    async with dra_node(root / "a", api) as node:
        assert node.running.agent.plugin is node.running.agent.dra
        assert not list((root / "a" / "dp").glob("*.sock"))  # no device plugin socket
    api.add_device_class(device_class())
    settings = node_settings(root / "b", frontend="device-plugin", plugins_registry_dir=root / "b" / "reg",
                             cdi_dir=root / "b" / "cdi", dra_plugin_dir=root / "b" / "dra")
    client = api.api_client()
    try:
        async with KubeletEmulator(settings.device_plugin_dir, settings.pod_resources_socket) as kubelet:
            async with running_agent(settings, kubernetes_for(client, dra=True)) as running:
                await registered(kubelet)
                assert running.agent.frontend == "device-plugin" and running.agent.dra is None
                assert api.resource_slice(slice_name(NODE)) is None  # the DRA-mode node's slice was withdrawn
                assert not (root / "b" / "reg").exists()
    finally:
        await client.close()


async def test_switching_a_node_keeps_what_the_other_front_end_holds(root, api):
    """DRA -> device plugin: the claim prepared before stays served (prepare again, unprepare) and its units stay
    held; device plugin -> DRA: a GPU device plugin containers hold stays out of the slice until they end."""
    async with dra_node(root, api) as node:
        node.claim("c1", [{"name": "gpu", "memory": "12Gi", "compute": "60"}])
        pod = node.pod("p1", {"gpu": "c1"}, [("main", [("gpu", None)])])
        node.schedule(pod, ["c1"])
        await node.start(pod)
        ref = node.refs(pod)["gpu"]
        gpu = node.running.agent.ledger.allocations[next(iter(node.running.agent.ledger.allocations))].gpu_uuid
        settings = node.settings
    dp = node_settings(root, frontend="device-plugin", plugins_registry_dir=settings.plugins_registry_dir,
                       cdi_dir=settings.cdi_dir, dra_plugin_dir=settings.dra_plugin_dir)
    client = api.api_client()
    try:
        async with KubeletEmulator(dp.device_plugin_dir) as kubelet, \
                DraKubeletEmulator(dp.plugins_registry_dir, dp.cdi_dir, dp.pod_resources_socket) as dra_kubelet:
            async with running_agent(dp, kubernetes_for(client, dra=True)) as running:
                await registered(kubelet)
                await dra_kubelet.wait_registered(DRA_DRIVER)  # the leftover claim is still served
                assert running.agent.frontend == "device-plugin" and not api.resource_slices()
                room = next(r for r in running.agent.ledger.rooms() if r.uuid == gpu)
                assert (room.memory_free, room.compute_free) == (4, 40)  # the claim's units stay held
                await dra_kubelet.prepare(DRA_DRIVER, [ref])  # kubelet restarted: prepares again, same slice
                assert len(running.agent.ledger.allocations) == 1
                node.claim("c2", [{"name": "gpu", "memory": "1Gi"}])
                pod2 = node.pod("p2", {"gpu": "c2"}, [("main", [("gpu", None)])])
                api.set_claim_status("default", "c2", {"allocation": {"devices": {"results": [
                    {"request": "gpu", "driver": DRA_DRIVER, "pool": NODE, "device": "gpu-0",
                     "consumedCapacity": {"memory": "1Gi", "compute": "0"}}]}}})
                ref2 = node.refs(pod2)["gpu"]
                errors = await dra_kubelet.prepare_once(DRA_DRIVER, [ref2])
                assert "offered by the device plugin" in errors[ref2.uid]  # nothing new through DRA
                # the device plugin admits a container; it sees the claim's units as taken
                api.add_pod(make_pod("dp-pod", containers=[{"name": "main", "memory": 4, "compute": 10}]))
                await kubelet.admit("default", "dp-pod", "main", {RESOURCE_MEMORY: 4, RESOURCE_COMPUTE: 10})
                await dra_kubelet.unprepare(DRA_DRIVER, [ref])
                assert len(running.agent.ledger.allocations) == 1
                dp_gpus = {a.gpu_uuid for a in running.agent.ledger.allocations.values()}
    finally:
        await client.close()
    async with dra_node(root, api) as node:  # back to DRA: the device plugin container's GPU stays out
        [s] = node.slices()
        published = {d["attributes"]["uuid"]["string"] for d in s["spec"]["devices"]}
        assert published.isdisjoint(dp_gpus) and len(published) == 1


async def test_a_dra_agent_exits_with_a_clear_message_where_dra_cannot_be(root, api):
    api.consumable_capacity = False
    client = api.api_client()
    try:
        with pytest.raises(ConfigError, match="DRAConsumableCapacity"):
            async with running_agent(node_settings(root, frontend="dra"), kubernetes_for(client, dra=True)):
                await asyncio.sleep(0)
    finally:
        await client.close()


@pytest.mark.parametrize("removed", [("registration",), ("dra",), ("registration", "dra")])
async def test_sockets_removed_under_the_dra_plugin_are_served_again_and_stay(root, api, removed):
    """An operator or a kubelet cleanup removes the plugin's sockets, three times over: each time the plugin serves
    them again, the watcher registers it again, the sockets are still there a while later (no stopping server of an
    earlier serve takes the new ones with it) and a claim prepares through them."""
    async with dra_node(root, api) as node:
        plugin = node.running.agent.dra.plugin
        paths = {"registration": plugin.registration_path, "dra": plugin.socket_path}
        for i in range(3):
            since = sum(d == DRA_DRIVER for d, _ in node.kubelet.registrations)
            for name in removed:
                paths[name].unlink()
            await node.kubelet.wait_registered(DRA_DRIVER, since=since)
            await asyncio.sleep(0.5)  # past REREGISTER_POLL_S and a stopped server's grace
            assert all(p.is_socket() for p in paths.values()), [str(p) for p in paths.values() if not p.exists()]
            node.claim(f"c{i}", [{"name": "gpu", "memory": "1Gi"}])
            pod = node.pod(f"p{i}", {"gpu": f"c{i}"}, [("main", [("gpu", None)])])
            node.schedule(pod, [f"c{i}"])
            views = await node.start(pod)
            assert views["main"].envs[ENV_MEMORY_LIMIT] == str(1 << 30), views["main"].envs


async def test_kubelet_tries_a_failed_registration_again_while_the_socket_is_there(root):
    """As kubelet's reconciler does: a plugin whose GetInfo failed (a server still starting, one stopping as the
    watcher dialled it) is registered on a later try, without its socket being made again."""
    registry = root / "registry"
    registry.mkdir(parents=True)
    path = registry / "flaky.example.com-reg.sock"

    class Flaky(reg_grpc.RegistrationServicer):
        def __init__(self) -> None:
            self.calls = 0

        async def GetInfo(self, request, context):  # type: ignore[no-untyped-def]
            self.calls += 1
            if self.calls <= 2:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "still starting")
            return reg.PluginInfo(type=DRA_PLUGIN_TYPE, name="flaky.example.com", endpoint=str(path),
                                  supported_versions=list(DRA_SERVICES))

        async def NotifyRegistrationStatus(self, request, context):  # type: ignore[no-untyped-def]
            return reg.RegistrationStatusResponse()

    flaky = Flaky()
    server = grpc.aio.server()
    reg_grpc.add_RegistrationServicer_to_server(flaky, server)
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    try:
        async with DraKubeletEmulator(registry, root / "cdi") as kubelet:
            await kubelet.wait_registered("flaky.example.com", timeout=3.0)
            assert flaky.calls == 3 and len(kubelet.refusals) == 2, kubelet.refusals
            assert all("GetInfo failed: UNAVAILABLE" in r for r in kubelet.refusals)
    finally:
        await server.stop(None)
