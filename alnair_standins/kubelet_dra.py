"""An in-process emulator of kubelet's DRA side and of the container runtime's CDI injection, over the real protocols.

Used by the demo and the tests, beside the device plugin emulator (`emulator.py`). It does what kubelet does:
- the plugin watcher: scans the plugins_registry folder (kubelet uses inotify, and a scan at its start), dials each
  new socket's pluginregistration.Registration, asks GetInfo, checks it (type DRAPlugin, a socket endpoint, a gRPC
  service it speaks, chosen in the plugin's order) and answers NotifyRegistrationStatus; a socket that disappears
  deregisters its plugin;
- NodePrepareResources / NodeUnprepareResources for a pod's claims over the chosen service (v1 or v1beta1), calling
  again for claims that failed, with a short backoff, until they succeed or the attempts run out; its checkpoint of
  prepared claims survives its own restarts (`restart`: every plugin forgotten, the folder scanned again);
- the runtime: a container gets the CDI devices of the claims (and requests) it names, resolved from the spec files
  in the CDI folder into environment and mounts, as containerd does; an unknown CDI device fails the container;
- pod-resources v1 List, reporting each running container's DRA claims (dynamic_resources) as kubelet does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from alnair_agent.constants import DRA_PLUGIN_TYPE, DRA_SERVICES
from alnair_agent.proto import dra_v1_pb2 as v1
from alnair_agent.proto import dra_v1_pb2_grpc as v1_grpc
from alnair_agent.proto import dra_v1beta1_pb2_grpc as v1beta1_grpc
from alnair_agent.proto import pluginregistration_pb2 as reg
from alnair_agent.proto import pluginregistration_pb2_grpc as reg_grpc
from alnair_agent.proto import podresources_pb2 as prpb
from alnair_agent.proto import podresources_pb2_grpc as prpb_grpc
from alnair_standins.kubelet import serve_pod_resources

SCAN_S = 0.02
# kubelet's reconciler: GetInfo gets one second, and a registration that failed is tried again while the socket is
# there (its reconcile loop runs every second; sooner here, as the emulator's scans are)
GET_INFO_TIMEOUT_S = 1.0
RETRY_FAILED_S = 0.2


class DraCallFailed(Exception):
    """kubelet gave up on a claim: the plugin kept refusing it (its last error), or no plugin of the driver is
    registered."""

    def __init__(self, errors: dict[str, str]) -> None:
        super().__init__("; ".join(f"{uid}: {e}" for uid, e in errors.items()))
        self.errors = errors


class ContainerFailed(Exception):
    """The runtime could not create the container (an unresolvable CDI device)."""


@dataclass(frozen=True)
class Claim:
    namespace: str
    uid: str
    name: str


@dataclass
class PluginView:
    """What the emulated kubelet knows of one registered DRA plugin."""

    driver: str
    endpoint: str
    service: str  # the chosen gRPC service ("v1.DRAPlugin" or "v1beta1.DRAPlugin")
    registration_socket: Path
    channel: grpc.aio.Channel
    signature: tuple[int, int, int]

    def stub(self) -> v1_grpc.DRAPluginStub | v1beta1_grpc.DRAPluginStub:
        """The chosen service's stub (both take the same messages: the method path is what differs)."""
        if self.service == "v1.DRAPlugin":
            return v1_grpc.DRAPluginStub(self.channel)
        return v1beta1_grpc.DRAPluginStub(self.channel)


@dataclass
class ContainerView:
    """A container as the runtime made it: its environment and mounts (container path -> (host path, read-only))."""

    envs: dict[str, str]
    mounts: dict[str, tuple[str, bool]]
    cdi_ids: list[str]


@dataclass
class _Running:
    namespace: str
    pod: str
    container: str
    claims: list[tuple[str, str]]  # (claim namespace, claim name)
    cdi_ids: list[str] = field(default_factory=list)


def _signature(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    # the creation time too: a socket made again under the same name can get the same inode back (seen on tmpfs),
    # and kubelet's watcher (inotify) sees every create
    return (st.st_dev, st.st_ino, st.st_ctime_ns) if stat.S_ISSOCK(st.st_mode) else None


class DraKubeletEmulator:
    def __init__(self, registry_dir: Path, cdi_dir: Path, pod_resources_socket: Path | None = None,
                 services: tuple[str, ...] = DRA_SERVICES, attempts: int = 30, retry_s: float = 0.05) -> None:
        self.registry_dir = registry_dir
        self.cdi_dir = cdi_dir
        self.pod_resources_socket = pod_resources_socket
        self.services = services  # what this kubelet speaks (an older kubelet: ("v1beta1.DRAPlugin",))
        self.attempts = attempts
        self.retry_s = retry_s
        self.plugins: dict[str, PluginView] = {}
        self.registrations: list[tuple[str, str]] = []  # (driver, chosen service), in order
        self.refusals: list[str] = []  # registrations it refused, with why
        # kubelet's checkpoint: claim UID -> the devices the plugin returned (survives restarts of the emulator)
        self.prepared: dict[str, list[v1.Device]] = {}
        self.prepare_calls = 0
        self.call_times: list[tuple[str, float]] = []  # (rpc, seconds) as kubelet sees them
        self.running: dict[tuple[str, str, str], _Running] = {}
        self._watcher: asyncio.Task[None] | None = None
        self._pr_server: grpc.aio.Server | None = None
        self._changed = asyncio.Condition()
        # channels of plugins registered again at the same endpoint: calls in flight on them finish (a registration
        # socket whose mode the plugin set after the watcher saw it looks made again); closed with the watcher
        self._retired: list[grpc.aio.Channel] = []
        # the runtime's cache of the CDI folder (containerd keeps one, refreshed on change): spec file name ->
        # (what the file looked like when read, its devices); only a file that changed is read again
        self._specs: dict[str, tuple[tuple[int, int, int, int], dict[str, dict]]] = {}

    # -- lifetime --------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        self._watcher = asyncio.create_task(self._watch(), name="kubelet-plugin-watcher")
        if self.pod_resources_socket is not None:
            self._pr_server = await serve_pod_resources(self.pod_resources_socket, _PodResources(self))

    async def _stop_watcher(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None
        plugins, self.plugins = self.plugins, {}
        retired, self._retired = self._retired, []
        for channel in [view.channel for view in plugins.values()] + retired:
            await channel.close()

    async def stop(self) -> None:
        await self._stop_watcher()
        if self._pr_server is not None:
            await self._pr_server.stop(grace=0.2)
            self._pr_server = None

    async def restart(self) -> None:
        """kubelet restarts: plugins forgotten, the registry folder scanned again; the checkpoint is kept."""
        await self._stop_watcher()
        self._watcher = asyncio.create_task(self._watch(), name="kubelet-plugin-watcher")

    async def __aenter__(self) -> "DraKubeletEmulator":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- the plugin watcher ------------------------------------------------------------------------------------
    async def _watch(self) -> None:
        tried: dict[Path, tuple[int, int, int]] = {}
        retry_at: dict[Path, float] = {}  # sockets whose registration failed: when to try them again
        loop = asyncio.get_running_loop()
        while True:
            try:
                names = sorted(os.listdir(self.registry_dir))
            except OSError:
                names = []
            seen = set()
            for name in names:
                if name.startswith("."):
                    continue  # the watcher ignores hidden files
                path = self.registry_dir / name
                sig = _signature(path)
                if sig is None:
                    continue
                seen.add(path)
                if tried.get(path) != sig or (path in retry_at and loop.time() >= retry_at[path]):
                    tried[path] = sig
                    retry_at.pop(path, None)
                    if not await self._register(path, sig):
                        retry_at[path] = loop.time() + RETRY_FAILED_S
            for path in [p for p in tried if p not in seen]:
                del tried[path]
                retry_at.pop(path, None)
                for driver, view in list(self.plugins.items()):
                    if view.registration_socket == path:
                        del self.plugins[driver]
                        await view.channel.close()
                await self._notify()
            await asyncio.sleep(SCAN_S)

    async def _register(self, path: Path, sig: tuple[int, int, int]) -> bool:
        """True once registered; False where it failed (GetInfo, or a plugin kubelet refuses): kubelet tries again
        while the socket is there."""
        async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
            stub = reg_grpc.RegistrationStub(channel)
            try:
                info = await stub.GetInfo(reg.InfoRequest(), timeout=GET_INFO_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                self.refusals.append(f"{path.name}: GetInfo failed: {e.code().name}")
                return False
            error = ""
            chosen = next((s for s in info.supported_versions if s in self.services), "")
            if info.type != DRA_PLUGIN_TYPE:
                error = f"plugin type {info.type!r} is not {DRA_PLUGIN_TYPE}"
            elif not info.name:
                error = "no driver name"
            elif not chosen:
                error = f"none of the plugin's services {list(info.supported_versions)} is one of {list(self.services)}"
            elif _signature(Path(info.endpoint)) is None:
                error = f"endpoint {info.endpoint!r} is not a socket"
            if error:
                self.refusals.append(f"{path.name}: {error}")
            with contextlib.suppress(grpc.aio.AioRpcError):
                await stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=not error, error=error),
                                                    timeout=5)
        if error:
            return False
        old = self.plugins.pop(info.name, None)
        if old is not None and old.endpoint == info.endpoint:
            self._retired.append(old.channel)
        elif old is not None:
            await old.channel.close()
        self.plugins[info.name] = PluginView(info.name, info.endpoint, chosen, path,
                                             grpc.aio.insecure_channel(f"unix://{info.endpoint}"), sig)
        self.registrations.append((info.name, chosen))
        await self._notify()
        return True

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def wait_registered(self, driver: str, timeout: float = 5.0, since: int = 0) -> None:
        """Until `driver` is registered, with more than `since` registrations of it so far."""
        async def loop() -> None:
            while not (driver in self.plugins and sum(d == driver for d, _ in self.registrations) > since):
                async with self._changed:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), 0.05)
        await asyncio.wait_for(loop(), timeout)

    # -- prepare and unprepare ---------------------------------------------------------------------------------
    async def _call(self, driver: str, rpc: str, claims: list[Claim]) -> dict[str, str]:
        """One call for `claims`; returns the errors by claim UID (a missing entry is an error too)."""
        view = self.plugins.get(driver)
        if view is None:
            return {c.uid: f"DRA driver {driver} is not registered" for c in claims}
        request_type = v1.NodePrepareResourcesRequest if rpc == "prepare" else v1.NodeUnprepareResourcesRequest
        request = request_type(claims=[v1.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims])
        stub = view.stub()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            if rpc == "prepare":
                self.prepare_calls += 1
                answer = await stub.NodePrepareResources(request, timeout=10)
            else:
                answer = await stub.NodeUnprepareResources(request, timeout=10)
        except grpc.aio.AioRpcError as e:
            return {c.uid: f"{rpc} call failed: {e.code().name}: {e.details()}" for c in claims}
        self.call_times.append(("NodePrepareResources" if rpc == "prepare" else "NodeUnprepareResources",
                                loop.time() - t0))
        errors: dict[str, str] = {}
        for c in claims:
            entry = answer.claims.get(c.uid)
            if entry is None:
                errors[c.uid] = "the plugin's answer has no entry for the claim"
            elif entry.error:
                errors[c.uid] = entry.error
            elif rpc == "prepare":
                self.prepared[c.uid] = list(entry.devices)
            else:
                self.prepared.pop(c.uid, None)
        return errors

    async def _with_retries(self, driver: str, rpc: str, claims: list[Claim], attempts: int | None) -> None:
        left = list(claims)
        errors: dict[str, str] = {}
        for attempt in range(attempts or self.attempts):
            if attempt:
                await asyncio.sleep(self.retry_s)
            errors = await self._call(driver, rpc, left)
            left = [c for c in left if c.uid in errors]
            if not left:
                return
        raise DraCallFailed(errors)

    async def prepare(self, driver: str, claims: list[Claim], attempts: int | None = None) -> None:
        """Prepare a pod's claims of `driver` as kubelet does before starting it (claims it has prepared already
        are skipped: kubelet's own checkpoint); DraCallFailed once the attempts are spent."""
        todo = [c for c in claims if c.uid not in self.prepared]
        if todo:
            await self._with_retries(driver, "prepare", todo, attempts)

    async def prepare_once(self, driver: str, claims: list[Claim]) -> dict[str, str]:
        """One NodePrepareResources call, checkpoint or not (tests of idempotence and of bad input)."""
        return await self._call(driver, "prepare", claims)

    async def unprepare(self, driver: str, claims: list[Claim], attempts: int | None = None) -> None:
        await self._with_retries(driver, "unprepare", claims, attempts)

    # -- the runtime ---------------------------------------------------------------------------------------------
    def cdi_ids(self, claim_uid: str, request: str | None = None) -> list[str]:
        """The CDI devices kubelet hands a container naming the claim (and `request`, if it names one)."""
        out: list[str] = []
        for d in self.prepared.get(claim_uid, []):
            if request is None or not d.request_names or request in d.request_names:
                out += list(d.cdi_device_ids)
        return out

    def _cdi_devices(self) -> dict[str, dict]:
        devices: dict[str, dict] = {}
        try:
            names = sorted(os.listdir(self.cdi_dir))
        except OSError:
            names = []
        seen = set()
        for name in names:
            if not name.endswith(".json") or name.startswith("."):
                continue
            path = self.cdi_dir / name
            try:
                st = os.stat(path)
            except OSError:
                continue
            sig = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)  # the agent renames new specs into place
            seen.add(name)
            cached = self._specs.get(name)
            if cached is None or cached[0] != sig:
                try:
                    spec = json.loads(path.read_text())
                    found = {f"{spec['kind']}={d['name']}": d.get("containerEdits", {})
                             for d in spec.get("devices", [])}
                except (OSError, ValueError, KeyError, TypeError, AttributeError):
                    found = {}  # unreadable or not a spec: no devices from it, as the runtime skips it
                cached = self._specs[name] = (sig, found)
            devices.update(cached[1])
        for name in [n for n in self._specs if n not in seen]:
            del self._specs[name]
        return devices

    def resolve(self, cdi_ids: list[str]) -> ContainerView:
        """The container the runtime makes with these CDI devices; ContainerFailed for an unresolvable one."""
        known = self._cdi_devices()
        envs: dict[str, str] = {}
        mounts: dict[str, tuple[str, bool]] = {}
        for cdi_id in cdi_ids:
            edits = known.get(cdi_id)
            if edits is None:
                raise ContainerFailed(f"unresolvable CDI devices {cdi_id}")
            for kv in edits.get("env", []):
                k, _, v = kv.partition("=")
                envs[k] = v
            for m in edits.get("mounts", []):
                mounts[m["containerPath"]] = (m["hostPath"], "ro" in m.get("options", []))
        return ContainerView(envs, mounts, list(cdi_ids))

    def start_container(self, namespace: str, pod: str, container: str,
                        claims: list[tuple[Claim, str | None]]) -> ContainerView:
        """Create a container that names these claims (each with a request, or None for the whole claim)."""
        ids = [i for claim, request in claims for i in self.cdi_ids(claim.uid, request)]
        view = self.resolve(ids)
        self.running[(namespace, pod, container)] = _Running(
            namespace, pod, container, list(dict.fromkeys((c.namespace, c.name) for c, _ in claims)), ids)
        return view

    def stop_pod(self, namespace: str, pod: str) -> None:
        for key in [k for k in self.running if k[:2] == (namespace, pod)]:
            del self.running[key]


class _PodResources(prpb_grpc.PodResourcesListerServicer):
    def __init__(self, kubelet: DraKubeletEmulator) -> None:
        self.kubelet = kubelet

    async def List(self, request: prpb.ListPodResourcesRequest,
                   context: grpc.aio.ServicerContext) -> prpb.ListPodResourcesResponse:
        pods: dict[tuple[str, str], prpb.PodResources] = {}
        for r in self.kubelet.running.values():
            pod = pods.setdefault((r.namespace, r.pod), prpb.PodResources(name=r.pod, namespace=r.namespace))
            pod.containers.append(prpb.ContainerResources(name=r.container, dynamic_resources=[
                prpb.DynamicResource(claim_name=name, claim_namespace=ns, claim_resources=[
                    prpb.ClaimResource(cdi_devices=[prpb.CDIDevice(name=i) for i in r.cdi_ids])])
                for ns, name in r.claims]))
        return prpb.ListPodResourcesResponse(pod_resources=list(pods.values()))
