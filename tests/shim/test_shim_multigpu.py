"""A container of several GPUs under the real shim and the simulated driver (SIMCUDA_DEVICES=2): one region per
device (ALNAIR_REGIONS, as the agent sets it), memory and launches charged to the device of the calling thread's
current context, `cudaSetDevice` switching (primary context retained and made current) in one process, a free on
the device it was allocated on whichever device is current, and CUDA_VISIBLE_DEVICES remapping ordinals."""

from __future__ import annotations

from pathlib import Path

import pytest
from shimkit import gpu_share

from alnair_agent.node.region import Region

GiB = 1 << 30
MB = 700_000_000


@pytest.fixture
def two(make_region):
    """Two regions (one per GPU of the container), 1 GiB each, compute as given; returns (paths, env)."""
    def make(compute: int = 0) -> tuple[list[Path], dict[str, str]]:
        paths = [make_region(memory_limit=GiB, compute_limit=compute, name=f"region{k}") for k in range(2)]
        env = {"ALNAIR_REGIONS": ",".join(map(str, paths)), "SIMCUDA_DEVICES": "2",
               "NVIDIA_VISIBLE_DEVICES": "GPU-aaaa,GPU-bbbb"}
        return paths, env
    return make


def slots(path: Path) -> tuple[int, int, int]:
    """(memory used, launches, gpu_ns) over the region's slots."""
    r = Region.open(path)
    try:
        s = r.slots()
        return sum(x.memory_used for x in s), sum(x.launches for x in s), sum(x.gpu_ns for x in s)
    finally:
        r.close()


def test_memory_limit_holds_per_device_and_a_free_goes_back_to_its_device(runner, two):
    paths, env = two()
    res = runner.run("init", "alloc:700000000", "alloc:700000000", "setdev:1", "alloc:700000000",
                     "alloc:700000000", env=env)
    assert res.rcs("alloc") == [0, 2, 0, 2]  # each device holds one 700 MB allocation of its 1 GiB
    assert slots(paths[0])[0] == MB and slots(paths[1])[0] == MB
    # device 0 current, the pointer of device 1 freed: its bytes go back to device 1
    res = runner.run("init", "setdev:1", "alloc:700000000", "setdev:0", "free", "setdev:1", "alloc:700000000",
                     env=env)
    assert res.rcs("alloc") == [0, 0]
    assert res.rcs("free") == [0]


def test_mem_get_info_reports_each_devices_own_use(runner, two):
    paths, env = two()
    res = runner.run("init", "alloc:700000000", "info", "setdev:1", "info", env=env)
    first, second = res.line("info", 0), res.line("info", 1)
    assert int(first["total"]) == int(second["total"]) == GiB
    assert int(first["free"]) == GiB - MB and int(second["free"]) == GiB


def test_launches_on_each_device_are_counted_on_that_device(runner, two):
    paths, env = two()
    res = runner.run("init", "launch:7:1000", "setdev:1", "launch:5:1000", "setdev:0", "launch:2:1000", env=env)
    assert res.returncode == 0, res.stderr
    assert slots(paths[0])[1] == 9 and slots(paths[1])[1] == 5


def test_kernel_time_on_device_1_is_never_charged_to_device_0(runner, two):
    """Capped at 30 % on each GPU: a process that runs kernels only on device 1 leaves device 0's counters at 0
    and holds device 1 to its cap."""
    paths, env = two(compute=30)
    res = runner.run("init", "setdev:1", "run:600:2000000", env=env)
    assert res.returncode == 0, res.stderr
    line = res.line("run")
    share = gpu_share(line)
    assert 0.2 <= share <= 0.4, line
    assert slots(paths[0])[1:] == (0, 0)
    assert slots(paths[1])[1] > 0 and slots(paths[1])[2] > 0


def test_kernels_on_both_devices_of_one_process_are_each_capped(runner, two):
    paths, env = two(compute=30)
    res = runner.run("init", "run:500:2000000", "setdev:1", "run:500:2000000", env=env)
    assert res.returncode == 0, res.stderr
    for k in range(2):
        line = res.line("run", k)
        share = gpu_share(line)
        assert 0.2 <= share <= 0.4, (k, line)
        assert slots(paths[k])[1] > 0 and slots(paths[k])[2] > 0


def test_cuda_visible_devices_remaps_ordinals(runner, two):
    paths, env = two()
    for cvd in ("1", "GPU-bbbb", "GPU-bb"):  # an index, a UUID, a UUID prefix: ordinal 0 is the second GPU
        res = runner.run("init", "alloc:700000000", env={**env, "CUDA_VISIBLE_DEVICES": cvd})
        assert res.rcs("alloc") == [0]
        # (the previous run's slot, its process dead, is reclaimed by this one)
        assert slots(paths[0])[0] == 0 and slots(paths[1])[0] == MB, cvd


def test_one_region_stays_as_it_was(runner, make_region):
    """Without ALNAIR_REGIONS (a one-GPU container) every device ordinal is the one region's, as before."""
    region = make_region(memory_limit=GiB)
    res = runner.run("init", "alloc:700000000", "alloc:700000000", region=region, env={"SIMCUDA_DEVICES": "2"})
    assert res.rcs("alloc") == [0, 2]
