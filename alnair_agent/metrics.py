"""/metrics (Prometheus text format) and /healthz over HTTP (aiohttp)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from alnair_agent.constants import RESOURCE_MEMORY, RESOURCES

if TYPE_CHECKING:
    from alnair_agent.app import Agent


class AgentCollector(Collector):
    """Reads the agent's state at scrape time; nothing is kept twice."""

    def __init__(self, agent: "Agent") -> None:
        self.agent = agent

    def collect(self) -> Iterator[Metric]:
        a = self.agent
        up = GaugeMetricFamily("alnair_device_plugin_registered", "1 while registered with kubelet")
        up.add_metric([], 1.0 if a.plugin is not None and a.plugin.registered.is_set() else 0.0)
        yield up
        if a.allocator is None or a.inventory is None:
            return
        allocs = GaugeMetricFamily("alnair_allocations", "Containers holding Alnair resources on this node")
        allocs.add_metric([], len(a.allocator.allocations))
        yield allocs
        free = GaugeMetricFamily("alnair_gpu_free_units", "Free units per GPU and resource", labels=["gpu", "resource"])
        total = GaugeMetricFamily("alnair_gpu_units", "Units offered per GPU and resource", labels=["gpu", "resource"])
        rooms = {room.uuid: room for room in a.allocator.rooms()}
        for gpu in a.inventory.gpus.values():
            for r in RESOURCES:
                total.add_metric([gpu.uuid, r], gpu.units[r])
                room = rooms.get(gpu.uuid)
                left = 0 if room is None else room.memory_free if r == RESOURCE_MEMORY else room.compute_free
                free.add_metric([gpu.uuid, r], left)
        yield total
        yield free
        healthy = GaugeMetricFamily("alnair_gpu_healthy", "1 when the GPU is healthy", labels=["gpu"])
        for gpu in a.inventory.gpus.values():
            healthy.add_metric([gpu.uuid], 1.0 if gpu.healthy else 0.0)
        yield healthy


class MetricsServer:
    def __init__(self, agent: "Agent", port: int, host: str = "0.0.0.0") -> None:
        self.agent = agent
        self.port = port
        self.host = host
        self.registry = CollectorRegistry()
        self.registry.register(AgentCollector(agent))

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def _healthz(self, request: web.Request) -> web.Response:
        plugin = self.agent.plugin
        if plugin is not None and plugin.registered.is_set():
            return web.Response(text="ok\n")
        return web.Response(status=503, text="not registered with kubelet\n")

    async def run(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.port).start()
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()
