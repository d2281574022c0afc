"""Every route to the driver is caught: exported names, dlsym on the libcuda handle, cuGetProcAddress_v2 (with
the requested version and the per-thread default stream flag honoured)."""

from __future__ import annotations

import os

import pytest
from shimkit import GiB

from alnair_agent.node.region import Region

ROUTES = [("route=direct",), ("route=dlsym",), ("route=gpa",), ("route=dlvsym",),
          ("route=direct", "pt=1"), ("route=dlsym", "pt=1"), ("route=gpa", "pt=1"), ("route=dlvsym", "pt=1")]


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: "+".join(r))
def test_each_route_is_intercepted(runner, make_region, route):
    region = make_region(memory_limit=GiB, compute_limit=50)
    res = runner.run(*route, "init", "alloc:600000000", "alloc:600000000", "info", "launch:5:1000",
                     "launchex:3:1000", "coop:2:1000", "graph:4:1000", "freeall", "info", region=region)
    assert res.rcs("alloc") == [0, 2]  # the second one is past the 1 GiB limit: refused by the shim
    assert res.stats["cuMemAlloc_v2"] == 1  # ...without reaching the driver
    assert res.line("info") == {"rc": "0", "free": str(GiB - 600000000), "total": str(GiB)}
    assert res.line("info", 1)["free"] == str(GiB)
    pt = "pt=1" in route
    sfx = "_ptsz" if pt else ""
    for fn, n in (("cuLaunchKernel", 5 + 1), ("cuLaunchKernelEx", 3), ("cuLaunchCooperativeKernel", 2),
                  ("cuGraphLaunch", 4)):
        assert res.stats.get(fn + sfx, 0) == n, (fn + sfx, res.stats)
    [slot] = Region.open(region).slots()
    assert slot.launches == 5 + 3 + 2 + 4 + 1  # the one captured into the graph counts as a launch too
    assert slot.gpu_ns > 0 and slot.memory_used == 0


# (requested version, per-thread flag) -> the real variant the lookup must reach, through our hook
VERSIONED = [
    ("ver=10000", None, "cuCtxCreate_v2", "cuLaunchKernel"),
    ("ver=11040", None, "cuCtxCreate_v3", "cuLaunchKernel"),
    ("ver=12000", None, "cuCtxCreate_v3", "cuLaunchKernel"),
    ("ver=12050", None, "cuCtxCreate_v4", "cuLaunchKernel"),
    ("ver=13000", "pt=1", "cuCtxCreate_v4", "cuLaunchKernel_ptsz"),
    ("ver=6050", "pt=1", "cuCtxCreate_v2", "cuLaunchKernel"),  # _ptsz exists from 7.0 only
]


@pytest.mark.parametrize("ver,pt,ctx_fn,launch_fn", VERSIONED)
def test_versioned_and_per_thread_lookups(runner, make_region, ver, pt, ctx_fn, launch_fn):
    region = make_region(memory_limit=GiB, compute_limit=50)
    opts = ["route=gpa", ver] + ([pt] if pt else [])
    ops = ["init", "ctx", "info", "launch:7:1000"]
    res = runner.run(*opts, *ops, region=region, env={"ALNAIR_CONTEXT_BYTES": str(64 << 20)})
    assert res.rcs("ctx") == [0]
    assert res.stats.get(ctx_fn) == 1, res.stats
    # the primary context and the created one are both charged, whichever variant created it
    assert res.line("info")["free"] == str(GiB - 2 * (64 << 20))
    assert res.stats.get(launch_fn) == 7, res.stats
    [slot] = Region.open(region).slots()
    assert slot.launches == 7


NO_LIMIT_OPS = ["init", "ctx", "alloc:1000000", "managed:2000000", "async:3000", "pool:4000", "pitch:1000:10",
                "vmm:5000000", "array:64:64", "array3d:8:8:8", "mipmap:64:64:3", "info", "totalmem", "nvml",
                "launch:50:1000", "launchex:5:1000", "coop:5:1000", "graph:5:1000", "sync", "free", "free",
                "alloc:99999999999999", "freeall", "info"]


@pytest.mark.parametrize("route", ROUTES[:4], ids=lambda r: r[0])
def test_no_limits_every_call_passes_straight_through(runner, route):
    if os.path.exists("/run/alnair/region"):
        pytest.skip("this machine has a region at the default path")
    plain = runner.run(*route, *NO_LIMIT_OPS, preload=False)
    shimmed = runner.run(*route, *NO_LIMIT_OPS)
    assert plain.returncode == shimmed.returncode == 0
    assert shimmed.lines == plain.lines  # same return codes, pointers, sizes, memory figures
    assert shimmed.stats == plain.stats  # the driver saw exactly the same calls
    assert shimmed.stderr == plain.stderr == ""


def test_no_limits_dlsym_hands_out_the_real_functions(runner):
    if os.path.exists("/run/alnair/region"):
        pytest.skip("this machine has a region at the default path")
    res = runner.run("hooks")
    rows = [ln for ln in res.lines if ln.startswith("hook ")]
    assert rows and all("dlsym_is_hook=0" in ln for ln in rows)


@pytest.fixture(scope="module")
def shim_o0(tmp_path_factory):
    """The shim built at -O0 (no tail calls anywhere) with the host compiler, beside the pinned build."""
    import shutil
    import subprocess

    from shimkit import ROOT

    if shutil.which("gcc") is None:
        pytest.skip("no gcc")
    out = tmp_path_factory.mktemp("shim-O0")
    subprocess.run(["make", "-s", "-C", str(ROOT / "shim"), f"BUILD={out}", "CC=gcc", "CFLAGS=-O0 -g"], check=True,
                   capture_output=True)
    return out / "libalnair.so"


@pytest.mark.parametrize("build_kind", ["pinned", "O0"])
def test_dlsym_rtld_next_is_relative_to_the_caller(runner, make_region, build, shim_o0, build_kind):
    """A library preloaded after the shim asks dlsym(RTLD_NEXT, ...) for the next definition of its own symbol:
    it gets the one after itself (libnext2), never itself, whatever the compiler made of the shim's dlsym."""
    shim = build.shim if build_kind == "pinned" else shim_o0
    region = make_region(memory_limit=GiB, compute_limit=50)
    for preload_region in (region, None):
        env = {"LD_PRELOAD": f"{shim} {build.sim / 'libnext.so'} {build.sim / 'libnext2.so'}"}
        res = runner.run("nextprobe", "init", "alloc:1000", region=preload_region, env=env, preload=False)
        assert res.returncode == 0, res.stderr
        assert res.line("nextprobe") == {} and res.lines[0] == "nextprobe libnext2", res.lines


def test_nvml_process_queries_show_the_container_its_own_processes(runner, make_region):
    """nvidia-smi / pynvml inside a container list GPU processes and their utilization: the other tenants'
    (pids 999991, 999992 here) are not shown; this process and its container siblings are."""
    from shimkit import release, wait_holding

    region = make_region(memory_limit=GiB, compute_limit=50)
    sibling = runner.start("init", "alloc:1000", "hold", region=region)
    try:
        wait_holding(sibling)
        others = {"SIMCUDA_NVML_PIDS": f"999991,{sibling.pid},999992"}
        res = runner.run("init", "pid", "nvmlprocs", region=region, env=others)
        me = int(res.lines[1].split()[1])
        line = res.line("nvmlprocs")
        assert line["rc"] == "0" and line["urc"] == "0", res.lines
        assert sorted(map(int, line["pids"].split(","))) == sorted([me, sibling.pid])
        assert sorted(map(int, line["upids"].split(","))) == sorted([me, sibling.pid])
        # the size query counts what the filtered answer needs; a one-record buffer is too small for two
        assert (line["rq"], line["need"], line["rs"], line["small"]) == ("7", "2", "7", "2")
        # without the shim the same call lists every tenant
        plain = runner.run("init", "nvmlprocs", preload=False, env=others)
        assert len(plain.line("nvmlprocs")["pids"].split(",")) == 4
    finally:
        release(sibling)


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: "+".join(r))
def test_memory_copies_pass_through_and_their_bytes_are_counted(runner, make_region, route):
    """Copies reach the driver unchanged by every route, and each process's slot counts the bytes its copies
    moved: NVML attributes no copy-engine time to processes, the agent's profiler splits it by these bytes."""
    region = make_region(memory_limit=GiB, compute_limit=50)
    res = runner.run(*route, "init", "copy:50:1048576", "copyasync:4096", "sync", region=region)
    copied = int(res.line("copy")["bytes"])
    assert copied >= 1048576 and res.line("copyasync")["rc"] == "0"
    sfx, asfx = ("_ptds", "_ptsz") if "pt=1" in route else ("", "")
    assert res.stats.get("cuMemcpyHtoD_v2" + sfx, 0) == copied // 1048576, res.stats
    assert res.stats.get("cuMemcpyAsync" + asfx, 0) == 1, res.stats
    [slot] = Region.open(region).slots()
    assert slot.copy_bytes == copied + 4096
    assert slot.launches == 0  # copies wait for no turn and count no launch


def test_copies_without_limits_pass_straight_through(runner):
    res = runner.run("route=gpa", "init", "copy:20:65536", preload=True)
    assert int(res.line("copy")["bytes"]) >= 65536
