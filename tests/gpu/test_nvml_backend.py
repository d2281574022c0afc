"""The NVML backend on a real GPU (skipped where NVML finds none)."""

from __future__ import annotations

import re

import pytest

pynvml = pytest.importorskip("pynvml")

from alnair_agent.gpu.nvml import NvmlBackend

pytestmark = pytest.mark.gpu


@pytest.fixture
def backend():
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        pytest.skip("no NVIDIA driver / GPU here")
    b = NvmlBackend()
    yield b
    b.stop()


def test_lists_gpus_with_identity_and_memory(backend):
    gpus = backend.start()
    assert gpus
    for i, gpu in enumerate(gpus):
        assert gpu.index == i
        assert re.fullmatch(r"GPU-[0-9a-f-]{36}", gpu.uuid)
        assert gpu.memory_bytes > 1 << 30
        assert re.fullmatch(r"[0-9A-Fa-f]{8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9]", gpu.pci_bus_id)
        assert gpu.minor >= 0
        assert gpu.name
    print("NVML GPUs:", [(g.name, g.uuid, g.memory_bytes) for g in gpus], "unwatched:", backend.unwatched)


def test_healthy_gpu_reports_no_events_and_stops_twice(backend):
    backend.start()
    assert backend.wait_health_events(0.2) == []
    backend.stop()
    backend.stop()
