"""The agent process: SIGTERM/SIGINT stop it in time and remove its sockets; a crashed service stops it non-zero;
a bad setting stops it at start with one line."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time

import pytest

from alnair_standins.kubelet import KubeletEmulator
from alnair_standins.node import AgentProcess, env_for, node_settings, registered


@pytest.mark.parametrize("sig,health_s", [(signal.SIGTERM, 0.05), (signal.SIGINT, 0.05), (signal.SIGTERM, 60.0)])
async def test_signal_stops_agent_within_5s_and_removes_sockets(root, sig, health_s):
    """Also at the longest health interval: its blocking wait for GPU events (NVML's, in a worker thread) once held
    the stop for up to the whole interval, past kubelet's 30 s grace at ALNAIR_HEALTH_INTERVAL_S=60."""
    settings = node_settings(root, health_interval_s=health_s)
    async with KubeletEmulator(settings.device_plugin_dir, settings.pod_resources_socket) as kubelet:
        agent = AgentProcess(settings)
        agent.start()
        await registered(kubelet, timeout=20)
        assert sorted(p.name for p in settings.device_plugin_dir.glob("alnair-*.sock"))
        started = time.monotonic()
        agent.proc.send_signal(sig)
        while agent.proc.poll() is None and time.monotonic() - started < 5:
            await asyncio.sleep(0.05)
        assert agent.proc.poll() == 0, agent.output()
        assert time.monotonic() - started < 5
        assert not list(settings.device_plugin_dir.glob("alnair-*.sock"))
        assert '"event": "agent_stopped"' in agent.output()
        assert '"event": "gc_frozen"' in agent.output()  # once serving, the start-up heap is out of the GC's walks


async def test_crashed_service_stops_agent_non_zero(root):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        # The HTTP service cannot bind its port: it fails, and the whole agent must stop rather than limp on.
        settings = node_settings(root, metrics_port=busy.getsockname()[1])
        async with KubeletEmulator(settings.device_plugin_dir, settings.pod_resources_socket):
            agent = AgentProcess(settings)
            agent.start()
            deadline = time.monotonic() + 20
            while agent.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert agent.proc.poll() == 1
            out = agent.output()
            assert '"service": "http"' in out and "service_ended" in out
            assert not list(settings.device_plugin_dir.glob("alnair-*.sock"))
    finally:
        busy.close()


def test_bad_setting_stops_start_with_one_line(root):
    env = env_for(node_settings(root))
    env["ALNAIR_GPU_POLICY"] = "fastest"
    result = subprocess.run([sys.executable, "-m", "alnair_agent.main"], env=env, capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines == ["alnair-agent: configuration error: ALNAIR_GPU_POLICY='fastest' is not allowed; "
                     "expected one of binpack, spread"]
