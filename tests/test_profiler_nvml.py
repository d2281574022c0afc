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



class NewestPerProcess:
    """NVML's per-process utilization as documented: per call, each process's newest period with non-zero
    utilization after `since` (one sample per process), from a timeline of (timestamp us, pid, sm %[, us from the
    period's end until the driver has it])."""

    def __init__(self, monkeypatch, timeline: list[tuple[int, ...]], pids: list[int]) -> None:
        self.timeline, self.now, self.asked = timeline, 0, []
        monkeypatch.setattr(pynvml, "nvmlDeviceGetComputeRunningProcesses",
                            lambda h: [SimpleNamespace(pid=p, usedGpuMemory=1 << 30) for p in pids])
        monkeypatch.setattr(pynvml, "nvmlDeviceGetGraphicsRunningProcesses", lambda h: [])
        monkeypatch.setattr(pynvml, "nvmlDeviceGetProcessUtilization", self.query)

    def query(self, h, since):
        self.asked.append(self.now)
        newest: dict[int, tuple[int, int]] = {}
        for ts, pid, sm, *lag in self.timeline:
            if since < ts and ts + sum(lag) <= self.now and ts > newest.get(pid, (0, 0))[0]:
                newest[pid] = (ts, sm)
        return [SimpleNamespace(pid=pid, timeStamp=ts, smUtil=sm, memUtil=0) for pid, (ts, sm) in newest.items()]


def test_a_process_whose_newest_period_came_before_anothers_is_still_read(monkeypatch):
    # 10's period ending at 1.95 s reaches the driver's buffer only at 2.1 s, after 11's period ending at 2.0 s was
    # read: asked after the newest timestamp of any process (2.0 s), 10 would read idle at 2.25 s
    nv = NewestPerProcess(monkeypatch, [(1_900_000, 10, 40), (1_950_000, 10, 45, 150_000), (2_000_000, 11, 60),
                                        (2_200_000, 11, 55)], [10, 11])
    b = NvmlBackend()
    got = []
    for now_us, mono in ((2_050_000, 10.0), (2_250_000, 10.2), (2_300_000, 10.4)):
        nv.now = now_us
        got.append({p.pid: p.sm_util for p in b._processes(A, "hA", mono)})
    assert got == [{10: 40.0, 11: 60.0}, {10: 45.0, 11: 55.0}, {10: 0.0, 11: 0.0}]  # the last: neither ran anew


def test_a_gpu_that_gives_each_period_to_one_process_is_asked_once_a_second_and_held_between(monkeypatch):
    from alnair_agent.gpu import nvml as N

    period_us = 200_000  # one process per period, alternating: draws
    nv = NewestPerProcess(monkeypatch, [(n * period_us, 10 + n % 2, 30 + n % 2 * 40) for n in range(1, 60)],
                          [10, 11])
    b = N.NvmlBackend()
    asks_before, got = 0, []
    for k in range(1, 40):  # the agent samples every 0.25 s
        nv.now = k * 250_000
        got.append((k * 0.25, {p.pid: p.sm_util for p in b._processes(A, "hA", k * 0.25)}))
        if b._attribution[A].sampled is not True:
            asks_before = len(nv.asked)
    assert b._attribution[A].sampled is True
    asked = nv.asked[asks_before:]
    assert len(asked) >= 5
    assert all(b - a >= N.SAMPLED_QUERY_S * 1e6 - N.SAMPLED_QUERY_SLACK_S * 1e6 for a, b in zip(asked, asked[1:], strict=False))
    # after the first ask a second apart: each process's newest period, the same between asks
    held = [u for t, u in got if t * 1e6 > asked[1]]
    assert held and all(u == {10: 30.0, 11: 70.0} for u in held)
