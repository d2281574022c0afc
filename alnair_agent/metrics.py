"""/metrics (Prometheus text format), /livez, /readyz and /healthz (= /readyz) over HTTP (aiohttp).

/metrics is prometheus-client's own aiohttp handler over a registry holding the agent's collector and
prometheus-client's process collector (the agent's CPU seconds and resident memory). Per-GPU and per-container
series are labelled like dcgm-exporter's (`gpu` = index, `UUID`, and `namespace`, `pod`, `container` for a
container) and in base units: `_bytes`, `_seconds_total`, `_ratio` (0..1), `_watts`, `_hertz`. A container series
is per allocation, that is per (container, GPU): a container of several GPUs has one series per GPU, no more.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import platform
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.aiohttp import make_aiohttp_handler
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from alnair_agent import http_stop
from alnair_agent.constants import COMPUTE_UNITS_PER_GPU

if TYPE_CHECKING:
    from alnair_agent.kubelet.admission import Allocator
    from alnair_agent.node.inventory import Inventory
    from alnair_agent.node.ledger import Ledger
    from alnair_agent.profiler.service import Profiler


class FrontEnd(Protocol):
    @property
    def registered(self) -> asyncio.Event: ...


class AgentView(Protocol):
    """What /metrics and the health endpoints read of the agent (alnair_agent.app.Agent), at scrape time: named here
    so that this module does not import the agent that serves it."""

    @property
    def plugin(self) -> FrontEnd | None: ...

    @property
    def inventory(self) -> Inventory | None: ...

    @property
    def ledger(self) -> Ledger | None: ...

    @property
    def allocator(self) -> Allocator | None: ...

    @property
    def profiler(self) -> Profiler | None: ...

GPU_LABELS = ["gpu", "UUID"]
CONTAINER_LABELS = ["gpu", "UUID", "namespace", "pod", "container"]


def _version() -> str:
    try:
        return importlib.metadata.version("alnair")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class AgentCollector(Collector):
    """Reads the agent's state at scrape time; nothing is kept twice."""

    def __init__(self, agent: "AgentView") -> None:
        self.agent = agent
        self.version = _version()

    def collect(self) -> Iterator[Metric]:
        a = self.agent
        info = InfoMetricFamily("alnair_build", "The agent's version and Python")
        info.add_metric([], {"version": self.version, "python": platform.python_version()})
        yield info
        up = GaugeMetricFamily("alnair_device_plugin_registered", "1 while registered with kubelet")
        up.add_metric([], 1.0 if a.plugin is not None and a.plugin.registered.is_set() else 0.0)
        yield up
        if a.ledger is None or a.inventory is None:
            return
        allocs = GaugeMetricFamily("alnair_allocations", "Containers holding Alnair resources on this node")
        allocs.add_metric([], len(a.ledger.allocations))
        yield allocs
        index = {uuid: str(g.info.index) for uuid, g in a.inventory.gpus.items()}
        yield from self._gpus(index)
        yield from self._containers(index)

    def _gpus(self, index: dict[str, str]) -> Iterator[Metric]:
        a = self.agent
        assert a.ledger is not None and a.allocator is not None and a.inventory is not None
        healthy = GaugeMetricFamily("alnair_gpu_healthy", "1 when the GPU is healthy", labels=GPU_LABELS)
        sick = GaugeMetricFamily("alnair_gpus_unhealthy", "GPUs whose devices are Unhealthy in ListAndWatch")
        sick.add_metric([], sum(1 for g in a.inventory.gpus.values() if not g.healthy))
        yield sick
        refused = GaugeMetricFamily("alnair_regions_refused",
                                    "Container regions the agent refuses to use (not a plain file of the right size)")
        refused.add_metric([], len(a.allocator.workspace.bad_regions()))
        yield refused
        free_mem = GaugeMetricFamily("alnair_gpu_allocatable_memory_bytes",
                                     "GPU memory not yet given to any container (in whole units)", labels=GPU_LABELS)
        free_sm = GaugeMetricFamily("alnair_gpu_allocatable_compute_ratio",
                                    "Share of the GPU's compute not yet given to any container", labels=GPU_LABELS)
        rooms = {room.uuid: room for room in a.ledger.rooms()}
        unit = a.inventory.memory_unit_bytes
        for uuid, gpu in a.inventory.gpus.items():
            labels = [index[uuid], uuid]
            healthy.add_metric(labels, 1.0 if gpu.healthy else 0.0)
            room = rooms.get(uuid)
            free_mem.add_metric(labels, room.memory_free * unit if room else 0)
            free_sm.add_metric(labels, room.compute_free / COMPUTE_UNITS_PER_GPU if room else 0)
        yield from (healthy, free_mem, free_sm)
        p = a.profiler
        if p is None:
            return
        fams = {
            "gpu_util": GaugeMetricFamily("alnair_gpu_utilization_ratio", "Share of time a kernel ran (NVML)",
                                          labels=GPU_LABELS),
            "memcpy_util": GaugeMetricFamily("alnair_gpu_memcpy_utilization_ratio",
                                             "Share of time device memory was read or written (NVML)",
                                             labels=GPU_LABELS),
            "memory_used_bytes": GaugeMetricFamily("alnair_gpu_memory_used_bytes", "GPU memory in use",
                                                   labels=GPU_LABELS),
            "memory_total_bytes": GaugeMetricFamily("alnair_gpu_memory_total_bytes", "GPU memory",
                                                    labels=GPU_LABELS),
            "pcie_rx_bytes_per_s": GaugeMetricFamily("alnair_gpu_pcie_rx_bytes_per_second", "PCIe receive rate",
                                                     labels=GPU_LABELS),
            "pcie_tx_bytes_per_s": GaugeMetricFamily("alnair_gpu_pcie_tx_bytes_per_second", "PCIe send rate",
                                                     labels=GPU_LABELS),
            "power_watts": GaugeMetricFamily("alnair_gpu_power_watts", "Power draw", labels=GPU_LABELS),
            "sm_clock_mhz": GaugeMetricFamily("alnair_gpu_sm_clock_hertz", "SM clock", labels=GPU_LABELS),
        }
        scale = {"gpu_util": 0.01, "memcpy_util": 0.01, "sm_clock_mhz": 1e6}
        unattributed = GaugeMetricFamily("alnair_gpu_unattributed_processes",
                                         "Processes on the GPU that belong to no Alnair container",
                                         labels=GPU_LABELS)
        for s in p.last.gpus:
            if s.uuid not in index:
                continue
            labels = [index[s.uuid], s.uuid]
            for name, fam in fams.items():
                value = getattr(s, name)
                if value is not None:
                    fam.add_metric(labels, value * scale.get(name, 1))
            unattributed.add_metric(labels, p.unattributed.get(s.uuid, 0))
        yield from fams.values()
        yield unattributed

    def _containers(self, index: dict[str, str]) -> Iterator[Metric]:
        a = self.agent
        p = a.profiler
        assert a.ledger is not None
        util = GaugeMetricFamily("alnair_container_gpu_utilization_ratio",
                                 "The container's own share of its GPU's time, last sample", labels=CONTAINER_LABELS)
        memcpy = GaugeMetricFamily("alnair_container_memcpy_utilization_ratio",
                                   "The container's memory-copy utilization of its GPU, last sample",
                                   labels=CONTAINER_LABELS)
        used = GaugeMetricFamily("alnair_container_memory_used_bytes", "GPU memory the container's processes hold",
                                 labels=CONTAINER_LABELS)
        limit = GaugeMetricFamily("alnair_container_memory_limit_bytes", "The container's GPU memory limit (0: none)",
                                  labels=CONTAINER_LABELS)
        cap = GaugeMetricFamily("alnair_container_compute_limit_ratio", "The container's compute cap (0: none)",
                                labels=CONTAINER_LABELS)
        gpu_s = CounterMetricFamily("alnair_container_gpu_seconds", "GPU time the container used",
                                    labels=CONTAINER_LABELS)
        throttled = CounterMetricFamily("alnair_container_throttled_seconds",
                                        "Time the container's processes waited for their turn on the GPU",
                                        labels=CONTAINER_LABELS)
        turn = GaugeMetricFamily("alnair_container_turn_ratio",
                                 "Dispatcher: the container's window as a part of its GPU's turn period",
                                 labels=CONTAINER_LABELS)
        lent = GaugeMetricFamily("alnair_container_lent", "Dispatcher: 1 while the container is lent its whole GPU "
                                 "(elastic)", labels=CONTAINER_LABELS)
        held_s = CounterMetricFamily("alnair_container_held_back_seconds", "Dispatcher: time the container's launches "
                                     "were held back for a latency container on its GPU", labels=CONTAINER_LABELS)
        holds = CounterMetricFamily("alnair_container_held_back", "Dispatcher: launches of the container held back "
                                    "for a latency container on its GPU", labels=CONTAINER_LABELS)
        d = getattr(a, "dispatcher", None)
        for alloc in a.ledger.allocations.values():
            labels = [index.get(alloc.gpu_uuid, ""), alloc.gpu_uuid, alloc.namespace, alloc.pod_name, alloc.container]
            if d is not None and alloc.id in d.turns:
                turn.add_metric(labels, d.turns[alloc.id])
                lent.add_metric(labels, 1.0 if alloc.id in d.lent else 0.0)
                c = d.state.get(alloc.id)
                if c is not None:
                    held_s.add_metric(labels, c.held_s)
                    holds.add_metric(labels, c.held_count)
            limit.add_metric(labels, alloc.memory_limit)
            cap.add_metric(labels, alloc.compute_limit / 100)
            u = p.usage.get(alloc.id) if p is not None else None
            if u is None:
                continue
            util.add_metric(labels, u.gpu_util_now / 100)
            memcpy.add_metric(labels, u.memcpy_util_now / 100)
            used.add_metric(labels, u.memory_now_bytes)
            gpu_s.add_metric(labels, u.gpu_seconds)
            throttled.add_metric(labels, u.throttled_s)
        yield from (util, memcpy, used, limit, cap, gpu_s, throttled, turn, lent, held_s, holds)


class MetricsServer:
    def __init__(self, agent: "AgentView", port: int, host: str = "0.0.0.0") -> None:
        self.agent = agent
        self.port = port
        self.host = host
        self.registry = CollectorRegistry()
        self.registry.register(AgentCollector(agent))
        ProcessCollector(registry=self.registry)

    async def _livez(self, request: web.Request) -> web.Response:
        """Liveness: the process and its event loop answer. Nothing else: a kubelet that is away must not get
        the agent restarted (it holds no state that a restart would fix)."""
        return web.Response(text="alive\n")

    async def _readyz(self, request: web.Request) -> web.Response:
        """Readiness: registered with kubelet (503 otherwise). Unhealthy GPUs do not make the agent unready (the
        healthy GPUs still serve) but are named in the body and in `alnair_gpu_healthy`/`alnair_gpus_unhealthy`."""
        plugin = self.agent.plugin
        inventory = self.agent.inventory
        sick = [f"{g.info.index} ({uuid})" for uuid, g in inventory.gpus.items() if not g.healthy] if inventory else []
        note = f"; unhealthy GPUs: {', '.join(sick)}\n" if sick else "\n"
        if plugin is not None and plugin.registered.is_set():
            return web.Response(text="ok: registered with kubelet" + note)
        return web.Response(status=503, text="not registered with kubelet" + note)

    async def run(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", make_aiohttp_handler(self.registry))
        app.router.add_get("/livez", self._livez)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/healthz", self._readyz)  # the older name, kept: readiness
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.port).start()
            await asyncio.Event().wait()
        finally:
            await http_stop.stop(runner)
