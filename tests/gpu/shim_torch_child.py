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
    from pathlib import Path

    from alnair_agent.node.region import Region

    r = Region.open(Path(path))
    try:
        return [s.__dict__ for s in r.slots()]
    finally:
        r.close()


# A kernel that runs `ns` nanoseconds per block (spins on %globaltimer): its GPU time is known whatever the GPU,
# and grows with the grid in waves. PTX, JIT-compiled by the driver: no toolkit, no NVRTC.
SPIN_PTX = b"""
.version 7.0
.target sm_75
.address_size 64
.visible .entry spin(.param .u64 ns)
{
    .reg .pred p;
    .reg .u64 t0, t1, d, n;
    ld.param.u64 n, [ns];
    mov.u64 t0, %globaltimer;
LOOP:
    mov.u64 t1, %globaltimer;
    sub.u64 d, t1, t0;
    setp.lt.u64 p, d, n;
    @p bra LOOP;
    ret;
}
"""


class Driver:
    """The driver API through ctypes: every call goes through libalnair.so's exported hooks (ctypes looks the
    names up with dlsym on libcuda's handle, the route the shim wraps)."""

    def __init__(self) -> None:
        import torch

        torch.zeros(1, device="cuda")  # the primary context, current in this thread
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.u64 = ctypes.c_uint64

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed: CUresult {rc}")

    cubin: bytes | None = None

    def compile_spin(self) -> bytes:
        """PTX -> cubin once (cuLink*), so loading it thousands of times costs no JIT."""
        state, out, size = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_size_t()
        self.check(self.cu.cuLinkCreate_v2(0, None, None, ctypes.byref(state)), "cuLinkCreate")
        self.check(self.cu.cuLinkAddData_v2(state, 1, ctypes.c_char_p(SPIN_PTX), ctypes.c_size_t(len(SPIN_PTX) + 1),
                                            b"spin.ptx", 0, None, None), "cuLinkAddData")  # 1: CU_JIT_INPUT_PTX
        self.check(self.cu.cuLinkComplete(state, ctypes.byref(out), ctypes.byref(size)), "cuLinkComplete")
        cubin = ctypes.string_at(out, size.value)
        self.check(self.cu.cuLinkDestroy(state), "cuLinkDestroy")
        return cubin

    def spin_function(self):
        if self.cubin is None:
            self.cubin = self.compile_spin()
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        self.check(self.cu.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(self.cubin)), "cuModuleLoadData")
        self.check(self.cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"spin"), "cuModuleGetFunction")
        return fn

    def launch(self, fn, ns: int, blocks: int = 1, threads: int = 32) -> int:
        arg = ctypes.c_uint64(ns)
        params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(arg), ctypes.c_void_p))
        return self.cu.cuLaunchKernel(fn, ctypes.c_uint(blocks), 1, 1, ctypes.c_uint(threads), 1, 1, 0, None, params,
                                      None)

    def sync(self) -> None:
        self.check(self.cu.cuCtxSynchronize(), "cuCtxSynchronize")

    def timed(self, fn, ns: int, blocks: int, threads: int, warm: bool = False) -> float:
        """GPU seconds of one launch, by events (the events are not the shim's). `warm`: one launch first (a
        function's first launch costs more than its later ones); only for short kernels, since under a cap the
        warm-up spends tokens the timed launch may then wait for, between the two events."""
        if warm:
            self.check(self.launch(fn, ns, blocks, threads), "cuLaunchKernel")
        e0, e1 = ctypes.c_void_p(), ctypes.c_void_p()
        self.check(self.cu.cuEventCreate(ctypes.byref(e0), 0), "cuEventCreate")
        self.check(self.cu.cuEventCreate(ctypes.byref(e1), 0), "cuEventCreate")
        self.sync()
        self.check(self.cu.cuEventRecord(e0, None), "cuEventRecord")
        self.check(self.launch(fn, ns, blocks, threads), "cuLaunchKernel")
        self.check(self.cu.cuEventRecord(e1, None), "cuEventRecord")
        self.sync()
        ms = ctypes.c_float()
        self.check(self.cu.cuEventElapsedTime(ctypes.byref(ms), e0, e1), "cuEventElapsedTime")
        return ms.value / 1000.0


def spin_scenario(kind: str, seconds: float) -> dict:
    """kind: long (300 ms kernels), distinct (thousands of distinct 200 us kernels, round robin), mix (one 200 us
    per-wave kernel: a 64-wave launch, then 63 one-wave launches, repeated)."""
    import torch

    d = Driver()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res: dict = {"kind": kind, "sms": sms}
    if kind == "long":
        fn = d.spin_function()
        plan = [(fn, 300_000_000, 1)]
    elif kind == "distinct":
        n = int(os.environ.get("SPIN_DISTINCT", "5000"))
        t0 = time.perf_counter()
        fns = [d.spin_function() for _ in range(n)]  # each module load is a distinct CUfunction
        res["load_s"] = time.perf_counter() - t0
        plan = [(f, 200_000, 1) for f in fns]
    elif kind == "mix":
        fn = d.spin_function()
        wave = 2 * sms  # 1024-thread blocks: two per SM make one wave
        plan = [(fn, 200_000, 64 * wave)] + [(fn, 200_000, wave)] * 63
        res["wave_blocks"] = wave
    else:
        raise SystemExit(f"unknown spin kind {kind}")
    threads = 1024 if kind == "mix" else 32
    # GPU time of each distinct shape, measured alone
    cost = {}
    for f, ns, blocks in plan:
        if (ns, blocks) not in cost:
            cost[(ns, blocks)] = d.timed(f, ns, blocks, threads, warm=kind == "distinct")
    res["kernel_s"] = {f"{ns}ns x{blocks}": v for (ns, blocks), v in cost.items()}
    d.sync()
    res["wall0"] = time.time()
    t0 = time.perf_counter()
    c0 = time.process_time()
    count, gpu, refused = 0, 0.0, 0
    while time.perf_counter() - t0 < seconds:
        f, ns, blocks = plan[count % len(plan)]
        rc = d.launch(f, ns, blocks, threads)
        if rc != 0:
            refused += 1
            break
        gpu += cost[(ns, blocks)]
        count += 1
    d.sync()
    wall = time.perf_counter() - t0
    res["wall1"] = time.time()
    res.update(launches=count, refused=refused, wall_s=wall, gpu_s=gpu, utilization=gpu / wall,
               cpu_s=time.process_time() - c0, slots=region_slots())
    return res


def vmm_scenario(size: int, count: int) -> dict:
    """The documented VMM idiom: cuMemCreate -> cuMemAddressReserve -> cuMemMap -> cuMemRelease, `count` times;
    then the last mapping is unmapped and one more is tried."""
    import torch

    d = Driver()

    class Location(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

    class AllocFlags(ctypes.Structure):
        _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                    ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]

    class Prop(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", Location),
                    ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", AllocFlags)]

    prop = Prop(type=1, requestedHandleTypes=0, location=Location(type=1, id=0))  # pinned, on device 0
    gran = ctypes.c_size_t()
    d.check(d.cu.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 0), "granularity")
    size = (size + gran.value - 1) // gran.value * gran.value
    rcs, maps = [], []
    for _ in range(count):
        h = ctypes.c_ulonglong()
        rc = d.cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_ulonglong(0))
        rcs.append(rc)
        if rc != 0:
            continue
        va = ctypes.c_ulonglong()
        d.check(d.cu.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(size), ctypes.c_size_t(0),
                                         ctypes.c_ulonglong(0), ctypes.c_ulonglong(0)), "cuMemAddressReserve")
        d.check(d.cu.cuMemMap(va, ctypes.c_size_t(size), ctypes.c_size_t(0), h, ctypes.c_ulonglong(0)), "cuMemMap")
        d.check(d.cu.cuMemRelease(h), "cuMemRelease")  # the mapping keeps the memory
        maps.append(va.value)
    free, total = torch.cuda.mem_get_info()
    after = {}
    if maps:
        d.check(d.cu.cuMemUnmap(ctypes.c_ulonglong(maps[-1]), ctypes.c_size_t(size)), "cuMemUnmap")
        h = ctypes.c_ulonglong()
        after["create_rc"] = d.cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(size), ctypes.byref(prop),
                                              ctypes.c_ulonglong(0))
        if after["create_rc"] == 0:
            d.check(d.cu.cuMemRelease(h), "cuMemRelease")
    return {"size": size, "create_rcs": rcs, "free": free, "total": total, "after_unmap": after,
            "slots": region_slots()}


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
        if "--start" in sys.argv:
            # Several processes of one container: each creates its CUDA context first (the shim charges it), says so,
            # and allocates only once told to, so none is refused its context by a sibling that started sooner.
            torch.empty(1, device="cuda")
            print(json.dumps({"ready": True}), flush=True)
            sys.stdin.readline()
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
    elif scenario == "spin":
        res.update(spin_scenario(sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else 10.0))
    elif scenario == "vmm":
        res.update(vmm_scenario(int(sys.argv[2]), int(sys.argv[3])))
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
