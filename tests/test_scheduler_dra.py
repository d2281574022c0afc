"""DRA pods keep their profile: alnair-scheduler's prioritize-only verb scores nodes by how much of their Alnair DRA
capacity is booked, from watches of ResourceSlices and ResourceClaims (the API server stand-in, through the real
kubernetes-asyncio client and the shared reflector): cost-saving packs onto the fullest node, high-performance
spreads to the emptiest; pods of other schedulers or without claims get no opinion."""

from __future__ import annotations

import asyncio
import contextlib
import json

from aiohttp.test_utils import TestClient, TestServer

from alnair_agent.constants import DRA_DEVICE_CLASS, RESOURCE_COMPUTE, RESOURCE_MEMORY
from alnair_agent.dra import capacity
from alnair_agent.gpu.backend import GpuInfo
from alnair_agent.kube.resourceapi import ResourceApi
from alnair_agent.node.inventory import Gpu
from alnair_agent.scheduler.dra import DraView, dra_reflectors
from alnair_agent.scheduler.server import build_app
from alnair_agent.scheduler.view import ClusterView
from alnair_standins.dra_allocator import Allocator
from alnair_standins.dra_node import claim_spec, device_class

GiB = 1 << 30


def slice_body(node: str, gpus: int) -> dict:
    devices = [capacity.device_json(Gpu(GpuInfo(i, f"GPU-{node}-{i}", "Sim", 16 * GiB, "", i),
                                        {RESOURCE_MEMORY: 16, RESOURCE_COMPUTE: 100}), GiB) for i in range(gpus)]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": capacity.slice_name(node)}, "spec": capacity.slice_spec(node, devices, 1)}


def extender_args(scheduler: str, claims: bool, nodes: list[str]) -> dict:
    spec: dict = {"schedulerName": scheduler, "containers": [{"name": "main", "image": "x"}]}
    if claims:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "gpu-4gi-30"}]
    return {"Pod": {"metadata": {"name": "p", "namespace": "default", "uid": "u"}, "spec": spec},
            "NodeNames": nodes}


async def wait_for(predicate) -> None:  # type: ignore[no-untyped-def]
    async def loop() -> None:
        while not predicate():
            await asyncio.sleep(0.02)
    await asyncio.wait_for(loop(), 5)


async def test_profiles_pack_or_spread_dra_pods_by_what_their_claims_booked(api):
    client = api.api_client()
    resources = ResourceApi(client)
    for node, gpus in (("node-a", 2), ("node-b", 2)):
        await resources.create_slice(slice_body(node, gpus))
    scheduler = Allocator({DRA_DEVICE_CLASS: device_class()})
    for i in range(2):  # node-a: 2 x (8 GiB + 50 %) of 32 GiB + 200 %: half booked
        claim = api.add_claim({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                               "metadata": {"name": f"c{i}", "namespace": "default"},
                               "spec": claim_spec([{"name": "gpu", "memory": "8Gi", "compute": "50"}])})
        api.set_claim_status("default", f"c{i}", {"allocation": scheduler.allocate(claim, "node-a",
                                                                                   api.resource_slices())})
    view = DraView()
    watches = dra_reflectors(client, view)
    tasks = [asyncio.create_task(w.run(), name=w.name) for w in watches]
    http = TestClient(TestServer(build_app(ClusterView(), None, view)))
    await http.start_server()
    try:
        await asyncio.wait_for(asyncio.gather(*(w.synced.wait() for w in watches)), 5)  # type: ignore[union-attr]

        async def scores(scheduler_name: str, claims: bool = True,
                         nodes: tuple[str, ...] = ("node-a", "node-b", "cpu-node")) -> dict[str, int]:
            resp = await http.post("/prioritize-dra", data=json.dumps(extender_args(scheduler_name, claims,
                                                                                   list(nodes))))
            assert resp.status == 200
            return {h["Host"]: h["Score"] for h in await resp.json()}

        assert await scores("alnair-cost-saving") == {"node-a": 5, "node-b": 0, "cpu-node": 0}
        assert await scores("alnair-high-performance") == {"node-a": 5, "node-b": 10, "cpu-node": 0}
        assert set((await scores("default-scheduler")).values()) == {0}  # not a profile: no opinion
        assert set((await scores("alnair-cost-saving", claims=False)).values()) == {0}  # no claims: no opinion
        # the watches follow: a claim deallocated frees its share, a node's slice withdrawn drops it
        api.set_claim_status("default", "c1", {})
        await wait_for(lambda: len(view.booked) == 1)
        assert (await scores("alnair-high-performance"))["node-a"] == 8  # a quarter booked: 8 of 32 GiB, 50 of 200 %
        await resources.delete_slice(capacity.slice_name("node-b"))
        await wait_for(lambda: len(view.slices) == 1)
        assert (await scores("alnair-high-performance"))["node-b"] == 0
        bad = await http.post("/prioritize-dra", data=b"not json")
        assert bad.status == 200 and await bad.json() == []
    finally:
        await http.close()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await client.close()
