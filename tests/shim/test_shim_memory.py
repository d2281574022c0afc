"""Memory limits: every allocation API counted and given back, the limit held across the container's processes,
SIGKILLed processes reclaimed, fork/exec children covered, env limits when the region is refused."""

from __future__ import annotations

import struct
import subprocess

import pytest
from shimkit import GiB, MiB, kill9, release, wait_holding

from alnair_agent.node import region_layout as L
from alnair_agent.node.region import Region

# op that allocates, the bytes the shim must count for it, the same op past a 1 GiB limit, the driver entry point
APIS = [
    ("alloc:300000000", 300000000, "alloc:1100000000", "cuMemAlloc_v2"),
    ("managed:300000000", 300000000, "managed:1100000000", "cuMemAllocManaged"),
    ("async:300000000", 300000000, "async:1100000000", "cuMemAllocAsync"),
    ("pool:300000000", 300000000, "pool:1100000000", "cuMemAllocFromPoolAsync"),
    ("pitch:1000:1000", 1024 * 1000, "pitch:100000:11000", "cuMemAllocPitch_v2"),  # the driver's pitch: 1024
    ("vmm:300000000", 300000000, "vmm:1100000000", "cuMemCreate"),
    ("array:1000:1000", 1000 * 1000 * 16, "array:100000:1000", "cuArrayCreate_v2"),  # float4 texels
    ("array3d:100:100:100", 100 ** 3 * 16, "array3d:1000:1000:100", "cuArray3DCreate_v2"),
    ("mipmap:1024:1024:3", (1024 ** 2 + 512 ** 2 + 256 ** 2) * 16, "mipmap:8192:8192:2", "cuMipmappedArrayCreate"),
]


@pytest.mark.parametrize("op,size,over,fn", APIS, ids=[a[3] for a in APIS])
def test_every_allocation_api_is_counted_and_given_back(runner, make_region, op, size, over, fn):
    region = make_region(memory_limit=GiB)
    res = runner.run("init", op, "info", "free", "info", over, "info", region=region)
    assert res.lines[1].endswith("rc=0") or " rc=0 " in res.lines[1], res.lines
    assert res.line("info", 0)["free"] == str(GiB - size)
    assert res.lines[3] == "free rc=0"
    assert res.line("info", 1)["free"] == str(GiB)
    assert " rc=2" in res.lines[5], res.lines  # CUDA_ERROR_OUT_OF_MEMORY from the shim...
    assert res.stats[fn] == 1  # ...the driver never saw the over-limit call
    assert res.line("info", 2)["free"] == str(GiB)  # and nothing leaked


def test_failed_driver_call_leaks_nothing(runner, make_region):
    region = make_region(memory_limit=4 * GiB)
    # the simulated GPU has 1 GiB: the driver itself fails the second allocation after the shim reserved it
    res = runner.run("init", "alloc:700000000", "alloc:700000000", "info", "freeall", region=region,
                     env={"SIMCUDA_MEMORY_BYTES": str(GiB)})
    assert res.rcs("alloc") == [0, 2]
    assert res.stats["cuMemAlloc_v2"] == 2
    info = res.line("info")
    assert int(info["total"]) == GiB  # min(limit, real total)
    assert int(info["free"]) == GiB - 700000000
    [slot] = Region.open(region).slots()
    assert slot.memory_used == 0  # the process exited; the failed call left nothing counted


def test_sizes_that_overflow_never_wrap(runner, make_region):
    region = make_region(memory_limit=GiB)
    res = runner.run("init", "alloc:18446744073709551615", "pitch:18446744073709551000:4",
                     "array3d:4294967296:4294967296:4294967296", "alloc:1000", "info", region=region)
    assert res.rcs("alloc") == [2, 0]
    assert res.rcs("pitch") == [2] and res.rcs("array3d") == [2]
    info = res.line("info")
    assert int(info["free"]) == GiB - 1000 and int(info["total"]) == GiB


def test_limit_holds_across_three_processes_of_a_container(runner, make_region):
    region = make_region(memory_limit=GiB)
    held = [runner.start("init", "alloc:300000000", "hold", region=region) for _ in range(3)]
    try:
        for p in held:
            assert "alloc 300000000 rc=0" in wait_holding(p)[1]
        res = runner.run("init", "info", "alloc:200000000", "alloc:170000000", "info", region=region)
        assert res.line("info")["free"] == str(GiB - 900000000)  # the other processes' bytes count here
        assert res.rcs("alloc") == [2, 0]
        assert res.line("info", 1)["free"] == str(GiB - 1070000000)
        by_pid = {s.pid: s.memory_used for s in Region.open(region).slots()}
        assert [by_pid[p.pid] for p in held] == [300000000] * 3
    finally:
        for p in held:
            release(p)


def test_concurrent_allocations_never_exceed_the_limit(runner, make_region):
    region = make_region(memory_limit=GiB)
    ops = ["init"] + ["alloc:100000000"] * 12 + ["hold"]
    procs = [runner.start(*ops, region=region) for _ in range(4)]
    try:
        granted = 0
        for p in procs:
            lines = wait_holding(p)
            granted += sum(1 for ln in lines if ln.startswith("alloc") and ln.split()[2] == "rc=0")
        assert 1 <= granted <= GiB // 100000000  # never past the limit; at most 10 fit
        assert sum(s.memory_used for s in Region.open(region).slots()) == granted * 100000000 <= GiB
    finally:
        for p in procs:
            release(p)


def test_sigkilled_process_bytes_are_reclaimed(runner, make_region):
    region = make_region(memory_limit=GiB)
    survivor = runner.start("init", "alloc:100000000", "hold", region=region)
    victim = runner.start("init", "alloc:800000000", "hold", region=region)
    try:
        wait_holding(survivor)
        wait_holding(victim)
        dead_pid = victim.pid
        kill9(victim)
        # the dead process still holds its slot; the next allocation that would hit the limit reclaims it
        assert dead_pid in [s.pid for s in Region.open(region).slots()]
        res = runner.run("init", "alloc:850000000", "info", region=region)
        assert res.rcs("alloc") == [0]
        assert res.line("info")["free"] == str(GiB - 950000000)
        slots = Region.open(region).slots()
        assert dead_pid not in [s.pid for s in slots]
        assert survivor.pid in [s.pid for s in slots]  # a live process is never reclaimed
    finally:
        release(survivor)


def test_dead_slot_keeps_its_counters(runner, make_region):
    """Reclaiming never zeroes a dead process's counters: they only grow, and the agent takes differences."""
    region = make_region(compute_limit=50)
    victim = runner.start("init", "launch:200:10000", "hold", region=region)
    wait_holding(victim)
    before = sum(s.gpu_ns for s in Region.open(region).slots())
    kill9(victim)
    runner.run("init", "launch:1:1000", region=region)
    r = Region.open(region)
    after = sum(s.gpu_ns for s in r.slots())
    assert after >= before > 0


def test_fork_child_gets_its_own_slot(runner, make_region):
    region = make_region(memory_limit=GiB)
    res = runner.run("init", "alloc:400000000", "fork", "init", "pid", "alloc:400000000", "alloc:400000000", "info",
                     region=region)
    # parent 400 MB + child 400 MB fit; the child's second 400 MB does not: the parent's bytes count for the child
    assert res.rcs("alloc") == [0, 0, 2], res.lines
    assert res.line("info")["free"] == str(GiB - 800000000)
    assert res.line("fork")["status"] == "0"


def test_exec_child_is_covered(runner, make_region):
    region = make_region(memory_limit=GiB)
    res = runner.run("init", "alloc:400000000", "spawn", "init", "alloc:400000000", "alloc:400000000", "info",
                     region=region)
    assert res.rcs("alloc") == [0, 0, 2], res.lines
    assert res.line("info")["free"] == str(GiB - 800000000)


def _corrupt(path, how):
    if how == "missing":
        path.unlink()
        return
    data = bytearray(path.read_bytes())
    if how == "bad-magic":
        struct.pack_into("<I", data, 0, 0xDEADBEEF)
    elif how == "bad-version":
        struct.pack_into("<I", data, 4, L.VERSION + 1)
    elif how == "short":
        data = data[: L.REGION_SIZE // 2]
    elif how == "bad-header-size":
        struct.pack_into("<Q", data, 8, L.REGION_SIZE + 64)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["missing", "bad-magic", "bad-version", "short", "bad-header-size"])
def test_refused_region_falls_back_to_env_limits_with_one_warning(runner, make_region, how):
    region = make_region(memory_limit=8 * GiB, compute_limit=0)
    _corrupt(region, how)
    res = runner.run("init", "alloc:600000000", "alloc:600000000", "info", "nvml", "launch:20:1000", "freeall",
                     region=region, env={"ALNAIR_MEMORY_LIMIT": str(GiB), "ALNAIR_COMPUTE_LIMIT": "40"})
    assert res.rcs("alloc") == [0, 2]
    assert res.line("info") == {"rc": "0", "free": str(GiB - 600000000), "total": str(GiB)}
    assert res.line("nvml")["total"] == str(GiB)
    warnings = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(warnings) == 1, res.stderr
    assert "alnair:" in warnings[0] and str(region) in warnings[0] and "ALNAIR_MEMORY_LIMIT=1073741824" in warnings[0]


def test_malformed_env_limit_is_named_in_a_warning(runner, tmp_path):
    res = runner.run("init", "alloc:600000000", "alloc:600000000", region=tmp_path / "nowhere",
                     env={"ALNAIR_MEMORY_LIMIT": "lots", "ALNAIR_COMPUTE_LIMIT": "30"})
    assert "ALNAIR_MEMORY_LIMIT='lots'" in res.stderr
    assert res.rcs("alloc") == [0, 0]  # no memory limit could be read; the compute limit still holds
    assert len([ln for ln in res.stderr.splitlines() if ln.strip()]) == 2


def test_context_memory_counts(runner, make_region):
    region = make_region(memory_limit=GiB)
    res = runner.run("init", "info", "ctx", "info", "free", "info", region=region,
                     env={"ALNAIR_CONTEXT_BYTES": str(300 * MiB)})
    assert [int(res.line("info", i)["free"]) for i in range(3)] == [GiB - 300 * MiB, GiB - 600 * MiB,
                                                                    GiB - 300 * MiB]
    # a context that would not fit is refused like any allocation
    res = runner.run("init", "ctx", "ctx", "ctx", "info", region=region, env={"ALNAIR_CONTEXT_BYTES": str(300 * MiB)})
    assert res.rcs("ctx") == [0, 0, 2]


def test_the_agent_reads_what_the_shim_writes(runner, make_region):
    region = make_region(memory_limit=GiB)
    p = runner.start("init", "alloc:123456789", "hold", region=region)
    try:
        wait_holding(p)
        r = Region.open(region)
        [slot] = r.slots()
        assert slot.pid == p.pid and slot.memory_used == 123456789 and slot.start_time > 0
        assert r.memory_in_use() == 123456789
    finally:
        release(p)


def test_only_the_shim_reads_the_environment_once(build):
    """Hot path hygiene: no getenv outside init/region setup, no locks on the launch path (launch.c and the files
    it calls into on every launch)."""
    import re

    from shimkit import ROOT

    for src in (ROOT / "shim").glob("*.c"):
        text = src.read_text()
        if src.name == "trace.c":  # diagnostic builds only: all of it under #ifdef ALNAIR_TRACE
            body = text.split("#ifdef ALNAIR_TRACE", 1)[1].rsplit("#else", 1)
            assert "getenv" not in text.split("#ifdef ALNAIR_TRACE", 1)[0] and "getenv" not in body[1], src
        elif src.name not in ("region.c",):
            assert "getenv" not in text, src
    for name in ("launch.c", "turns.c", "estimate.c", "capture.c", "launch_internal.h"):
        assert not re.search(r"pthread_mutex_lock|fprintf|alnair_warn", (ROOT / "shim" / name).read_text()), name
    assert subprocess.run(["true"]).returncode == 0
