"""Issue 27 on real GPUs (needs 2 or more; NOT YET RUN: no such machine was lent while it was written). A container
of two GPUs capped at 30 % on each runs a matmul loop on both devices of one process (cudaSetDevice switching, one
thread per device): each GPU's NVML utilization is within +-3 of 30, and each device's memory limit is exact
(torch sees it as the device's total; one more unit past it fails). A second container on the same two GPUs capped
at 70 % then runs beside it: each container's shim-counted GPU time on each GPU holds its cap within +-3.

The turns are laid out here as the dispatcher lays them out (one 100 ms period per GPU, the 30 % window first, the
70 % one after it), in regions made as the agent makes them; the processes get ALNAIR_REGIONS,
CUDA_DEVICE_ORDER=PCI_BUS_ID and CUDA_VISIBLE_DEVICES=0,1 (on a bare machine the two first GPUs stand for the
container's NVIDIA_VISIBLE_DEVICES). Run: `python -m pytest -m gpu tests/gpu/test_multigpu_gpu.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]
pynvml = pytest.importorskip("pynvml")
pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
from alnair_agent.node.region import Region, Turn
from alnair_standins.workloads import skip_without_gpu_or_shim

SHIM = Path(os.environ.get("ALNAIR_SHIM") or ROOT / "alnair_agent/lib/libalnair.so")
GiB = 1 << 30
PERIOD_NS = 100_000_000
MEMORY_GIB = 8
SECONDS = 6.0

CHILD = textwrap.dedent("""
    import json, sys, threading, time, torch
    seconds, mem_gib = float(sys.argv[1]), int(sys.argv[2])
    out = {"devices": torch.cuda.device_count(), "mem": [], "over": []}
    for d in range(2):
        torch.cuda.set_device(d)
        free, total = torch.cuda.mem_get_info(d)
        out["mem"].append(total)
        try:
            torch.empty(mem_gib * (1 << 30), dtype=torch.uint8, device=d)
            out["over"].append(False)
        except torch.OutOfMemoryError:
            out["over"].append(True)
        torch.cuda.empty_cache()
    def loop(d, n):
        torch.cuda.set_device(d)
        a = torch.randn(4096, 4096, device=d, dtype=torch.bfloat16)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for _ in range(20):
                a @ a
            torch.cuda.synchronize(d)
            n[d] += 20
    n = [0, 0]
    ts = [threading.Thread(target=loop, args=(d, n)) for d in range(2)]
    [t.start() for t in ts]; [t.join() for t in ts]
    out["steps"] = n
    print(json.dumps(out))
""")


def regions(tmp: Path, name: str, compute: int, offset_ms: int, epoch: int) -> list[Path]:
    paths = []
    for k in range(2):
        path = tmp / f"{name}-{k}"
        r = Region.create(path, MEMORY_GIB * GiB, compute)
        r.set_turn(Turn(epoch, PERIOD_NS, offset_ms * 1_000_000, compute * PERIOD_NS // 100, 0, 0))
        r.beat()
        r.close()
        paths.append(path)
    return paths


def start(paths: list[Path]) -> subprocess.Popen:
    env = {**os.environ, "LD_PRELOAD": str(SHIM), "ALNAIR_REGIONS": ",".join(map(str, paths)),
           "ALNAIR_REGION": str(paths[0]), "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0,1",
           "ALNAIR_MEMORY_LIMIT": str(MEMORY_GIB * GiB)}
    return subprocess.Popen([sys.executable, "-c", CHILD, str(SECONDS), str(MEMORY_GIB)], env=env,
                            stdout=subprocess.PIPE, text=True)


def utilization(handles: list, seconds: float) -> list[float]:
    samples: list[list[int]] = [[] for _ in handles]
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for i, h in enumerate(handles):
            samples[i].append(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)
        time.sleep(0.2)
    return [sum(s) / len(s) for s in samples]


def gpu_ns(path: Path) -> int:
    r = Region.open(path)
    try:
        return sum(s.gpu_ns for s in r.slots())
    finally:
        r.close()


@pytest.fixture
def handles():
    skip_without_gpu_or_shim(SHIM)
    pynvml.nvmlInit()
    if pynvml.nvmlDeviceGetCount() < 2:
        pynvml.nvmlShutdown()
        pytest.skip("needs 2 or more GPUs")
    yield [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(2)]
    pynvml.nvmlShutdown()


def test_two_gpu_container_at_30_then_a_70_beside_it(tmp_path: Path, handles: list) -> None:
    epoch = time.monotonic_ns()
    low = regions(tmp_path, "low", 30, 0, epoch)
    p = start(low)
    time.sleep(2.0)  # torch start-up, the memory checks
    util = utilization(handles, SECONDS - 3.0)
    out = json.loads(p.communicate(timeout=120)[0])
    assert out["devices"] == 2
    assert out["mem"] == [MEMORY_GIB * GiB] * 2, "each device's memory limit is its total"
    assert out["over"] == [True, True], "the limit itself cannot be allocated on top of the context"
    for g, u in enumerate(util):
        assert abs(u - 30) <= 3, f"GPU {g}: NVML {u:.1f} % at a 30 % cap"

    high = regions(tmp_path, "high", 70, 30, epoch)
    before = [gpu_ns(x) for x in low + high]
    ps = [start(low), start(high)]
    outs = [json.loads(q.communicate(timeout=120)[0]) for q in ps]
    after = [gpu_ns(x) for x in low + high]
    shares = [100 * (a - b) / (SECONDS * 1e9) for a, b in zip(after, before, strict=False)]  # over the loops' common time
    assert all(o["devices"] == 2 for o in outs)
    for k, (want, got) in enumerate(zip((30, 30, 70, 70), shares, strict=False)):
        assert abs(got - want) <= 3, f"region {k}: {got:.1f} % of the GPU's time, cap {want}"
