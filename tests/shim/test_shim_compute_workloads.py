"""Ordinary workloads that used to walk past a compute cap (issue 7): long kernels, thousands of distinct kernels,
one kernel at many grid sizes, a new kernel at every launch, open stream captures, siblings with very different
kernels, an agent that stalls mid-write, threads that come and go. Each runs the real shim against the simulated
driver (kernel time = waves x per-wave time); bounds are generous, as in test_shim_compute.py."""

from __future__ import annotations

import mmap
import struct
import time

import pytest
import shimkit
from shimkit import gpu_share, one_gpu, release, shares_together, wait_holding, words

from alnair_agent.node import region_layout as L
from alnair_agent.node.region import Region, Turn, monotonic_ns


def share(res, nth: int = 0) -> float:
    """The GPU's share of the `nth` `run` line (shimkit.share's first half)."""
    return shimkit.share(res, nth)[0]


def test_kernels_longer_than_the_sample_wait_are_measured(runner, make_region):
    """300 ms kernels under 20 %: the sample outlives the 200 ms wait and is still used when it ends; each kernel
    is far longer than the 10 ms window, and what it runs past the window is paid back by skipping windows. Run for
    9 s: in 4.5 s only 5 kernels ran, and the last one's end alone put the share at 0.26-0.27 against the bound, with
    every shim since b946d07 (0.2700 once in a clean-clone CI run)."""
    region = make_region(compute_limit=20)
    res = runner.run("init", "run:9000:300000000", region=region, timeout=60)
    gpu = share(res)
    assert 0.14 <= gpu <= 0.27, res.lines  # 100 % once (every launch charged 20 us); 13 % on the H200 (issue 18)
    [slot] = Region.open(region).slots()
    assert slot.overrun_ns > 1e9


def test_thousands_of_distinct_kernels_stay_capped(runner, make_region):
    """Each of 10,000 kernels is launched about once, so nearly every launch is of a kernel never measured: it goes on
    the guess (recent samples' mean) and fills the window. Waiting for the sample in flight at each such launch ran
    one kernel at a time (0.17 here, 17.7 % of the H200 at cap 30)."""
    region = make_region(compute_limit=30)
    gpu = share(runner.run("init", "distinct:2000:10000:200000", region=region))
    assert 0.24 <= gpu <= 0.36


def test_distinct_kernels_far_longer_than_the_guess_stay_capped(runner, make_region):
    """The other side of going on a guess: after 100 us kernels, distinct 20 ms ones. Only GUESS_AHEAD unknown launches
    go behind the sample in flight, so a bad guess queues a few of them, not a window's worth (400 ms of work on
    100 us guesses: the GPU held all the time, 1.0 here)."""
    region = make_region(compute_limit=30)
    res = runner.run("init", "distinct:300:200:100000", "distinct:2000:500:20000000", region=region, timeout=60)
    assert 0.15 <= share(res, 1) <= 0.42, res.lines


def test_a_loop_after_nine_thousand_kernels_stays_capped(runner, make_region):
    """The estimate table evicts: a program that has seen 9,000 kernels still gets its next kernels measured."""
    region = make_region(compute_limit=20)
    res = runner.run("init", "warm:9000", "run:1500:1000000", region=region)
    assert res.line("warm")["bad"] == "0"
    assert 0.1 <= share(res) <= 0.3, res.lines


@pytest.mark.parametrize("waves,every", [(64, 64), (16, 4)])
def test_one_kernel_at_mixed_grid_sizes_stays_capped(runner, make_region, waves, every):
    """One kernel, one big grid among small ones (the big one first): neither under- nor overcharged."""
    region = make_region(compute_limit=30)
    gpu = share(runner.run("init", f"mix:2500:200000:{waves}:{every}", region=region))
    assert 0.18 <= gpu <= 0.42


def test_a_windows_tail_runs_into_spare_time_and_pays_it_back(runner, make_region):
    """One kernel at a big grid (12.8 ms) among small ones, at 30 % of a 100 ms period: a big launch that does not fit
    the rest of the window waited for the next, and the tail was lost (0.26 here, 25.8 % of the H200 by NVML). When
    the agent says the time after the window is nobody's (turn_spare_ns), the launch runs into it, owed back."""
    shares = []
    for spare in (0, 70_000_000):
        region = make_region(compute_limit=30, name=f"r{spare}")
        r = Region.open(region)
        r.set_turn(Turn(monotonic_ns(), 100_000_000, 0, 30_000_000, 0, spare))
        r.close()
        shares.append(share(runner.run("init", "mix:2500:200000:64:64", region=region)))
        assert Region.open(region).slots()[0].overrun_ns > (1e8 if spare else 0)
    assert 0.27 <= shares[1] <= 0.33 and shares[1] > shares[0], shares


def test_with_no_schedule_the_rest_of_the_period_is_spare(runner, make_region):
    """No agent has written turns (the shim alone, or ALNAIR_DISPATCHER=off): the window is the cap's part of the
    default period at offset 0 and nobody is known to own the rest, so the big launches' tails run into it, owed back
    (25.5 % of the H200 at cap 30 while the default turn had no spare)."""
    region = make_region(compute_limit=30)
    assert 0.27 <= share(runner.run("init", "mix:2500:200000:64:64", region=region)) <= 0.33
    assert Region.open(region).slots()[0].overrun_ns > 1e8


def test_what_runs_into_spare_time_is_paid_from_the_next_window(runner, make_region):
    """A 90 % window followed by 10 ms of spare: its tail runs 9 ms past its end every period, paid by skipping as much
    of the next window's start. The debt arose after the window's own payment was decided; taken again mid-window,
    it was paid from a start already past and skipped nothing (0.99)."""
    region = make_region(compute_limit=90)
    r = Region.open(region)
    r.set_turn(Turn(monotonic_ns(), 100_000_000, 0, 90_000_000, 0, 10_000_000))
    r.close()
    assert 0.86 <= share(runner.run("init", "run:2000:1000000", region=region)) <= 0.93


def test_spare_time_is_never_another_containers_window(runner, make_region, tmp_path):
    """30 % and 50 % containers on one simulated GPU, the 50 % one followed by 20 ms of nobody's time: it runs into
    that, never into the 30 % one's window, and each keeps its part."""
    epoch, P = monotonic_ns(), 100_000_000
    turns = {30: Turn(epoch, P, 0, 30_000_000), 50: Turn(epoch, P, 30_000_000, 50_000_000, 0, 20_000_000)}
    regions = {}
    for cap, turn in turns.items():
        regions[cap] = make_region(compute_limit=cap, name=f"r{cap}")
        r = Region.open(regions[cap])
        r.set_turn(turn)
        r.close()
    shares = shares_together(runner, [regions[cap] for cap in turns], "mix:3000:200000:64:64", tmp_path)
    # The 30 % one has no spare: it loses its own tails (0.26 alone, as above) and nothing to its neighbour, which
    # would take up to 20 of its 30 ms a period if it ran into its window. Two contexts on one GPU lose to each
    # other's overruns as before (the 50 % one: 0.45 without a spare, 0.46-0.48 with it, here).
    assert 0.24 <= shares[0] <= 0.33 and 0.42 <= shares[1] <= 0.53, shares


def test_a_never_seen_kernel_at_every_launch_stays_capped(runner, make_region):
    region = make_region(compute_limit=30)
    gpu = share(runner.run("init", "fresh:1500:1000000", region=region))
    assert 0.24 <= gpu <= 0.36  # 0.20 when each launch waited for its predecessor's sample


@pytest.mark.parametrize("mode", [1, 2], ids=["thread-local", "relaxed"])
def test_another_threads_open_capture_stops_nothing(runner, make_region, mode):
    """A capture held open in another thread (thread-local or relaxed) leaves sampling on, and the shim's own
    event queries never invalidate it."""
    region = make_region(compute_limit=30)
    res = runner.run("init", f"capthread:{mode}", "run:1500:1000000", "capjoin", region=region)
    assert res.line("capthread")["rc"] == "0"
    assert 0.15 <= share(res) <= 0.42
    assert res.line("capjoin")["rc"] == "0"  # not invalidated by the shim


def test_a_global_capture_is_never_invalidated_by_the_shim(runner, make_region):
    region = make_region(compute_limit=30)
    res = runner.run("init", "run:300:1000000", "capthread:0", "run:500:1000000", "capjoin", "run:1000:1000000",
                     region=region)
    assert res.line("capjoin")["rc"] == "0"  # no event query while it was open
    assert 0.15 <= share(res, 2) <= 0.42  # sampling resumes once it ends


def test_a_capture_ended_with_an_error_is_forgotten(runner, make_region):
    """cuStreamEndCapture can end a capture and still fail (an unjoined fork): the shim asks the stream."""
    region = make_region(compute_limit=30)
    res = runner.run("init", "capbegin:0", "capend", "run:1500:1000000", region=region,
                     env={"SIMCUDA_END_CAPTURE_RC": "904"})
    assert res.line("capbegin")["rc"] == "0" and res.line("capend")["rc"] == "904"
    assert 0.15 <= share(res) <= 0.42  # the counter did not stick: sampling goes on


def test_a_capture_ended_from_the_wrong_thread_still_counts(runner, make_region):
    region = make_region(compute_limit=30)
    res = runner.run("init", "capthread:1", "capend", "capjoin", "run:1200:1000000", region=region)
    assert res.line("capjoin")["rc"] == "0"
    assert 0.15 <= share(res) <= 0.42


def test_siblings_with_long_and_short_kernels_both_progress(runner, make_region, tmp_path):
    """A 5 ms-kernel process beside a 100 us one in one container, on one GPU: neither starves, together about the
    cap."""
    region = make_region(compute_limit=40)
    gpu = one_gpu(tmp_path)
    slow = runner.start("init", "run:3000:5000000", "hold", region=region, env=gpu)
    fast = runner.start("init", "run:3000:100000", "hold", region=region, env=gpu)
    shares = []
    try:
        for p in (slow, fast):
            lines = wait_holding(p)
            shares.append(gpu_share(words(lines[-2])))
    finally:
        for p in (slow, fast):
            release(p)
    assert shares[0] >= 0.07, shares  # 3 launches in 4 s before (0.4 %)
    assert shares[1] >= 0.07, shares
    assert sum(shares) <= 0.6, shares


def test_turns_stalled_half_written_freeze_nothing(runner, make_region):
    """The agent stalls half-way through a turn write (a new offset, the old length) for 0.5 s: the shim keeps
    the last consistent turns it read, and follows the new ones once the write ends."""
    region = make_region(compute_limit=30)
    r = Region.open(region)
    r.set_turn(Turn(monotonic_ns(), 50_000_000, 0, 15_000_000))
    p = runner.start("init", "run:1000:1000000", "run:2000:1000000", "hold", region=region)
    try:
        time.sleep(0.5)
        seq_off = L.absolute_offset("alnair_region_agent", "turn_seq")
        with open(region, "r+b") as f, mmap.mmap(f.fileno(), L.REGION_SIZE) as mm:
            seq = struct.unpack_from("<I", mm, seq_off)[0]
            struct.pack_into("<I", mm, seq_off, seq + 1)  # being written...
            struct.pack_into("<Q", mm, L.absolute_offset("alnair_region_agent", "turn_offset_ns"), 30_000_000)
            time.sleep(0.5)
            struct.pack_into("<Q", mm, L.absolute_offset("alnair_region_agent", "turn_length_ns"), 20_000_000)
            struct.pack_into("<I", mm, seq_off, seq + 2)  # done: 40 % from 30 ms in
        lines = wait_holding(p)
    finally:
        release(p)
    shares = [gpu_share(words(ln)) for ln in lines if ln.startswith("run ")]
    assert 0.2 <= shares[0] <= 0.4, shares
    assert 0.3 <= shares[1] <= 0.5, shares


def test_per_thread_events_are_destroyed_when_threads_exit(runner, make_region):
    region = make_region(compute_limit=30)
    res = runner.run("init", "spawnthreads:96:300", region=region)  # each thread past one sample period
    created, destroyed = res.stats.get("cuEventCreate", 0), res.stats.get("cuEventDestroy_v2", 0)
    assert created >= 96, res.stats
    assert destroyed == created, (created, destroyed)


def test_a_process_without_a_slot_cannot_launch_unseen(runner, make_region):
    import os
    from pathlib import Path

    region = make_region(compute_limit=30)
    me = os.getpid()
    stat = Path(f"/proc/{me}/stat").read_text()
    start = int(stat[stat.rindex(")") + 2:].split()[19])
    with open(region, "r+b") as f, mmap.mmap(f.fileno(), L.REGION_SIZE) as mm:
        for i in range(L.MAX_SLOTS):
            struct.pack_into("<i", mm, L.absolute_offset("alnair_region_slot", "pid", i), me)
            struct.pack_into("<Q", mm, L.absolute_offset("alnair_region_slot", "start_time", i), start)
    res = runner.run("launch:5:1000", region=region)  # no context asked for: the launch itself is refused
    assert res.line("launch")["bad"] == "5"
    assert res.stats.get("cuLaunchKernel", 0) == 0


def test_a_loop_that_synchronizes_and_a_launch_bound_one_stay_at_their_caps(runner, make_region):
    """What a token meter got wrong (issue 18): a loop that waits for the GPU every 20 kernels, and a launch-bound
    loop of small kernels with host time between them. In turns each gets its cap's part of what it does alone."""
    for op in ("loop:2000:500000:20:0", "loop:2000:20000:0:30000"):
        alone = runner.run("init", op, preload=False).line("run")
        region = make_region(compute_limit=30, name=f"r{op.split(':')[3]}")
        capped = runner.run("init", op, region=region).line("run")
        rel = (int(capped["launches"]) / int(capped["wall_ns"])) / (int(alone["launches"]) / int(alone["wall_ns"]))
        assert 0.24 <= rel <= 0.36, (op, rel, alone, capped)
