"""Client of kubelet's pod-resources API (v1.PodResourcesLister) over its unix socket.

kubelet's record of which pod/container holds which device IDs after admission is the authority the agent
reconciles against: to map allocations back to pods, to rebuild state after a restart, to find ended containers.
Only Alnair's two resources are returned.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio

from alnair_agent.constants import RESOURCES
from alnair_agent.proto import podresources_pb2, podresources_pb2_grpc

# kubelet answers List for every pod on the node; with 100+ pods the default 4 MiB cap can be tight.
_MAX_MESSAGE_BYTES = 16 << 20


class PodResourcesError(RuntimeError):
    """kubelet's pod-resources API could not be reached or did not answer in time; the message says which."""


@dataclass(frozen=True)
class DeviceAssignment:
    """Device IDs of one Alnair resource held by one container, as kubelet records them."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: tuple[str, ...]


class PodResourcesClient:
    """`await client.list()` → the Alnair device assignments on this node. One channel, opened on first use,
    reused (kubelet restarts are survived: gRPC reconnects on the next call). Close with `await client.close()`
    or use `async with`."""

    def __init__(self, socket_path: str | Path, timeout_s: float = 5.0,
                 resources: Collection[str] = RESOURCES) -> None:
        self.socket_path = Path(socket_path)
        self.timeout_s = timeout_s
        self._resources = frozenset(resources)
        self._channel: grpc.aio.Channel | None = None

    async def __aenter__(self) -> PodResourcesClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._channel is not None:
            channel, self._channel = self._channel, None
            await channel.close()

    def _stub(self) -> podresources_pb2_grpc.PodResourcesListerStub:
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(
                "unix://" + str(self.socket_path),
                options=[
                    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
                    # A local socket is cheap to retry; after a kubelet restart, reconnect within a second.
                    ("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 1000),
                ],
            )
        return podresources_pb2_grpc.PodResourcesListerStub(self._channel)

    async def _list_reply(self) -> podresources_pb2.ListPodResourcesResponse:
        if not self.socket_path.exists():
            raise PodResourcesError(f"kubelet pod-resources socket {self.socket_path} does not exist")
        try:
            return await self._stub().List(podresources_pb2.ListPodResourcesRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            raise PodResourcesError(
                f"pod-resources List on {self.socket_path} failed: {e.code().name}: {e.details()}") from None

    async def list_claims(self) -> set[tuple[str, str]]:
        """(namespace, name) of every ResourceClaim kubelet reports a container of this node using (DRA)."""
        reply = await self._list_reply()
        return {(d.claim_namespace or pod.namespace, d.claim_name) for pod in reply.pod_resources
                for container in pod.containers for d in container.dynamic_resources if d.claim_name}

    async def list(self) -> list[DeviceAssignment]:
        """Every (namespace, pod, container, resource, device_ids) of our resources; PodResourcesError when
        the socket is missing, kubelet is unavailable, or no answer comes within `timeout_s`."""
        reply = await self._list_reply()
        out: list[DeviceAssignment] = []
        for pod in reply.pod_resources:
            for container in pod.containers:
                for devices in container.devices:
                    if devices.resource_name in self._resources and devices.device_ids:
                        out.append(DeviceAssignment(pod.namespace, pod.name, container.name,
                                                    devices.resource_name, tuple(devices.device_ids)))
        return out


async def list_assignments(socket_path: str | Path, timeout_s: float = 5.0) -> list[DeviceAssignment]:
    """One-shot `PodResourcesClient(socket_path, timeout_s).list()`, closing the channel after."""
    async with PodResourcesClient(socket_path, timeout_s) as client:
        return await client.list()
