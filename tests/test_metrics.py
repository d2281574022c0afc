"""/metrics and /healthz as a Prometheus scraper and a liveness probe see them."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from alnair_standins.gpu import sim_uuid
from alnair_standins.kubelet import KubeletEmulator
from alnair_standins.node import NODE, node_settings, registered, running_agent

GiB = 1 << 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_healthz_follows_registration_and_metrics_show_units(root):
    settings = node_settings(root, metrics_port=free_port())
    base = f"http://127.0.0.1:{settings.metrics_port}"
    async with running_agent(settings), aiohttp.ClientSession() as http:
        async def get(path: str) -> tuple[int, str]:
            for _ in range(100):
                try:
                    async with http.get(base + path) as resp:
                        return resp.status, await resp.text()
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.05)
            raise AssertionError(f"{path} never answered")

        status, text = await get("/healthz")
        assert status == 503 and "not registered" in text  # no kubelet yet
        async with KubeletEmulator(settings.device_plugin_dir, settings.pod_resources_socket) as kubelet:
            await registered(kubelet)
            await kubelet.admit("default", "p", "main", {"alnair/vgpu-memory": 3, "alnair/vgpu-compute": 25})
            status, _ = await get("/healthz")
            assert status == 200
            for _ in range(100):  # identified from kubelet's pod-resources within a reconcile or two
                status, text = await get("/metrics")
                if 'container="main"' in text:
                    break
                await asyncio.sleep(0.05)
        assert status == 200
        assert "alnair_device_plugin_registered 1.0" in text
        assert "alnair_allocations 1.0" in text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        value = {(f.name, s.name, tuple(sorted(s.labels.items()))): s.value
                 for f in families.values() for s in f.samples}
        g0 = (("UUID", sim_uuid(0, NODE)), ("gpu", "0"))
        g1 = (("UUID", sim_uuid(1, NODE)), ("gpu", "1"))
        assert value["alnair_gpu_allocatable_compute_ratio", "alnair_gpu_allocatable_compute_ratio", g0] == 0.75
        assert value["alnair_gpu_allocatable_memory_bytes", "alnair_gpu_allocatable_memory_bytes", g0] == 13 * GiB
        assert value["alnair_gpu_healthy", "alnair_gpu_healthy", g1] == 1.0
        assert value["alnair_gpu_memory_total_bytes", "alnair_gpu_memory_total_bytes", g1] == 16 * GiB
        main = (("UUID", sim_uuid(0, NODE)), ("container", "main"), ("gpu", "0"), ("namespace", "default"),
                ("pod", "p"))
        assert value["alnair_container_memory_limit_bytes", "alnair_container_memory_limit_bytes", main] == 3 * GiB
        assert value["alnair_container_compute_limit_ratio", "alnair_container_compute_limit_ratio", main] == 0.25
        assert families["alnair_container_gpu_seconds"].type == "counter"
        assert families["alnair_build_info"].samples[0].labels["version"]
        assert families["process_resident_memory_bytes"].samples[0].value > 0  # the process collector
        assert not any(name.startswith("alnair_gpu_units") or name.endswith("_units") for name in families)
