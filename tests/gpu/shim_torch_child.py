"""One PyTorch scenario, run in a child process (LD_PRELOAD=libalnair.so is set by the parent before torch loads).

Usage: python3 shim_torch_child.py SCENARIO [ARGS...]; prints one JSON object on its last stdout line.
Used by tests/gpu/test_shim_torch.py, tests/gpu/shim_smoke.py and the benchmarks.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time


def nvml_memory() -> dict:
    """NVML's view of GPU 0 memory, through ctypes (the same dlsym route pynvml takes)."""
    out = {}
    try:
        import pynvml  # type: ignore

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        m = pynvml.nvmlDeviceGetMemoryInfo(h)
        out["pynvml_total"], out["pynvml_used"], out["pynvml_free"] = int(m.total), int(m.used), int(m.free)
    except Exception as e:  # noqa: BLE001 - pynvml missing or failing: report and carry on with ctypes
        out["pynvml_error"] = repr(e)

    class Mem(ctypes.Structure):
        _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

    lib = ctypes.CDLL("libnvidia-ml.so.1")
    lib.nvmlInit_v2()
    dev = ctypes.c_void_p()
    lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(dev))
    m = Mem()
    rc = lib.nvmlDeviceGetMemoryInfo(dev, ctypes.byref(m))
    out.update(nvml_rc=rc, nvml_total=m.total, nvml_used=m.used, nvml_free=m.free)
    return out


def region_slots() -> list[dict]:
    path = os.environ.get("ALNAIR_REGION")
    if not path or not os.path.exists(path):
        return []
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
    from pathlib import Path

    from alnair_agent.node.region import Region

    r = Region.open(Path(path))
    try:
        return [s.__dict__ for s in r.slots()]
    finally:
        r.close()


def main() -> None:
    scenario = sys.argv[1]
    import torch

    res: dict = {"scenario": scenario}
    if scenario == "meminfo":
        free, total = torch.cuda.mem_get_info()
        res.update(free=free, total=total, device_total=torch.cuda.get_device_properties(0).total_memory)
        res.update(nvml_memory())
    elif scenario == "oom":
        chunk = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2].isdigit() else 256 << 20
        held = []
        try:
            while True:
                held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
        except torch.cuda.OutOfMemoryError as e:
            res["error"] = str(e).splitlines()[0][:200]
        res["allocated"] = len(held) * chunk
        res["reserved"] = torch.cuda.memory_reserved()
        free, total = torch.cuda.mem_get_info()
        res.update(free=free, total=total, slots=region_slots())
    elif scenario == "train":
        torch.manual_seed(0)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
            torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(4),
            torch.nn.Flatten(), torch.nn.Linear(64 * 16, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10),
        ).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(64, 3, 32, 32, device="cuda", generator=g)
        y = torch.randint(0, 10, (64,), device="cuda", generator=g)
        losses = []
        for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 20):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(float(loss))
        # a CUDA graph of a small matmul chain, replayed
        a = torch.randn(512, 512, device="cuda", generator=g)
        static_in = torch.randn(512, 512, device="cuda", generator=g)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                (static_in @ a).relu_()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = (static_in @ a).relu_() @ a
        sums = []
        for i in range(5):
            static_in.copy_(torch.full((512, 512), 0.01 * (i + 1), device="cuda"))
            graph.replay()
            sums.append(float(static_out.sum()))
        eager = float(((static_in @ a).relu_() @ a).sum())
        torch.cuda.synchronize()
        res.update(losses=losses, graph_sums=sums, eager_last=eager, slots=region_slots())
    elif scenario == "throughput":
        seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 3.0
        n = int(sys.argv[3]) if len(sys.argv) > 3 else 4096
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        for _ in range(5):
            a @ b
        torch.cuda.synchronize()
        # GPU time of one matmul, measured alone
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(20):
            a @ b
        e1.record()
        torch.cuda.synchronize()
        per = e0.elapsed_time(e1) / 20 / 1000.0
        t0 = time.perf_counter()
        c0 = time.process_time()
        count = 0
        while time.perf_counter() - t0 < seconds:
            a @ b
            count += 1
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        res.update(matmuls=count, wall_s=wall, cpu_s=time.process_time() - c0, matmul_gpu_s=per,
                   utilization=count * per / wall, slots=region_slots())
    elif scenario == "init":
        t0 = time.perf_counter()
        torch.cuda.init()
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        res["init_s"] = time.perf_counter() - t0
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    print(json.dumps(res), flush=True)
    if "--hold" in sys.argv:  # keep what we hold until the parent says so (a line on stdin)
        sys.stdin.readline()


if __name__ == "__main__":
    main()
