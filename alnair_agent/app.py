"""The agent: one asyncio process whose services run as named root tasks until a stop or a failure."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from alnair_agent.config import MAX_UNITS_PER_GPU, ConfigError, Settings
from alnair_agent.dispatcher.service import Dispatcher
from alnair_agent.dra.frontend import DRA, DraFrontEnd, ResourceApiLike
from alnair_agent.dra.frontend import choose as choose_frontend
from alnair_agent.gpu.backend import GpuBackend, GpuInfo
from alnair_agent.health import HealthService
from alnair_agent.kube.events import EventSink
from alnair_agent.kube.pod_source import PodSource
from alnair_agent.kubelet.admission import Allocator
from alnair_agent.kubelet.deviceplugin import DevicePluginService
from alnair_agent.kubelet.podresources import DeviceAssignment
from alnair_agent.lifecycle import run_services
from alnair_agent.metrics import MetricsServer
from alnair_agent.node import edits
from alnair_agent.node.inventory import Inventory
from alnair_agent.node.ledger import Ledger
from alnair_agent.node.reconcile import AnnotationSink, Reconciler
from alnair_agent.node.workspace import Workspace
from alnair_agent.profiler.service import Profiler

log = structlog.get_logger(__name__)


@dataclass
class Kubernetes:
    """The API-server side of the agent, when there is one (all None with ALNAIR_KUBERNETES=off)."""

    pods: PodSource | None = None  # the pod watch
    annotations: AnnotationSink | None = None
    events: EventSink | None = None
    services: list[tuple[str, object]] = field(default_factory=list)  # (name, coroutine factory)
    resources: ResourceApiLike | None = None  # resource.k8s.io/v1 (the DRA front-end)


class Agent:
    def __init__(self, settings: Settings, backend: GpuBackend, kubernetes: Kubernetes | None = None,
                 list_held: Callable[[], Awaitable[list[DeviceAssignment]]] | None = None,
                 unseen_grace_s: float | None = None, proc_root: Path = Path("/proc"),
                 list_claims: Callable[[], Awaitable[set[tuple[str, str]]]] | None = None) -> None:
        self.settings = settings
        self.backend = backend
        self.kubernetes = kubernetes or Kubernetes()
        self.list_held = list_held
        self.list_claims = list_claims  # kubelet's pod-resources: the DRA claims its containers use
        self.unseen_grace_s = unseen_grace_s
        self.proc_root = proc_root
        self.gpus: list[GpuInfo] = []
        self.inventory: Inventory | None = None
        self.ledger: Ledger | None = None  # every front-end's records: what the GPUs hold
        self.allocator: Allocator | None = None  # the device plugin's admission, booking into the ledger
        self.plugin: DevicePluginService | DraFrontEnd | None = None  # the front-end offering the GPUs
        self.dra: DraFrontEnd | None = None
        self.frontend = ""
        self.reconciler: Reconciler | None = None
        self.profiler: Profiler | None = None
        self.dispatcher: Dispatcher | None = None
        self.ready = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        s = self.settings
        self.gpus = await asyncio.to_thread(self.backend.start)
        try:
            log.info("gpus_found", count=len(self.gpus),
                     gpus=[{"index": g.index, "uuid": g.uuid, "name": g.name, "memory_bytes": g.memory_bytes}
                           for g in self.gpus])
            biggest = max((g.memory_bytes for g in self.gpus), default=0)
            if biggest // s.memory_unit_bytes > MAX_UNITS_PER_GPU:
                raise ConfigError(
                    f"ALNAIR_MEMORY_UNIT_MIB={s.memory_unit_mib} makes {biggest // s.memory_unit_bytes} memory units "
                    f"of a {biggest >> 20} MiB GPU; at most {MAX_UNITS_PER_GPU} allowed: use a larger unit")
            self.inventory = Inventory(self.gpus, s.memory_unit_bytes)
            workspace = Workspace(s.workspace)
            workspace.ensure()
            self.ledger = Ledger(self.inventory, pods=self.kubernetes.pods)
            self.ledger.restore(workspace.load_all())
            self.allocator = Allocator(self.ledger, workspace, s.gpu_policy, str(s.shim_dir),
                                       pods=self.kubernetes.pods, place_unscheduled=s.place_unscheduled,
                                       node_name=s.node_name,
                                       mps=edits.MpsFolders.of(s.mps_pipe_dir, s.mps_shm_dir))
            kwargs = {} if self.unseen_grace_s is None else {"unseen_grace_s": self.unseen_grace_s}
            self.profiler = Profiler(self.backend, self.ledger, workspace, self.kubernetes.pods,
                                     self.kubernetes.annotations, s.profile_interval_s, s.annotate_interval_s,
                                     proc_root=self.proc_root)
            self.reconciler = Reconciler(self.ledger, self.allocator, workspace, self.list_held, self.kubernetes.pods,
                                         self.kubernetes.annotations, s.resync_interval_s, usage=self.profiler,
                                         **kwargs)
            # Learn what kubelet already handed out before offering anything: a restart never double-books.
            await self.reconciler.once()
            log.info("allocations_restored", count=len(self.ledger.allocations),
                     external_devices=len(self.ledger.external_held))
            events = self.kubernetes.events  # Events on refused pods and on the node's GPU health
            services: list[tuple[str, object]] = await self._front_end(workspace, events)
            assert self.plugin is not None  # _front_end chose one
            health = HealthService(self.backend, self.inventory, self.plugin, s.health_interval_s, events)
            services += [
                ("health", health.run()),
                ("reconciler", self.reconciler.run()),
                ("heartbeat", self.reconciler.run_heartbeat()),
                ("profiler", self.profiler.run()),
            ]
            if s.dispatcher == "on":
                self.dispatcher = Dispatcher(self.ledger, workspace, self.profiler, self.kubernetes.pods,
                                             s.dispatch_interval_s, s.compute_policy, s.turn_period_s,
                                             s.dispatch_idle_s)
                services.append(("dispatcher", self.dispatcher.run()))
            services += [(name, factory()) for name, factory in self.kubernetes.services]  # type: ignore[operator]
            if s.metrics_port:
                services.append(("http", MetricsServer(self, s.metrics_port).run()))
            self.ready.set()
            await run_services(services, stop, process="agent")  # type: ignore[arg-type]
        finally:
            await asyncio.to_thread(self.backend.stop)
            log.info("agent_stopped")

    async def _front_end(self, workspace: Workspace, events: EventSink | None) -> list[tuple[str, object]]:
        """One front-end offers the GPUs (alnair_agent.dra.frontend says which); on a device plugin node, claims
        prepared before a switch stay served until kubelet unprepares them."""
        assert self.ledger is not None and self.allocator is not None and self.inventory is not None
        s, resources = self.settings, self.kubernetes.resources
        choice = await choose_frontend(s, resources)
        self.frontend = choice.frontend
        log.info("frontend_chosen", frontend=choice.frontend, reason=choice.reason)
        pods = self.kubernetes.pods
        if choice.frontend == DRA:
            assert resources is not None
            self.dra = self.plugin = DraFrontEnd(s, self.ledger, workspace, resources, self.profiler, pods,
                                                 self.list_claims, events=events)
            return list(self.dra.services())
        self.plugin = DevicePluginService(s.device_plugin_dir, self.inventory, self.allocator, events)
        services: list[tuple[str, object]] = [("device-plugin", self.plugin.run())]
        if resources is not None:
            leftover = DraFrontEnd(s, self.ledger, workspace, resources, self.profiler, pods, self.list_claims,
                                   serving=False, events=events)
            await leftover.slices.withdraw()
            if leftover.preparer.records():
                self.dra = leftover
                services += leftover.services()
        return services
