"""Memory whose lifetime the driver decides: VMM handles live while mapped, a context's allocations die with it,
a freed address comes straight back to another thread, the pitch is the driver's, and a process the others cannot
see is refused rather than ignored (issue 7)."""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

import pytest
from shimkit import ROOT, GiB, MiB

from alnair_agent.node import region_layout as L
from alnair_agent.node.region import Region

HALF = 512 * MiB


def test_vmm_memory_stays_charged_while_mapped_after_release(runner, make_region):
    """create -> map -> release (NVIDIA's samples, UCX): the bytes are the driver's until the last unmap."""
    region = make_region(memory_limit=GiB)
    res = runner.run("init", *[f"vmmmap:{HALF}"] * 4, "info", "free", "info", f"vmmmap:{HALF}", "info",
                     region=region)
    created = res.rcs("vmmmap")
    assert created == [0, 0, 2, 2, 0], res.lines  # 4 x 512 MiB under 1 GiB: the third and fourth are refused
    assert res.line("vmmmap")["release"] == "0"
    assert res.line("info", 0)["free"] == "0"  # two released handles, still mapped, still counted
    assert res.line("info", 1)["free"] == str(HALF)  # the unmap of the last mapping gives one back
    assert res.line("info", 2)["free"] == "0"
    assert res.stats["peak_mem"] <= GiB  # what the (simulated) driver really held


def test_unmapping_before_release_and_partial_unmaps(runner, make_region):
    region = make_region(memory_limit=GiB)
    # a handle released while unmapped goes at once; one mapped twice stays until both mappings go
    res = runner.run("init", "vmm:300000000", "free", "info", f"vmmmap:{HALF}", "free", "info", region=region)
    assert res.line("info", 0)["free"] == str(GiB)
    assert res.line("info", 1)["free"] == str(GiB)
    [slot] = Region.open(region).slots()
    assert slot.memory_used == 0


def test_primary_context_reset_gives_back_its_allocations(runner, make_region):
    region = make_region(memory_limit=GiB)
    res = runner.run("init", "alloc:600000000", "reset", "alloc:600000000", "info", region=region)
    assert res.line("reset") == {"rc": "0", "retain": "0"}
    assert res.rcs("alloc") == [0, 0], res.lines  # the first 600 MB died with the context
    assert res.line("info")["free"] == str(GiB - 600000000)


def test_context_destroy_gives_back_its_allocations(runner, make_region):
    region = make_region(memory_limit=GiB)
    res = runner.run("init", "ctx", "alloc:600000000", "array:1000:1000", "ctxdestroy", "alloc:600000000",
                     "info", region=region, env={"ALNAIR_CONTEXT_BYTES": str(64 * MiB)})
    assert res.line("ctxdestroy")["rc"] == "0"
    assert res.rcs("alloc") == [0, 0], res.lines
    # the primary context's 64 MiB and the new 600 MB are what is left
    assert res.line("info")["free"] == str(GiB - 64 * MiB - 600000000)


def test_allocations_in_other_contexts_survive_a_destroy(runner, make_region):
    region = make_region(memory_limit=GiB)
    res = runner.run("init", "alloc:300000000", "ctx", "alloc:200000000", "ctxdestroy", "info", region=region)
    assert res.line("info")["free"] == str(GiB - 300000000)  # the primary context's allocation still counts


@pytest.mark.parametrize("seed", range(5))
def test_an_address_freed_and_reused_at_once_keeps_its_charge(runner, make_region, seed):
    """Four threads allocate and free at once; the simulated driver hands a freed address straight back while the
    freeing thread has not returned yet. Whatever interleaving, what is held is exactly what is counted."""
    region = make_region(memory_limit=4 * GiB, name=f"r{seed}")
    res = runner.run("init", f"churn:4:{1500 + 100 * seed}:{MiB}", "info", region=region,
                     env={"SIMCUDA_FREE_LATENCY_NS": "20000"})
    churn = res.line("churn")
    assert churn["bad"] == "0"
    assert int(churn["held"]) == 4 * 8 * MiB
    assert int(res.line("info")["free"]) == 4 * GiB - int(churn["held"]), res.lines


def test_a_pitch_wider_than_assumed_is_charged_or_refused(runner, make_region):
    region = make_region(memory_limit=GiB)
    env = {"SIMCUDA_PITCH_ALIGN": "4096"}
    res = runner.run("init", "pitch:1000:1000", "info", "free", "pitch:100000:10600", "info", region=region, env=env)
    assert res.line("pitch")["pitch"] == "4096"
    assert res.line("info", 0)["free"] == str(GiB - 4096 * 1000)  # the driver's pitch, not 512-byte rows
    # 512-byte rows would fit under 1 GiB, the driver's 4096-byte rows do not: refused, and nothing is left behind
    assert res.rcs("pitch") == [0, 2], res.lines
    assert res.line("info", 1)["free"] == str(GiB)
    assert res.stats["cuMemFree_v2"] == 2


def _start_time(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[19])


def test_a_process_beyond_the_last_slot_is_refused_not_ignored(runner, make_region):
    """64 live processes hold the container's slots (10 MB each); a 65th must not allocate unseen."""
    region = make_region(memory_limit=GiB)
    me, start = os.getpid(), _start_time(os.getpid())
    with open(region, "r+b") as f, mmap.mmap(f.fileno(), L.REGION_SIZE) as mm:
        for i in range(L.MAX_SLOTS):
            struct.pack_into("<i", mm, L.absolute_offset("alnair_region_slot", "pid", i), me)
            struct.pack_into("<Q", mm, L.absolute_offset("alnair_region_slot", "start_time", i), start)
            struct.pack_into("<Q", mm, L.absolute_offset("alnair_region_slot", "memory_used", i), 10_000_000)
    res = runner.run("init", "alloc:380000000", "ctx", "launch:3:1000", region=region,
                     env={"ALNAIR_CONTEXT_BYTES": str(64 * MiB)})
    assert res.line("init")["retain"] == "2"  # no context: it cannot use the GPU unseen
    assert res.rcs("alloc") == [2] and res.rcs("ctx") == [2]
    assert res.stats.get("cuMemAlloc_v2", 0) == 0
    assert "slots" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert Region.open(region).memory_in_use() == 64 * 10_000_000

    # a slot frees up: the next allocation claims it and is counted
    with open(region, "r+b") as f, mmap.mmap(f.fileno(), L.REGION_SIZE) as mm:
        struct.pack_into("<Q", mm, L.absolute_offset("alnair_region_slot", "memory_used", 5), 0)
        struct.pack_into("<i", mm, L.absolute_offset("alnair_region_slot", "pid", 5), 0)
    res = runner.run("init", "alloc:380000000", "hold", region=region)
    assert res.rcs("alloc") == [0]


def test_reserve_orders_its_add_before_reading_the_others():
    """The optimistic reserve (add to our slot, then sum every slot) is a store -> load pattern: on Arm it needs
    sequentially consistent atomics on both sides, or two processes can each miss the other's add."""
    region_c = (ROOT / "shim" / "region.c").read_text()
    memory_c = (ROOT / "shim" / "memory.c").read_text()
    body = memory_c[memory_c.index("static int reserve("):]
    body = body[: body.index("\n}\n")]
    assert "__ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST" in body
    used_all = region_c[region_c.index("uint64_t alnair_memory_used_all(void)"):]
    used_all = used_all[: used_all.index("\n}\n")]
    assert "__ATOMIC_SEQ_CST" in used_all and "RLOAD" not in used_all


def test_a_pool_keeps_freed_bytes_under_its_release_threshold(runner, make_region):
    """cudaMemPoolSetAttribute(RELEASE_THRESHOLD, high) (RAPIDS, PyTorch's async backend): freed bytes stay with the
    pool, so they stay counted; the pool serves them again, and a trim gives them back."""
    region = make_region(memory_limit=GiB)
    res = runner.run("init", "poolthreshold:18446744073709551615", "async:600000000", "free", "info",
                     "alloc:600000000", "async:500000000", "info", "free", "trim:0", "info", region=region)
    assert res.line("poolthreshold")["rc"] == "0,0"
    assert res.rcs("async") == [0, 0]
    assert res.line("info", 0)["free"] == str(GiB - 600000000)  # freed into the pool: the driver still holds it
    assert res.rcs("alloc") == [2]  # so 600 MB more would be past the limit
    assert res.line("info", 1)["free"] == str(GiB - 600000000)  # 500 MB served from the pool's 600
    assert res.line("trim")["rc"] == "0,0"
    assert res.line("info", 2)["free"] == str(GiB)
    assert res.stats["peak_mem"] <= GiB


def test_a_pool_without_threshold_gives_freed_bytes_back(runner, make_region):
    region = make_region(memory_limit=GiB)
    res = runner.run("init", "async:600000000", "free", "alloc:600000000", "info", region=region)
    assert res.rcs("alloc") == [0]
    assert res.line("info")["free"] == str(GiB - 600000000)


def test_graph_memory_is_charged_while_the_graph_pool_holds_it(runner, make_region):
    """An allocation captured into a graph is memory once the graph is launched, and stays reserved until
    cuDeviceGraphMemTrim."""
    region = make_region(memory_limit=GiB)
    res = runner.run("init", "memgraph:600000000", "info", "alloc:600000000", "graphtrim", "info",
                     "alloc:600000000", region=region)
    mg = res.line("memgraph")
    assert mg["rc"] == "0,0,0,0" and mg["launch"] == "0" and mg["again"] == "0", res.lines
    assert res.line("info", 0)["free"] == str(GiB - 600000000)
    assert res.rcs("alloc") == [2, 0]
    assert res.line("info", 1)["free"] == str(GiB)


def test_a_graph_launch_past_the_limit_is_refused(runner, make_region):
    region = make_region(memory_limit=GiB)
    res = runner.run("init", "alloc:600000000", "memgraph:600000000", region=region)
    # the first launch reserves 600 MB more (the driver allows it: it is already done); the next one is refused
    assert res.line("memgraph")["launch"] == "0" and res.line("memgraph")["again"] == "2", res.lines
