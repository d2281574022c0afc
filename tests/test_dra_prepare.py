"""The DRA front-end through its real interfaces: kubelet's plugin watcher and NodePrepareResources over unix-socket
gRPC (the DRA kubelet emulator), ResourceSlices and ResourceClaims on the API server stand-in through the real
kubernetes-asyncio client, claims allocated by the allocator stand-in as kube-scheduler allocates them."""

from __future__ import annotations

from fakes.dra import dra_node

from alnair_agent.constants import ENV_COMPUTE_LIMIT, ENV_MEMORY_LIMIT, ENV_VISIBLE_DEVICES


async def test_a_claim_of_4_gib_and_30_percent_gives_its_container_that_slice(root, api):
    async with dra_node(root, api) as node:
        node.claim("c1", [{"name": "gpu", "memory": "4Gi", "compute": "30"}])
        pod = node.pod("p1", {"gpu": "c1"}, [("main", [("gpu", None)])])
        node.schedule(pod, ["c1"])
        views = await node.start(pod)
        env = views["main"].envs
        assert env[ENV_MEMORY_LIMIT] == str(4 << 30) and env[ENV_COMPUTE_LIMIT] == "30"
        assert env[ENV_VISIBLE_DEVICES].startswith("GPU-")
        await node.finish(pod)
        assert not node.running.agent.allocator.allocations
