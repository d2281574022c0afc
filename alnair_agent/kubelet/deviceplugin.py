"""The kubelet device plugin (v1beta1): one gRPC server per resource on a unix socket, registered with kubelet.

kubelet restarts wipe the socket folder and create a new kubelet.sock; the service notices within
`REREGISTER_POLL_S` and serves and registers again. A refused registration is retried with jittered backoff (up to
`REGISTER_RETRY_MAX_S`), but a new kubelet ends that wait within `REREGISTER_POLL_S`: kubelet.sock replaced (another
inode, or the same inode made again: its creation time), the plugin sockets removed (a starting kubelet empties the
folder), or a kubelet.sock that refused connections now accepting one. So
after a crash loop, however far the backoff had grown, the kubelet that stays up is registered with within a poll.

Each re-serve binds its sockets under new names (`alnair-vgpu-memory.<n>.sock`; the first serve keeps the plain
`alnair-vgpu-memory.sock`), and the Register call names them: a gRPC server that stops unlinks its socket's path
whatever file is there by then, so the previous servers, stopped as new ones bind, removed the new sockets under the
same names (seen: a kubelet that came back after a crash loop refused five Registers in a row, "No such file" for
the plugin socket, and registration took 1.2-1.5 s in 3 of 120 episodes).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import grpc
import structlog

from alnair_agent.constants import (
    DEVICE_PLUGIN_API_VERSION,
    HEALTHY,
    KUBELET_SOCKET_NAME,
    RESOURCES,
    SOCKET_NAME,
    UNHEALTHY,
)
from alnair_agent.grpc_unix import serve_unix
from alnair_agent.kube.events import EventSink
from alnair_agent.kubelet.admission import AllocationError, Allocator
from alnair_agent.node import mps_users
from alnair_agent.node.inventory import Inventory
from alnair_agent.proto import deviceplugin_pb2 as pb
from alnair_agent.proto import deviceplugin_pb2_grpc as pb_grpc

log = structlog.get_logger(__name__)

REREGISTER_POLL_S = 0.1
REGISTER_TIMEOUT_S = 5.0
REGISTER_RETRY_MAX_S = 5.0
STOP_GRACE_S = 0.25  # requests in flight on a plugin socket get this long when it is served again or shut down


class ResourceServicer(pb_grpc.DevicePluginServicer):
    """The DevicePlugin service for one resource."""

    def __init__(self, resource: str, inventory: Inventory, allocator: Allocator, changes: "HealthBoard",
                 events: EventSink | None = None) -> None:
        self.events = events
        self.resource = resource
        self.inventory = inventory
        self.allocator = allocator
        self.changes = changes

    def device_list(self) -> pb.ListAndWatchResponse:
        return pb.ListAndWatchResponse(devices=[
            pb.Device(ID=device_id, health=HEALTHY if healthy else UNHEALTHY)
            for device_id, healthy in self.inventory.device_ids(self.resource)
        ])

    async def GetDevicePluginOptions(self, request: pb.Empty, context: grpc.aio.ServicerContext) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    async def ListAndWatch(self, request: pb.Empty, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ListAndWatchResponse]:
        seen = -1
        while True:
            version = await self.changes.wait_newer(seen)
            if version is None:
                return
            seen = version
            yield self.device_list()

    async def GetPreferredAllocation(self, request: pb.PreferredAllocationRequest,
                                     context: grpc.aio.ServicerContext) -> pb.PreferredAllocationResponse:
        responses = []
        for req in request.container_requests:
            try:
                ids = await self.allocator.preferred(self.resource, list(req.available_deviceIDs),
                                                     list(req.must_include_deviceIDs), req.allocation_size)
            except AllocationError as e:
                log.warning("preferred_allocation_refused", resource=self.resource, size=req.allocation_size,
                            reason=e.message)
                if self.events is not None and e.pod is not None:
                    self.events.pod_refused(e.pod.namespace, e.pod.name, e.pod.uid, e.message)
                await context.abort(e.code, e.message)
            responses.append(pb.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return pb.PreferredAllocationResponse(container_responses=responses)

    async def Allocate(self, request: pb.AllocateRequest, context: grpc.aio.ServicerContext) -> pb.AllocateResponse:
        try:
            # All or nothing: a refused container request gives back what the earlier ones of the call took.
            answers = await self.allocator.allocate_all(
                self.resource, [list(req.devices_ids) for req in request.container_requests])
        except AllocationError as e:
            log.warning("allocate_refused", resource=self.resource, containers=len(request.container_requests),
                        reason=e.message)
            if self.events is not None and e.pod is not None:
                self.events.pod_refused(e.pod.namespace, e.pod.name, e.pod.uid, e.message)
            await context.abort(e.code, e.message)
        for answer in answers:
            a = answer.allocation
            if answer.warning and self.events is not None:
                self.events.pod_warning(a.namespace, a.pod_name, a.pod_uid, mps_users.REASON_MPS_USER, answer.warning)
        return pb.AllocateResponse(container_responses=[
            pb.ContainerAllocateResponse(
                envs=answer.envs,
                mounts=[pb.Mount(container_path=c, host_path=h, read_only=ro) for c, h, ro in answer.mounts],
            ) for answer in answers
        ])

    async def PreStartContainer(self, request: pb.PreStartContainerRequest,
                                context: grpc.aio.ServicerContext) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()


class HealthBoard:
    """A version number bumped on every device change; ListAndWatch streams wait on it."""

    def __init__(self) -> None:
        self._version = 0
        self._closed = False
        self._cond = asyncio.Condition()

    async def bump(self) -> None:
        async with self._cond:
            self._version += 1
            self._cond.notify_all()

    async def close(self) -> None:
        async with self._cond:
            self._closed = True
            self._cond.notify_all()

    async def wait_newer(self, seen: int) -> int | None:
        """The current version once it is newer than `seen`; None once closed."""
        async with self._cond:
            await self._cond.wait_for(lambda: self._closed or self._version != seen)
            return None if self._closed else self._version


def socket_name(resource: str, generation: int) -> str:
    base = SOCKET_NAME[resource]
    return base if generation == 0 else f"{base.removesuffix('.sock')}.{generation}.sock"


def _our_sockets(folder: Path, resource: str) -> list[Path]:
    """`resource`'s socket files of any generation in `folder`."""
    stem = SOCKET_NAME[resource].removesuffix(".sock")
    return [p for p in folder.glob(f"{stem}*.sock")
            if p.name == SOCKET_NAME[resource] or p.name.removeprefix(stem + ".").removesuffix(".sock").isdigit()]


def _identity(path: Path) -> tuple[int, int] | None:
    """Which file `path` is: its inode and when it was made (a socket made again under the same name can get the
    same inode back, as tmpfs does; its creation time differs)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_ctime_ns


def _accepts(path: Path) -> bool:
    """Whether something listens on the unix socket `path` (a connection it does not refuse, closed at once)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            probe.connect(str(path))
        except BlockingIOError:  # its backlog is full: a listener, busy
            return True
        except OSError:  # ECONNREFUSED: a dead kubelet's socket; ENOENT: gone
            return False
    return True


@dataclass(frozen=True)
class FailedAttempt:
    """What a refused registration saw: the kubelet.sock it tried, whether that socket refused connections (a dead
    kubelet's) and whether the plugin's own sockets had been served (a kubelet that starts removes them: gone now,
    even before kubelet refused the Register for want of them, they say a new kubelet is there)."""

    identity: tuple[int, int] | None
    refused_connections: bool
    served: bool

    def kubelet_changed(self, kubelet: Path, plugin_sockets: list[Path]) -> str:
        """Why a new kubelet may be there now ("" if nothing changed)."""
        if _identity(kubelet) != self.identity:
            return "kubelet_socket_replaced"
        if self.served and not all(p.exists() for p in plugin_sockets):
            return "plugin_sockets_removed"
        if self.refused_connections and _accepts(kubelet):
            return "kubelet_socket_accepting"
        return ""


class DevicePluginService:
    """Serves both resources and keeps them registered with kubelet for as long as `run` runs."""

    def __init__(self, plugin_dir: Path, inventory: Inventory, allocator: Allocator,
                 events: EventSink | None = None) -> None:
        self.plugin_dir = plugin_dir
        self.inventory = inventory
        self.allocator = allocator
        self.board = HealthBoard()
        self.servicers = {r: ResourceServicer(r, inventory, allocator, self.board, events) for r in RESOURCES}
        self._servers: dict[str, grpc.aio.Server] = {}
        self._generation = -1  # of the sockets served now (see the module docstring); -1: none yet
        self.registrations = 0  # successful Register calls, for /metrics and tests
        self.registered = asyncio.Event()

    def socket_name(self, resource: str) -> str:
        """The socket file of `resource` served now (the plain name until the first re-serve)."""
        return socket_name(resource, max(self._generation, 0))

    def socket_path(self, resource: str) -> Path:
        return self.plugin_dir / self.socket_name(resource)

    async def notify_devices_changed(self) -> None:
        await self.board.bump()

    async def _serve(self) -> None:
        await self._stop_servers()
        self._generation += 1
        for resource, servicer in self.servicers.items():
            path = self.socket_path(resource)
            for old in _our_sockets(self.plugin_dir, resource):  # this one's and any a previous generation left
                with contextlib.suppress(FileNotFoundError):
                    old.unlink()
            # only kubelet (root) dials it; no other host user may talk to the plugin
            self._servers[resource] = await serve_unix(
                path, partial(pb_grpc.add_DevicePluginServicer_to_server, servicer), mode=0o600)
        log.info("device_plugin_serving", sockets=[str(self.socket_path(r)) for r in RESOURCES])

    async def _register(self) -> None:
        kubelet = self.plugin_dir / KUBELET_SOCKET_NAME
        async with grpc.aio.insecure_channel(f"unix://{kubelet}") as channel:
            stub = pb_grpc.RegistrationStub(channel)
            for resource in RESOURCES:
                await stub.Register(pb.RegisterRequest(
                    version=DEVICE_PLUGIN_API_VERSION, endpoint=self.socket_name(resource), resource_name=resource,
                    options=pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True),
                ), timeout=REGISTER_TIMEOUT_S)
                self.registrations += 1
                log.info("device_plugin_registered", resource=resource,
                         devices=len(self.inventory.device_ids(resource)))
        self.registered.set()

    async def run(self) -> None:
        """Serve, register, and re-serve + re-register whenever kubelet restarts. Runs until cancelled."""
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        kubelet = self.plugin_dir / KUBELET_SOCKET_NAME
        try:
            backoff = REREGISTER_POLL_S
            registered: tuple[int, int] | None = None  # the kubelet.sock last registered with
            waiting_logged = False
            while True:
                identity = _identity(kubelet)
                sockets_gone = any(not self.socket_path(r).exists() for r in RESOURCES)
                if identity is None:
                    if not waiting_logged:
                        log.info("kubelet_socket_missing", path=str(kubelet))
                        waiting_logged = True
                    registered = None
                    self.registered.clear()
                elif identity != registered or sockets_gone:
                    waiting_logged = False
                    self.registered.clear()
                    served = False
                    try:
                        await self._serve()
                        served = True
                        await self._register()
                        registered = identity
                        backoff = REREGISTER_POLL_S
                    except (grpc.aio.AioRpcError, OSError) as e:
                        # Forget the socket we last registered with: a new kubelet.sock may look like it (the
                        # same inode, a creation time within the clock's step), and our own re-served sockets
                        # hide the restart, so without this a refused Register would never be retried.
                        registered = None
                        detail = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
                        delay = backoff * random.uniform(0.5, 1.0)
                        log.warning("device_plugin_register_failed", error=detail, retry_in_s=round(delay, 3))
                        failed = FailedAttempt(identity, refused_connections=not _accepts(kubelet), served=served)
                        backoff = min(backoff * 2, REGISTER_RETRY_MAX_S)
                        if await self._wait_for_retry(failed, delay):
                            backoff = REREGISTER_POLL_S  # the backoff was for a kubelet that is gone
                        continue
                await asyncio.sleep(REREGISTER_POLL_S)
        finally:
            await self.shutdown()

    async def _wait_for_retry(self, failed: FailedAttempt, delay: float) -> bool:
        """Sleep `delay` before the next attempt, looked at every REREGISTER_POLL_S; True when a new kubelet ended
        the wait early (sleeping on through it left the node without Alnair resources for up to 5 s)."""
        kubelet = self.plugin_dir / KUBELET_SOCKET_NAME
        sockets = [self.socket_path(r) for r in RESOURCES]
        loop = asyncio.get_running_loop()
        started = loop.time()
        while (left := started + delay - loop.time()) > 0:
            await asyncio.sleep(min(REREGISTER_POLL_S, left))
            reason = failed.kubelet_changed(kubelet, sockets)
            if reason:
                log.info("kubelet_changed", reason=reason, waited_s=round(loop.time() - started, 3),
                         backoff_s=round(delay, 3))
                return True
        return False

    async def _stop_servers(self) -> None:
        """Both servers at once, with a short grace: a re-serve after a kubelet restart waits for this (one by one
        at 0.5 s each, it took a re-registration to 1.45 s in a loaded CI run), and what the grace is for, an
        Allocate in flight, takes milliseconds."""
        servers, self._servers = self._servers, {}
        await asyncio.gather(*(server.stop(grace=STOP_GRACE_S) for server in servers.values()))

    async def shutdown(self) -> None:
        """End ListAndWatch streams, stop the servers and remove our sockets."""
        await self.board.close()
        await self._stop_servers()
        for resource in RESOURCES:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path(resource))
        self.board = HealthBoard()
        for servicer in self.servicers.values():
            servicer.changes = self.board
