"""Which front-end offers this node's GPUs, and the DRA front-end's services.

ALNAIR_FRONTEND picks: `device-plugin`, `dra`, or `auto` (the default), decided once at start:
  - `dra` when the API server serves resource.k8s.io/v1, keeps the fields of consumable capacity (a dry-run create of
    a ResourceSlice must come back with allowMultipleAllocations and the request policies: a server without the
    DRAConsumableCapacity feature drops them, and kube-scheduler would then hand out each GPU whole), and the
    DeviceClass gpu.alnair.centaurus.io exists (the operator applied the DRA manifest: the cluster opted in);
  - `device-plugin` otherwise (also without an API server), the reason logged.
An explicit `dra` that the API server cannot serve stops the agent with a message naming what is missing.

A GPU is never offered by both: the node runs one front-end. What the other one left behind keeps its units in the
one ledger: in DRA mode a GPU that device plugin containers still hold stays out of the slice until they end; in
device plugin mode the slice is withdrawn and claims prepared before the switch stay served (prepare again,
unprepare) by the DRA kubelet plugin, their units counted by the allocator, until kubelet unprepares them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from alnair_agent.config import ConfigError, Settings
from alnair_agent.constants import COMPUTE_UNITS_PER_GPU, DRA_DEVICE_CLASS, RESOURCE_COMPUTE, RESOURCE_MEMORY
from alnair_agent.dra import capacity
from alnair_agent.dra.cdi import CdiWriter
from alnair_agent.dra.claims import ClaimSource
from alnair_agent.dra.cleanup import ClaimCleanup
from alnair_agent.dra.plugin import DraPlugin
from alnair_agent.dra.prepare import ClaimPreparer
from alnair_agent.dra.slices import SliceApi, SlicePublisher
from alnair_agent.gpu.backend import GpuInfo
from alnair_agent.kube.events import EventSink
from alnair_agent.kube.pod_source import PodSource
from alnair_agent.node import edits
from alnair_agent.node.inventory import Gpu
from alnair_agent.node.ledger import Ledger
from alnair_agent.node.workspace import Workspace
from alnair_agent.profiler.sink import UsageSink

log = structlog.get_logger(__name__)

DEVICE_PLUGIN = "device-plugin"
DRA = "dra"
# How often claims prepared here are checked against the API server and pod-resources for one kubelet forgot.
ORPHAN_CHECK_S = 60.0


class ResourceApiLike(SliceApi, ClaimSource, Protocol):
    async def served(self) -> bool: ...

    async def device_class_exists(self, name: str) -> bool: ...


@dataclass(frozen=True)
class Choice:
    frontend: str
    reason: str


def _probe_slice(node_name: str, memory_unit_bytes: int) -> dict[str, Any]:
    """A slice as the publisher writes it (one GPU of one memory unit), under a generated name: a dry run only."""
    gpu = Gpu(GpuInfo(index=0, uuid="GPU-probe", name="probe", memory_bytes=memory_unit_bytes, pci_bus_id="",
                      minor=0), {RESOURCE_MEMORY: 1, RESOURCE_COMPUTE: COMPUTE_UNITS_PER_GPU})
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"generateName": "alnair-probe-"},
            "spec": capacity.slice_spec(node_name, [capacity.device_json(gpu, memory_unit_bytes)], 1)}


async def choose(settings: Settings, api: ResourceApiLike | None) -> Choice:
    """The front-end for this node by ALNAIR_FRONTEND (see the module doc); ConfigError for a `dra` that cannot be."""
    wanted = settings.frontend
    if wanted == DEVICE_PLUGIN:
        return Choice(DEVICE_PLUGIN, "ALNAIR_FRONTEND=device-plugin")

    def unusable(why: str) -> Choice:
        if wanted == DRA:
            raise ConfigError(f"ALNAIR_FRONTEND=dra cannot be served: {why}")
        return Choice(DEVICE_PLUGIN, why)

    if api is None:
        return unusable("no API server (ALNAIR_KUBERNETES=off or none configured): the DRA front-end publishes "
                        "ResourceSlices and reads ResourceClaims")
    try:
        if not await api.served():
            return unusable("the API server does not serve resource.k8s.io/v1 ResourceSlices (Kubernetes 1.34 or "
                            "later is needed)")
        echo = await api.create_slice(_probe_slice(settings.node_name, settings.memory_unit_bytes), dry_run=True)
        devices = (echo.get("spec") or {}).get("devices") or [{}]
        if not capacity.keeps_consumable_capacity(devices[0]):
            return unusable("the API server drops allowMultipleAllocations and the capacity request policies: "
                            "enable consumable capacity (feature gate DRAConsumableCapacity, on by default from "
                            "Kubernetes 1.36)")
        has_class = await api.device_class_exists(DRA_DEVICE_CLASS)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to ask: auto keeps the device plugin, dra says why
        if wanted == DRA:
            log.warning("frontend_check_failed", error=str(e), frontend=DRA)
            return Choice(DRA, f"ALNAIR_FRONTEND=dra (the API server could not be asked: {e})")
        return Choice(DEVICE_PLUGIN, f"the API server could not be asked about resource.k8s.io/v1: {e}")
    if wanted == DRA:
        if not has_class:
            log.warning("dra_device_class_missing", device_class=DRA_DEVICE_CLASS,
                        hint="kubectl apply -f manifests/alnair-dra.yaml: claims name it")
        return Choice(DRA, "ALNAIR_FRONTEND=dra")
    if not has_class:
        return Choice(DEVICE_PLUGIN, f"DeviceClass {DRA_DEVICE_CLASS} does not exist (apply manifests/alnair-dra.yaml "
                                     "to use the DRA front-end)")
    return Choice(DRA, f"the API server serves resource.k8s.io/v1 with consumable capacity and DeviceClass "
                       f"{DRA_DEVICE_CLASS} exists")


class DraFrontEnd:
    """The DRA front-end's parts: the claim preparer (booking in the node's ledger) and its cleanup, the kubelet
    plugin and (when it offers the GPUs) the slice publisher.
    `serving=False` is the device-plugin node's leftover duty: serve only claims prepared before the switch."""

    def __init__(self, settings: Settings, ledger: Ledger, workspace: Workspace, api: ResourceApiLike,
                 usage: UsageSink | None, pods: PodSource | None,
                 list_claims: Callable[[], Awaitable[set[tuple[str, str]]]] | None, serving: bool = True,
                 events: EventSink | None = None) -> None:
        self.settings = settings
        self.serving = serving
        self.list_claims = list_claims
        self.preparer = ClaimPreparer(ledger, workspace, CdiWriter(settings.cdi_dir), api, settings.node_name,
                                      str(settings.shim_dir), usage=usage, pods=pods, accept_new=serving,
                                      mps=edits.MpsFolders.of(settings.mps_pipe_dir, settings.mps_shm_dir),
                                      events=events)
        self.cleanup = ClaimCleanup(self.preparer)
        self.plugin = DraPlugin(self.preparer, settings.dra_plugin_dir, settings.plugins_registry_dir)
        self.slices = SlicePublisher(api, ledger, settings.node_name, settings.resync_interval_s)
        self.cleanup.restore_specs()

    @property
    def registered(self) -> asyncio.Event:
        return self.plugin.registered

    async def notify_devices_changed(self) -> None:
        await self.slices.notify_devices_changed()

    async def housekeeping(self) -> None:
        """Every resync: name slices' containers from their pods; now and then, retire claims kubelet forgot."""
        loop = asyncio.get_running_loop()
        next_check = loop.time()
        while True:
            self.preparer.learn_containers()
            if loop.time() >= next_check:
                await self.cleanup.collect_orphans(self.list_claims)
                next_check = loop.time() + ORPHAN_CHECK_S
            await asyncio.sleep(self.settings.resync_interval_s)

    def services(self) -> list[tuple[str, Coroutine[Any, Any, None]]]:
        out: list[tuple[str, Coroutine[Any, Any, None]]] = [("dra-plugin", self.plugin.run()),
                                                            ("dra-housekeeping", self.housekeeping())]
        if self.serving:  # only a serving front-end makes new slices: only it keeps folders made ahead
            out += [("dra-slices", self.slices.run()), ("dra-spares", self.preparer.spares.run())]
        return out
