"""The real shim under PyTorch on a real GPU (run on the H200 by bench/gpu_session.sh; skipped elsewhere).

Each case runs tests/gpu/shim_torch_child.py in a child process with LD_PRELOAD=libalnair.so set before torch loads.
The shim is $ALNAIR_SHIM if set, else built here with `make -C shim`. Needs only the standard library and torch
(no pytest-asyncio): figures are also written to $ALNAIR_GPU_RESULTS/shim_gpu.json when that is set.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from alnair_agent.node.region import Region
from alnair_standins.workloads import NvmlUtilization

ROOT = Path(__file__).resolve().parents[2]

CHILD = Path(__file__).with_name("shim_torch_child.py")
GiB = 1 << 30

pytestmark = pytest.mark.gpu


def _gpu_present() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return shutil.which("nvidia-smi") is not None and subprocess.run(
        [sys.executable, "-c", "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"],
        capture_output=True).returncode == 0


if not _gpu_present():
    pytest.skip("needs an NVIDIA GPU and PyTorch", allow_module_level=True)

RESULTS: dict = {}


@pytest.fixture(scope="module")
def shim() -> str:
    if os.environ.get("ALNAIR_SHIM"):
        return os.environ["ALNAIR_SHIM"]
    out = tempfile.mkdtemp(prefix="alnair-shim-")
    pinned = subprocess.run(["make", "-s", "-C", str(ROOT / "shim"), f"BUILD={out}", f"PYTHON={sys.executable}"],
                            capture_output=True)
    if pinned.returncode != 0:  # no ziglang here: the host compiler (the glibc floor is tested in CI, not here)
        subprocess.run(["make", "-s", "-C", str(ROOT / "shim"), f"BUILD={out}", "CC=cc"], check=True)
    return f"{out}/libalnair.so"


@pytest.fixture(scope="module", autouse=True)
def _write_results():
    yield
    out = os.environ.get("ALNAIR_GPU_RESULTS")
    if out:
        Path(out, "shim_gpu.json").write_text(json.dumps(RESULTS, indent=2))


@pytest.fixture
def region_dir():
    d = tempfile.mkdtemp(prefix="alnair-region-")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def child(*args: str, shim: str | None = None, region: Path | None = None, timeout: float = 300,
          env: dict | None = None) -> dict:
    extra = env or {}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ALNAIR_", "LD_PRELOAD", "PYTORCH_CUDA_ALLOC"))}
    env.update({k: v for k, v in extra.items() if v})
    if shim:
        env["LD_PRELOAD"] = shim
    if region:
        env["ALNAIR_REGION"] = str(region)
    p = subprocess.run([sys.executable, str(CHILD), *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def make(region_dir: Path, memory: int, compute: int) -> Path:
    path = region_dir / "region"
    Region.create(path, memory, compute).close()
    return path


def test_mem_get_info_and_nvml_report_the_limit(shim, region_dir):
    res = child("meminfo", shim=shim, region=make(region_dir, 16 * GiB, 0))
    RESULTS["meminfo_16GiB"] = res
    assert res["total"] == 16 * GiB
    assert res["device_total"] == 16 * GiB
    assert 0 < res["free"] <= 16 * GiB
    assert res["nvml_rc"] == 0 and res["nvml_total"] == 16 * GiB and res["nvml_used"] + res["nvml_free"] <= 16 * GiB
    if "pynvml_total" in res:
        assert res["pynvml_total"] == 16 * GiB


# PyTorch's allocator backends reach different driver APIs: cuMemAlloc_v2 (native), cuMemCreate (expandable
# segments), cuMemAllocFromPoolAsync (cudaMallocAsync).
BACKENDS = {"native": "", "expandable": "expandable_segments:True", "async": "backend:cudaMallocAsync"}


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_allocation_stops_between_15_5_and_16_GiB(shim, region_dir, backend):
    region = make(region_dir, 16 * GiB, 0)
    res = child("oom", str(128 << 20), shim=shim, region=region, env={"PYTORCH_CUDA_ALLOC_CONF": BACKENDS[backend]})
    RESULTS[f"oom_16GiB_{backend}"] = {k: v for k, v in res.items() if k != "slots"}
    assert "error" in res, res  # torch.cuda.OutOfMemoryError was raised
    assert 15.5 * GiB <= res["allocated"] <= 16 * GiB
    assert res["free"] <= res["total"] == 16 * GiB


def test_training_and_cuda_graphs_unchanged_without_limits(shim):
    plain = child("train")
    shimmed = child("train", shim=shim)
    RESULTS["train_no_limits"] = {"plain": plain, "shim": shimmed}
    assert all(math.isfinite(x) for x in plain["losses"])
    assert shimmed["losses"] == pytest.approx(plain["losses"], rel=1e-5, abs=1e-6)
    assert shimmed["graph_sums"] == pytest.approx(plain["graph_sums"], rel=1e-5)
    assert plain["graph_sums"][-1] == pytest.approx(plain["eager_last"], rel=1e-3)


def test_training_under_limits_is_metered(shim, region_dir):
    region = make(region_dir, 16 * GiB, 50)
    res = child("train", shim=shim, region=region)
    RESULTS["train_limited"] = res
    assert all(math.isfinite(x) for x in res["losses"])
    assert res["graph_sums"][-1] == pytest.approx(res["eager_last"], rel=1e-3)
    [slot] = res["slots"]
    assert slot["launches"] > 100 and slot["gpu_ns"] > 0
    assert 0 < slot["memory_used"] <= 16 * GiB


def test_compute_cap_throttles_a_matmul_loop(shim, region_dir):
    uncapped = child("throughput", "4", shim=shim, region=make(region_dir, 0, 0))
    capped = child("throughput", "4", shim=shim, region=make(region_dir, 0, 30))
    RESULTS["throughput"] = {"uncapped": uncapped, "capped_30": capped}
    [slot] = capped["slots"]
    assert slot["gpu_ns"] > 0 and slot["launches"] > 0  # the launches are metered
    assert capped["utilization"] < 0.5 * max(uncapped["utilization"], 0.6)


def test_two_processes_share_one_container_limit(shim, region_dir):
    """Two PyTorch processes of one container allocate at once: together they stay within the 8 GiB limit."""
    region = make(region_dir, 8 * GiB, 0)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ALNAIR_", "LD_PRELOAD", "PYTORCH_CUDA_ALLOC"))}
    env.update(LD_PRELOAD=shim, ALNAIR_REGION=str(region))
    procs = [subprocess.Popen([sys.executable, str(CHILD), "oom", str(128 << 20), "--hold", "--start"], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    for p in procs:  # both contexts exist (and are charged) before either allocates
        line = p.stdout.readline()
        assert line and json.loads(line).get("ready"), p.stderr.read()[-3000:]
    for p in procs:
        p.stdin.write("start\n")
        p.stdin.flush()
    results = []
    for p in procs:  # each reports once it hit the limit, and keeps its memory until both have
        line = p.stdout.readline()
        assert line, p.stderr.read()[-3000:]
        results.append(json.loads(line))
    for p in procs:
        _, err = p.communicate("go\n", timeout=120)
        assert p.returncode == 0, err[-3000:]
    total = sum(r["allocated"] for r in results)
    RESULTS["two_processes_8GiB"] = {"allocated": [r["allocated"] for r in results], "total": total}
    assert all("error" in r for r in results)
    assert 7 * GiB <= total <= 8 * GiB - 2 * (256 << 20)  # both contexts are charged too


# ---- issue 7: ordinary workloads hold their cap (each within 3 points), VMM memory is charged while mapped ----
def _spin(shim: str, region_dir: Path, kind: str, cap: int, seconds: float, env: dict | None = None) -> dict:
    """One spin workload under a cap. Two measures of what it ran on the GPU, and `tokens_s`, what the shim charged:
    - `utilization`: the child's launches x each shape's GPU time timed alone, between two events around one launch
      on an idle GPU. That includes the launch's latency (~20-30 us), so for 200 us kernels it overstates their
      GPU time by 10-15 % (seen on the H200: 32.1 % by this count, 29.2 % by NVML, tokens 30.2 %); for 300 ms kernels
      it is exact.
    - `nvml`: the device's utilization over the same window, polled every 50 ms (first 0.5 s skipped), which misses
      part of a long kernel at the window's edges (17.1 % for 300 ms kernels that ran 19.0 %).
    `truth` is the exact one of the two for the workload: the count for long kernels, NVML for short ones."""
    with NvmlUtilization(int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or 0)) as nv:
        res = child("spin", kind, str(seconds), shim=shim, region=make(region_dir, 0, cap), env=env, timeout=600)
    slots = res.pop("slots", None) or []
    res["tokens_s"] = sum(s.get("gpu_ns", 0) for s in slots) / 1e9
    res["nvml"] = nv.mean(res["wall0"], res["wall1"], skip_s=0.5) / 100.0
    res["truth"] = res["utilization"] if kind == "long" else res["nvml"]
    RESULTS[f"spin_{kind}_{cap}"] = res
    return res


def test_300ms_kernels_hold_a_20_percent_cap(shim, region_dir):
    res = _spin(shim, region_dir, "long", 20, 24.0)
    assert res["refused"] == 0
    assert abs(res["truth"] - 0.20) <= 0.03, res


def test_thousands_of_distinct_kernels_hold_a_30_percent_cap(shim, region_dir):
    # Eager module loading: the 10,000 modules load before the clock starts, not at each one's first launch.
    res = _spin(shim, region_dir, "distinct", 30, 10.0, env={"SPIN_DISTINCT": "10000", "CUDA_MODULE_LOADING": "EAGER"})
    assert res["refused"] == 0
    assert abs(res["truth"] - 0.30) <= 0.03, res


def test_big_and_small_grids_of_one_kernel_hold_a_30_percent_cap(shim, region_dir):
    res = _spin(shim, region_dir, "mix", 30, 10.0)
    assert res["refused"] == 0
    big, small = res["kernel_s"].values()
    assert big > 20 * small  # the 64-wave launch really is that much longer
    assert abs(res["truth"] - 0.30) <= 0.03, res


def test_vmm_create_map_release_is_held_to_1_GiB(shim, region_dir):
    res = child("vmm", str(448 << 20), "4", shim=shim, region=make(region_dir, GiB, 0),
                env={"ALNAIR_CONTEXT_BYTES": "0"})
    res.pop("slots", None)
    RESULTS["vmm_1GiB"] = res
    assert res["create_rcs"] == [0, 0, 2, 2], res  # the third and fourth are refused: 2 x 448 MiB are mapped
    assert res["total"] == GiB and res["free"] <= GiB - 2 * res["size"]
    assert res["after_unmap"]["create_rc"] == 0  # unmapping the last mapping gave its bytes back
