"""The NVML backend's samples. pynvml's query calls are stood in for (no GPU here), with the structures pynvml
returns; joining, units and the per-field error handling are the agent's own code, exercised as written."""

from __future__ import annotations

from types import SimpleNamespace

import pynvml
import pytest

from alnair_agent.gpu.backend import GpuSample, ProcessSample
from alnair_agent.gpu.nvml import NvmlBackend

A, B = "GPU-0b8a5f29-a68d-c604-39f3-5174ded264da", "GPU-7c1e0d44-1f2a-4b3c-8d9e-0a1b2c3d4e5f"


def not_supported(*_args):
    raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)


@pytest.fixture
def nvml(monkeypatch):
    since_asked: list[int] = []
    util_samples = {
        "hA": [SimpleNamespace(pid=100, timeStamp=1_000, smUtil=30, memUtil=5, encUtil=0, decUtil=0),
               SimpleNamespace(pid=100, timeStamp=2_000, smUtil=50, memUtil=15, encUtil=0, decUtil=0),
               SimpleNamespace(pid=101, timeStamp=1_500, smUtil=10, memUtil=40, encUtil=0, decUtil=0)],
    }

    def process_utilization(h, since):
        since_asked.append(since)
        if h == "hB":
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)  # no samples since `since`
        return [s for s in util_samples[h] if s.timeStamp > since]

    procs = {"hA": [SimpleNamespace(pid=100, usedGpuMemory=2 << 30), SimpleNamespace(pid=102, usedGpuMemory=1 << 30)],
             "hB": [SimpleNamespace(pid=200, usedGpuMemory=None)]}  # None: not available (e.g. MIG, no privileges)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetUtilizationRates",
                        lambda h: SimpleNamespace(gpu=75, memory=20) if h == "hA" else not_supported())
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", lambda h: SimpleNamespace(total=80 << 30, used=3 << 30,
                                                                                      free=77 << 30))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetPcieThroughput",
                        lambda h, c: (1000 if c == pynvml.NVML_PCIE_UTIL_RX_BYTES else 2000) if h == "hA"
                        else not_supported())
    monkeypatch.setattr(pynvml, "nvmlDeviceGetPowerUsage", lambda h: 350_000 if h == "hA" else not_supported())
    monkeypatch.setattr(pynvml, "nvmlDeviceGetClockInfo", lambda h, c: 1980 if h == "hA" else not_supported())
    monkeypatch.setattr(pynvml, "nvmlDeviceGetComputeRunningProcesses", lambda h: procs[h])
    monkeypatch.setattr(pynvml, "nvmlDeviceGetGraphicsRunningProcesses",
                        lambda h: not_supported() if h == "hA" else [])
    monkeypatch.setattr(pynvml, "nvmlDeviceGetProcessUtilization", process_utilization)
    b = NvmlBackend()
    b._handles = [(A, "hA"), (B, "hB")]  # as after start()
    return b, since_asked


def test_samples_join_process_lists_and_utilization_with_units(nvml):
    b, since_asked = nvml
    first = b.sample()
    assert first.window_s == 0.0  # no previous sample: nothing to average over yet
    assert first.gpus[0] == GpuSample(A, gpu_util=75.0, memcpy_util=20.0, memory_used_bytes=3 << 30,
                                      memory_total_bytes=80 << 30, pcie_rx_bytes_per_s=1000 * 1024.0,
                                      pcie_tx_bytes_per_s=2000 * 1024.0, power_watts=350.0, sm_clock_mhz=1980)
    # a GPU that supports none of the optional fields reports None for each, never an error
    assert first.gpus[1] == GpuSample(B, gpu_util=None, memcpy_util=None, memory_used_bytes=3 << 30,
                                      memory_total_bytes=80 << 30)
    by_pid = {p.pid: p for p in first.processes}
    assert by_pid[100] == ProcessSample(A, 100, sm_util=40.0, mem_util=10.0, used_memory_bytes=2 << 30)  # 2 samples
    assert by_pid[101] == ProcessSample(A, 101, 10.0, 40.0, None)  # sampled, not in the lists (just ended)
    assert by_pid[102] == ProcessSample(A, 102, 0.0, 0.0, 1 << 30)  # listed, no sample: idle
    assert by_pid[200] == ProcessSample(B, 200, 0.0, 0.0, None)
    second = b.sample()
    assert second.window_s > 0
    assert since_asked[-2] == 2_000  # the next call asks only for samples newer than the newest seen
    assert {p.pid: p.sm_util for p in second.processes if p.gpu_uuid == A} == {100: 0.0, 102: 0.0}


@pytest.mark.parametrize("periods, want", [
    ([[(1, 10)], [(2, 11)]] * 3, True),                       # two processes, never in one period: draws
    ([[(1, 10)], [(2, 11)]] * 2 + [[(3, 10), (3, 11)]], False),  # both in one period: shares per process
    ([[(1, 10)], [(2, 11)]] * 2, None),                       # too few periods to tell
    ([[(t, 10)] for t in range(20)], None),                   # one process only: nothing to tell
])
def test_attribution_of_process_samples(periods, want):
    from alnair_agent.gpu.nvml import Attribution

    a = Attribution()
    for n, call in enumerate(periods):
        a.add([(ts * 1000 + n, pid) if len(call) == 1 else (ts, pid) for ts, pid in call])
    assert a.sampled is want


def test_a_gpu_that_gives_each_period_to_one_process_is_averaged_over_a_trailing_second(monkeypatch):
    """Draws (one process per sampling period): each call reports the mean of each process's samples over the last
    second of NVML's timestamps, however short the agent's window, so hurried sampling reads as 1 s windows do."""
    from alnair_agent.gpu import nvml as N

    period_us = 200_000
    draws = [(n * period_us, 10 if n % 3 else 11, 100 if n % 3 else 60) for n in range(1, 40)]  # (ts, pid, sm)
    clock = {"now": 0}

    def process_utilization(h, since):
        return [SimpleNamespace(pid=pid, timeStamp=ts, smUtil=sm, memUtil=0) for ts, pid, sm in draws
                if since < ts <= clock["now"]]

    monkeypatch.setattr(pynvml, "nvmlDeviceGetComputeRunningProcesses",
                        lambda h: [SimpleNamespace(pid=10, usedGpuMemory=1 << 30),
                                   SimpleNamespace(pid=11, usedGpuMemory=1 << 30)])
    monkeypatch.setattr(pynvml, "nvmlDeviceGetGraphicsRunningProcesses", lambda h: [])
    monkeypatch.setattr(pynvml, "nvmlDeviceGetProcessUtilization", process_utilization)
    b = N.NvmlBackend()
    got = []
    for now in range(250_000, 7_000_000, 250_000):  # the agent samples every 0.25 s
        clock["now"] = now
        got.append((now, {p.pid: p.sm_util for p in b._processes(A, "hA")}))
    assert b._attribution[A].sampled is True
    for now, utils in got[-12:]:  # once draws are told apart: the trailing second of samples, not the last 0.25 s
        last_second = [(pid, sm) for ts, pid, sm in draws if now - N.SAMPLED_WINDOW_US < ts <= now]
        for pid in (10, 11):
            mine = [sm for p, sm in last_second if p == pid]
            assert utils[pid] == pytest.approx(sum(mine) / len(mine) if mine else 0.0)
    assert any(len([ts for ts, *_ in draws if now - 250_000 < ts <= now]) <= 1 for now, _ in got[-12:])
