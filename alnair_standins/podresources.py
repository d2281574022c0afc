"""A stand-in for kubelet's pod-resources API: a grpc.aio server on a unix socket serving v1.PodResourcesLister
(List, GetAllocatableResources, Get) from an in-memory table the test controls.

Usage:
    async with FakePodResources() as kubelet:            # socket in a fresh short temp dir (unix paths are short)
        kubelet.set("default", "p1", "main", "alnair/vgpu-memory", ["GPU-0::mem::0", "GPU-0::mem::1"])
        kubelet.remove_pod("default", "p1")
        kubelet.allocatable["alnair/vgpu-memory"] = ["GPU-0::mem::0", ...]   # for GetAllocatableResources
        kubelet.fail_next(grpc.StatusCode.UNAVAILABLE, times=1)
        kubelet.delay_s = 1.0                             # answer every RPC this late
        kubelet.socket_path, kubelet.calls                # calls: how many RPCs were received
    FakePodResources(socket_path=...) serves on a given path instead; `await stop()` removes the socket.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import grpc
import grpc.aio

from alnair_agent.grpc_unix import serve_unix
from alnair_agent.proto import podresources_pb2 as pb
from alnair_agent.proto import podresources_pb2_grpc as pb_grpc

# (namespace, pod) -> container -> resource -> device IDs. Insertion order is kept, as kubelet's is stable.
Table = dict[tuple[str, str], dict[str, dict[str, list[str]]]]


class _Servicer(pb_grpc.PodResourcesListerServicer):
    def __init__(self, fake: FakePodResources) -> None:
        self._fake = fake

    async def _check(self, context: grpc.aio.ServicerContext) -> None:
        self._fake.calls += 1
        if self._fake.delay_s:
            await asyncio.sleep(self._fake.delay_s)
        if self._fake._failures:
            code = self._fake._failures.pop(0)
            await context.abort(code, "injected failure")

    async def List(self, request: pb.ListPodResourcesRequest, context: grpc.aio.ServicerContext
                   ) -> pb.ListPodResourcesResponse:
        await self._check(context)
        return pb.ListPodResourcesResponse(
            pod_resources=[self._fake._pod(ns, name) for (ns, name) in self._fake.table])

    async def Get(self, request: pb.GetPodResourcesRequest, context: grpc.aio.ServicerContext
                  ) -> pb.GetPodResourcesResponse:
        await self._check(context)
        key = (request.pod_namespace, request.pod_name)
        if key not in self._fake.table:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"pod {key[0]}/{key[1]} not found")
        return pb.GetPodResourcesResponse(pod_resources=self._fake._pod(*key))

    async def GetAllocatableResources(self, request: pb.AllocatableResourcesRequest,
                                      context: grpc.aio.ServicerContext) -> pb.AllocatableResourcesResponse:
        await self._check(context)
        return pb.AllocatableResourcesResponse(devices=[
            pb.ContainerDevices(resource_name=r, device_ids=ids) for r, ids in self._fake.allocatable.items()])


class FakePodResources:
    """The pod-resources server; see the module docstring."""

    def __init__(self, socket_path: str | Path | None = None) -> None:
        self._tmpdir: str | None = None
        if socket_path is None:
            self._tmpdir = tempfile.mkdtemp(prefix="podres-", dir="/tmp")
            socket_path = Path(self._tmpdir) / "kubelet.sock"
        self.socket_path = Path(socket_path)
        self.table: Table = {}
        self.allocatable: dict[str, list[str]] = {}
        self.calls = 0
        self.delay_s = 0.0  # each RPC waits this long before answering (to test client timeouts)
        self._failures: list[grpc.StatusCode] = []
        self._server: grpc.aio.Server | None = None

    # -- lifetime --------------------------------------------------------------------------------------------
    async def start(self) -> FakePodResources:
        self._server = await serve_unix(self.socket_path,
                                        lambda s: pb_grpc.add_PodResourcesListerServicer_to_server(_Servicer(self), s))
        return self

    async def stop(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            await server.stop(grace=None)
        self.socket_path.unlink(missing_ok=True)
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    async def __aenter__(self) -> FakePodResources:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- test hooks ------------------------------------------------------------------------------------------
    def set(self, namespace: str, pod: str, container: str, resource: str, device_ids: list[str]) -> None:
        """Record that `container` of `pod` holds `device_ids` of `resource` (replacing what it held)."""
        self.table.setdefault((namespace, pod), {}).setdefault(container, {})[resource] = list(device_ids)

    def remove_pod(self, namespace: str, pod: str) -> None:
        self.table.pop((namespace, pod), None)

    def clear(self) -> None:
        self.table.clear()

    def fail_next(self, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE, times: int = 1) -> None:
        """The next `times` RPCs fail with `code`."""
        self._failures.extend([code] * times)

    def _pod(self, namespace: str, name: str) -> pb.PodResources:
        containers = self.table.get((namespace, name), {})
        return pb.PodResources(name=name, namespace=namespace, containers=[
            pb.ContainerResources(name=c, devices=[pb.ContainerDevices(resource_name=r, device_ids=ids)
                                                   for r, ids in res.items()])
            for c, res in containers.items()])
