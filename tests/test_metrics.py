"""/metrics and /healthz as a Prometheus scraper and a liveness probe see them."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
from agent_harness import NODE, node_settings, registered, running_agent

from alnair_agent.gpu.simulated import sim_uuid
from alnair_agent.kubelet.emulator import KubeletEmulator


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
            status, text = await get("/metrics")
        assert status == 200
        assert "alnair_device_plugin_registered 1.0" in text
        assert "alnair_allocations 1.0" in text
        assert f'alnair_gpu_units{{gpu="{sim_uuid(0, NODE)}",resource="alnair/vgpu-memory"}} 16.0' in text
        free = [line for line in text.splitlines() if line.startswith("alnair_gpu_free_units{")]
        assert f'alnair_gpu_free_units{{gpu="{sim_uuid(0, NODE)}",resource="alnair/vgpu-compute"}} 75.0' in free
        assert f'alnair_gpu_healthy{{gpu="{sim_uuid(1, NODE)}"}} 1.0' in text
