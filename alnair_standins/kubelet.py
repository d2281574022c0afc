"""An in-process kubelet emulator speaking the real device plugin and pod-resources protocols over unix sockets.

Used by the demo (`alnair-agent --demo`) and the tests. It does what kubelet's device manager does:
serves `Registration` on kubelet.sock, dials each registered plugin back, reads `ListAndWatch`, and admits
containers by calling `GetPreferredAllocation` then `Allocate` per resource, in sequence, handing out only
healthy devices it has not given to anyone else (its own checkpoint, which survives plugin restarts). It also
serves `v1.PodResourcesLister` from that checkpoint, as kubelet does. It restarts as kubelet does (the socket folder
emptied, a new kubelet.sock) and crashes as a killed kubelet does (kubelet.sock left on disk, refusing connections).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from alnair_agent.constants import (
    DEVICE_PLUGIN_API_VERSION,
    HEALTHY,
    KUBELET_SOCKET_NAME,
)
from alnair_agent.grpc_unix import serve_unix
from alnair_agent.proto import deviceplugin_pb2 as pb
from alnair_agent.proto import deviceplugin_pb2_grpc as pb_grpc
from alnair_agent.proto import podresources_pb2 as prpb
from alnair_agent.proto import podresources_pb2_grpc as prpb_grpc


class AdmissionError(Exception):
    """kubelet could not admit the container: the plugin refused (grpc code and details) or devices ran out."""

    def __init__(self, resource: str, code: grpc.StatusCode | None, details: str) -> None:
        super().__init__(f"{resource}: {code.name if code else 'kubelet'}: {details}")
        self.resource = resource
        self.code = code
        self.details = details


@dataclass
class PluginView:
    """What the emulated kubelet knows of one registered plugin."""

    resource: str
    endpoint: str
    options: pb.DevicePluginOptions
    channel: grpc.aio.Channel
    stub: pb_grpc.DevicePluginStub
    devices: dict[str, str] = field(default_factory=dict)  # ID -> health
    updates: list[dict[str, str]] = field(default_factory=list)
    reader: asyncio.Task[None] | None = None


@dataclass(frozen=True)
class ContainerKey:
    namespace: str
    pod: str
    container: str


async def serve_pod_resources(socket: Path, servicer: prpb_grpc.PodResourcesListerServicer) -> grpc.aio.Server:
    """kubelet's pod-resources API on `socket` (a fresh socket file), served by `servicer`."""
    socket.parent.mkdir(parents=True, exist_ok=True)
    return await serve_unix(socket, lambda s: prpb_grpc.add_PodResourcesListerServicer_to_server(servicer, s))


class KubeletEmulator:
    def __init__(self, plugin_dir: Path, pod_resources_socket: Path | None = None) -> None:
        self.plugin_dir = plugin_dir
        self.pod_resources_socket = pod_resources_socket
        self.plugins: dict[str, PluginView] = {}
        self.registrations: list[str] = []  # resource names, in the order Register arrived
        # kubelet's checkpoint: which container holds which device IDs of which resource.
        self.assigned: dict[ContainerKey, dict[str, list[str]]] = {}
        self.responses: dict[ContainerKey, dict[str, pb.ContainerAllocateResponse]] = {}
        # (rpc name, resource, seconds) of every admission call, as kubelet would see its latency.
        self.call_times: list[tuple[str, str, float]] = []
        # Fault injection (tests): refuse this many Register calls (UNAVAILABLE), as a kubelet still starting does.
        self.refuse_registrations = 0
        self.refused: list[str] = []
        self._server: grpc.aio.Server | None = None
        self._pr_server: grpc.aio.Server | None = None
        self._changed = asyncio.Condition()

    # -- lifetime --------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        await self._start_registration()
        if self.pod_resources_socket is not None:
            self._pr_server = await serve_pod_resources(self.pod_resources_socket, _PodResources(self))

    async def _start_registration(self) -> None:
        self._server = await serve_unix(self.plugin_dir / KUBELET_SOCKET_NAME,
                                        lambda s: pb_grpc.add_RegistrationServicer_to_server(_Registration(self), s))

    async def _drop_plugins(self) -> None:
        plugins, self.plugins = self.plugins, {}
        for view in plugins.values():
            if view.reader is not None:
                view.reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await view.reader
            await view.channel.close()

    async def stop(self) -> None:
        await self._drop_plugins()
        for server in (self._server, self._pr_server):
            if server is not None:
                await server.stop(grace=0.2)
        self._server = self._pr_server = None

    async def restart(self, dies: bool = False) -> None:
        """What a kubelet restart looks like to plugins: every socket in the folder gone, a new kubelet.sock.

        `dies`: the new kubelet dies as it starts, before any plugin reaches it (one turn of a crash loop): its
        kubelet.sock is a new file that refuses connections."""
        await self._drop_plugins()
        if self._server is not None:
            await self._server.stop(grace=0.2)
            self._server = None
        for entry in self.plugin_dir.iterdir():
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        if dies:
            self._leave_dead_socket()
        else:
            await self._start_registration()

    async def crash(self) -> None:
        """What a killed kubelet (SIGKILL, OOM, panic) leaves: its connections to the plugins dropped and the same
        kubelet.sock file on disk with nobody listening, so a connection to it is refused until a new kubelet
        replaces it. The plugin sockets stay."""
        await self._drop_plugins()
        sock = self.plugin_dir / KUBELET_SOCKET_NAME
        if self._server is not None:
            # gRPC removes its socket file as it stops; a killed process removes nothing: keep the file by a
            # second name across the stop, so the path keeps its inode.
            keep = sock.with_name(sock.name + ".dead")
            os.link(sock, keep)
            await self._server.stop(grace=None)
            self._server = None
            os.replace(keep, sock)
        elif not sock.exists():
            self._leave_dead_socket()

    def _leave_dead_socket(self) -> None:
        sock = self.plugin_dir / KUBELET_SOCKET_NAME
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
            dead.bind(str(sock))  # bound, never listening: the file stays and connect() is refused

    async def __aenter__(self) -> "KubeletEmulator":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- registration and ListAndWatch -------------------------------------------------------------------------
    async def _on_register(self, request: pb.RegisterRequest) -> None:
        if request.version != DEVICE_PLUGIN_API_VERSION:
            raise ValueError(f"unsupported device plugin API version {request.version!r}")
        old = self.plugins.pop(request.resource_name, None)
        if old is not None:
            if old.reader is not None:
                old.reader.cancel()
            await old.channel.close()
        channel = grpc.aio.insecure_channel(f"unix://{self.plugin_dir / request.endpoint}")
        stub = pb_grpc.DevicePluginStub(channel)
        view = PluginView(request.resource_name, request.endpoint, request.options, channel, stub)
        view.options = await stub.GetDevicePluginOptions(pb.Empty(), timeout=5)
        self.plugins[request.resource_name] = view
        self.registrations.append(request.resource_name)
        view.reader = asyncio.create_task(self._read(view), name=f"kubelet-listandwatch-{request.resource_name}")

    async def _read(self, view: PluginView) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            async for update in view.stub.ListAndWatch(pb.Empty()):
                view.devices = {d.ID: d.health for d in update.devices}
                view.updates.append(dict(view.devices))
                async with self._changed:
                    self._changed.notify_all()

    async def wait_for(self, predicate, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
        """Wait until predicate(self) holds (re-checked on every ListAndWatch update and every 50 ms)."""
        async def loop() -> None:
            while not predicate(self):
                async with self._changed:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), 0.05)
        await asyncio.wait_for(loop(), timeout)

    def healthy_devices(self, resource: str) -> list[str]:
        view = self.plugins.get(resource)
        return [i for i, h in view.devices.items() if h == HEALTHY] if view else []

    # -- admission ---------------------------------------------------------------------------------------------
    async def admit(self, namespace: str, pod: str, container: str, requests: dict[str, int],
                    reuse_from: str | None = None) -> dict[str, pb.ContainerAllocateResponse]:
        """Admit one container asking for `requests` (resource -> units), one resource after the other.

        `reuse_from` names an init container of the same pod whose devices kubelet reuses first, as kubelet does
        for app containers (it then skips GetPreferredAllocation when they suffice)."""
        key = ContainerKey(namespace, pod, container)
        donor = self.assigned.get(ContainerKey(namespace, pod, reuse_from), {}) if reuse_from else {}
        answers: dict[str, pb.ContainerAllocateResponse] = {}
        for resource, count in requests.items():
            if count <= 0:
                continue
            view = self.plugins.get(resource)
            if view is None:
                raise AdmissionError(resource, None, "no device plugin registered for this resource")
            reusable = donor.get(resource, [])[:count]
            held = {i for c in self.assigned.values() for i in c.get(resource, [])}
            available = reusable + [i for i in self.healthy_devices(resource) if i not in held]
            if len(available) < count:
                raise AdmissionError(resource, None, f"only {len(available)} devices free, need {count}")
            chosen = available[:count]
            try:
                if view.options.get_preferred_allocation_available and len(reusable) < count:
                    t0 = time.perf_counter()
                    pref = await view.stub.GetPreferredAllocation(pb.PreferredAllocationRequest(container_requests=[
                        pb.ContainerPreferredAllocationRequest(available_deviceIDs=available,
                                                               must_include_deviceIDs=reusable, allocation_size=count)
                    ]), timeout=10)
                    self.call_times.append(("GetPreferredAllocation", resource, time.perf_counter() - t0))
                    chosen = list(pref.container_responses[0].deviceIDs)
                    if len(chosen) != count or not set(chosen) <= set(available):
                        raise AdmissionError(resource, None, f"plugin preferred unusable devices {chosen}")
                t0 = time.perf_counter()
                resp = await view.stub.Allocate(pb.AllocateRequest(
                    container_requests=[pb.ContainerAllocateRequest(devices_ids=chosen)]), timeout=10)
                self.call_times.append(("Allocate", resource, time.perf_counter() - t0))
            except grpc.aio.AioRpcError as e:
                raise AdmissionError(resource, e.code(), e.details() or "") from None
            self.assigned.setdefault(key, {})[resource] = chosen
            answers[resource] = resp.container_responses[0]
        self.responses[key] = answers
        return answers

    async def allocate_raw(self, resource: str, device_ids: list[str]) -> pb.AllocateResponse:
        """Call Allocate with any device IDs (for tests of bad input); raises grpc.aio.AioRpcError."""
        return await self.plugins[resource].stub.Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=device_ids)]), timeout=10)

    def remove_pod(self, namespace: str, pod: str) -> None:
        """The pod is deleted: kubelet frees its devices."""
        for key in [k for k in self.assigned if (k.namespace, k.pod) == (namespace, pod)]:
            del self.assigned[key]
            self.responses.pop(key, None)


class _Registration(pb_grpc.RegistrationServicer):
    def __init__(self, kubelet: KubeletEmulator) -> None:
        self.kubelet = kubelet

    async def Register(self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext) -> pb.Empty:
        if self.kubelet.refuse_registrations > 0:
            self.kubelet.refuse_registrations -= 1
            self.kubelet.refused.append(request.resource_name)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "injected: kubelet refuses registration")
        try:
            await self.kubelet._on_register(request)
        except (ValueError, grpc.aio.AioRpcError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"registration of {request.resource_name}: {e}")
        return pb.Empty()


class _PodResources(prpb_grpc.PodResourcesListerServicer):
    def __init__(self, kubelet: KubeletEmulator) -> None:
        self.kubelet = kubelet

    def _pods(self) -> list[prpb.PodResources]:
        pods: dict[tuple[str, str], prpb.PodResources] = {}
        for key, by_resource in self.kubelet.assigned.items():
            pod = pods.setdefault((key.namespace, key.pod), prpb.PodResources(name=key.pod, namespace=key.namespace))
            pod.containers.append(prpb.ContainerResources(name=key.container, devices=[
                prpb.ContainerDevices(resource_name=r, device_ids=ids) for r, ids in by_resource.items()
            ]))
        return list(pods.values())

    async def List(self, request: prpb.ListPodResourcesRequest, context: grpc.aio.ServicerContext) -> prpb.ListPodResourcesResponse:
        return prpb.ListPodResourcesResponse(pod_resources=self._pods())

    async def GetAllocatableResources(self, request: prpb.AllocatableResourcesRequest,
                                      context: grpc.aio.ServicerContext) -> prpb.AllocatableResourcesResponse:
        return prpb.AllocatableResourcesResponse(devices=[
            prpb.ContainerDevices(resource_name=r, device_ids=list(v.devices)) for r, v in self.kubelet.plugins.items()
        ])

    async def Get(self, request: prpb.GetPodResourcesRequest, context: grpc.aio.ServicerContext) -> prpb.GetPodResourcesResponse:
        for pod in self._pods():
            if (pod.namespace, pod.name) == (request.pod_namespace, request.pod_name):
                return prpb.GetPodResourcesResponse(pod_resources=pod)
        await context.abort(grpc.StatusCode.NOT_FOUND, f"pod {request.pod_namespace}/{request.pod_name} not found")
