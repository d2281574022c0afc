"""The kubelet DRA plugin: the DRAPlugin gRPC service (v1, and v1beta1 for 1.34-1.35 kubelets) on a unix socket, and
its registration with kubelet's plugin watcher.

Registration: a socket in kubelet's plugins_registry folder serving pluginregistration.Registration. The watcher
finds it (inotify, and a scan at kubelet's start), asks GetInfo (type DRAPlugin, the driver name, the DRA socket's
path, the gRPC services offered, most preferred first) and reports the outcome in NotifyRegistrationStatus. Nothing
to do on a kubelet restart (the watcher finds the socket again); a socket that disappears (a cleanup, an operator) is
served again within REREGISTER_POLL_S.

NodePrepareResources and NodeUnprepareResources answer every claim of the request, each with its devices or its own
error (kubelet calls again for the failed ones); one claim's failure never touches another's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import grpc
import structlog

from alnair_agent.constants import (
    DRA_DRIVER,
    DRA_PLUGIN_TYPE,
    DRA_REGISTRATION_SOCKET,
    DRA_SERVICES,
    DRA_SOCKET_NAME,
)
from alnair_agent.dra.cdi import is_uid
from alnair_agent.dra.claims import ClaimRef, PreparedDevice, PrepareError
from alnair_agent.dra.prepare import ClaimPreparer
from alnair_agent.grpc_unix import serve_unix
from alnair_agent.proto import dra_v1_pb2 as v1
from alnair_agent.proto import dra_v1_pb2_grpc as v1_grpc
from alnair_agent.proto import dra_v1beta1_pb2_grpc as v1beta1_grpc
from alnair_agent.proto import pluginregistration_pb2 as reg
from alnair_agent.proto import pluginregistration_pb2_grpc as reg_grpc

log = structlog.get_logger(__name__)

REREGISTER_POLL_S = 0.1


def _ref(claim: v1.Claim) -> ClaimRef | str:
    """The claim kubelet names, or why it cannot be one (every field is required)."""
    missing = [f for f in ("namespace", "uid", "name") if not getattr(claim, f)]
    if missing:
        return f"claim {claim.namespace}/{claim.name} (uid {claim.uid!r}) lacks {', '.join(missing)}"
    if not is_uid(claim.uid):
        return f"claim {claim.namespace}/{claim.name}: uid {claim.uid[:80]!r} is not a Kubernetes UID"
    return ClaimRef(claim.namespace, claim.uid, claim.name)


class DraServicer(v1_grpc.DRAPluginServicer):
    """The DRAPlugin service. The same object serves v1 and v1beta1: both are declared over the v1 messages (the
    wire format is the same; see dra_v1beta1.proto)."""

    def __init__(self, preparer: ClaimPreparer) -> None:
        self.preparer = preparer
        self.prepare_calls = 0

    async def _each(self, claims: Iterable[v1.Claim], what: str,
                    act: Callable[[ClaimRef], Awaitable[list[PreparedDevice] | None]]) -> dict[str, Any]:
        """claim key -> devices (or None), or the error string: every claim answered on its own."""
        out: dict[str, Any] = {}
        for claim in claims:
            ref = _ref(claim)
            key = claim.uid or f"{claim.namespace}/{claim.name}"
            if isinstance(ref, str):
                out[key] = ref
                continue
            try:
                out[key] = await act(ref)
            except PrepareError as e:
                log.warning(f"dra_{what}_refused", claim=f"{ref.namespace}/{ref.name}", uid=ref.uid, reason=str(e))
                out[key] = str(e)
            except Exception as e:
                log.exception(f"dra_{what}_failed", claim=f"{ref.namespace}/{ref.name}", uid=ref.uid)
                out[key] = f"{ref.describe()}: internal error of {DRA_DRIVER}: {type(e).__name__}: {e}"
        return out

    async def NodePrepareResources(self, request: v1.NodePrepareResourcesRequest,
                                   context: grpc.aio.ServicerContext) -> v1.NodePrepareResourcesResponse:
        self.prepare_calls += 1
        out = v1.NodePrepareResourcesResponse()
        for key, answer in (await self._each(request.claims, "prepare", self.preparer.prepare)).items():
            if isinstance(answer, str):
                out.claims[key].error = answer
            else:
                out.claims[key].devices.extend(
                    v1.Device(request_names=[d.request], pool_name=d.pool, device_name=d.device,
                              cdi_device_ids=list(d.cdi_ids)) for d in answer)
        return out

    async def NodeUnprepareResources(self, request: v1.NodeUnprepareResourcesRequest,
                                     context: grpc.aio.ServicerContext) -> v1.NodeUnprepareResourcesResponse:
        out = v1.NodeUnprepareResourcesResponse()
        for key, answer in (await self._each(request.claims, "unprepare", self.preparer.unprepare)).items():
            out.claims[key].CopyFrom(v1.NodeUnprepareResourceResponse(error=answer if isinstance(answer, str) else ""))
        return out


class RegistrationServicer(reg_grpc.RegistrationServicer):
    def __init__(self, plugin: "DraPlugin") -> None:
        self.plugin = plugin

    async def GetInfo(self, request: reg.InfoRequest, context: grpc.aio.ServicerContext) -> reg.PluginInfo:
        return reg.PluginInfo(type=DRA_PLUGIN_TYPE, name=DRA_DRIVER, endpoint=str(self.plugin.socket_path),
                              supported_versions=list(DRA_SERVICES))

    async def NotifyRegistrationStatus(self, request: reg.RegistrationStatus,
                                       context: grpc.aio.ServicerContext) -> reg.RegistrationStatusResponse:
        if request.plugin_registered:
            self.plugin.registrations += 1
            self.plugin.registered.set()
            log.info("dra_plugin_registered", driver=DRA_DRIVER, endpoint=str(self.plugin.socket_path))
        else:
            self.plugin.registered.clear()
            log.error("dra_plugin_registration_refused", driver=DRA_DRIVER, error=request.error)
        return reg.RegistrationStatusResponse()


def _signature(path: Path) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


class DraPlugin:
    """Serves the DRA service and the registration socket for as long as `run` runs."""

    def __init__(self, preparer: ClaimPreparer, plugin_dir: Path, registry_dir: Path) -> None:
        self.plugin_dir = plugin_dir
        self.registry_dir = registry_dir
        self.servicer = DraServicer(preparer)
        self.registered = asyncio.Event()
        self.registrations = 0
        self._servers: list[grpc.aio.Server] = []
        self._sockets: dict[Path, tuple[int, int] | None] = {}

    @property
    def socket_path(self) -> Path:
        return self.plugin_dir / DRA_SOCKET_NAME

    @property
    def registration_path(self) -> Path:
        return self.registry_dir / DRA_REGISTRATION_SOCKET

    async def _serve(self) -> None:
        await self._stop()
        self.registered.clear()
        for folder in (self.plugin_dir, self.registry_dir):
            folder.mkdir(parents=True, exist_ok=True)
        # Only kubelet (root) dials them: mode 0600.
        self._servers.append(await serve_unix(
            self.socket_path, lambda s: v1_grpc.add_DRAPluginServicer_to_server(self.servicer, s),
            lambda s: v1beta1_grpc.add_DRAPluginServicer_to_server(self.servicer, s),
            mode=0o600))
        # The registration socket last: the watcher may dial the DRA socket as soon as it sees this one.
        self._servers.append(await serve_unix(
            self.registration_path, lambda s: reg_grpc.add_RegistrationServicer_to_server(RegistrationServicer(self), s),
            mode=0o600))
        for path in (self.socket_path, self.registration_path):
            self._sockets[path] = _signature(path)
        log.info("dra_plugin_serving", socket=str(self.socket_path), registration=str(self.registration_path))

    async def run(self) -> None:
        try:
            await self._serve()
            while True:
                await asyncio.sleep(REREGISTER_POLL_S)
                if any(_signature(p) != sig for p, sig in self._sockets.items()):
                    log.warning("dra_plugin_socket_gone", sockets=[str(p) for p in self._sockets])
                    await self._serve()
        finally:
            await self.shutdown()

    async def _stop(self) -> None:
        servers, self._servers = self._servers, []
        for server in servers:
            await server.stop(grace=0.5)

    async def shutdown(self) -> None:
        """Stop serving and remove both sockets: the watcher then deregisters the plugin (kubelet keeps the
        ResourceSlice for a while, so a restart within that time does not disturb scheduling)."""
        await self._stop()
        for path in (self.registration_path, self.socket_path):
            if _signature(path) == self._sockets.get(path):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        self._sockets.clear()
        self.registered.clear()
