"""bench/cpus.py: the benchmark's CPU placement (--pin), on fake sysfs topologies, and the tenant code applying it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import cpus
import pytest


def sysfs(tmp: Path, siblings: dict[int, str]) -> Path:
    for cpu, text in siblings.items():
        d = tmp / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(text + "\n")
    return tmp


@pytest.mark.parametrize("text,expect", [("0", [0]), ("0-3", [0, 1, 2, 3]), ("0,8", [0, 8]), ("0-1,4-5", [0, 1, 4, 5]),
                                         ("", [])])
def test_cpu_lists_parse(text, expect):
    assert cpus.parse_list(text) == expect


@pytest.mark.parametrize("siblings,allowed,bench,tenants", [
    ({c: str(c) for c in range(4)}, {0, 1, 2, 3}, [0], [1, 2, 3]),  # no SMT: one CPU per core
    ({0: "0,4", 1: "1,5", 2: "2,6", 3: "3,7", 4: "0,4", 5: "1,5", 6: "2,6", 7: "3,7"}, set(range(8)),
     [0, 4], [1, 2, 3, 5, 6, 7]),  # SMT: first threads of cores 1-3 before their siblings
    ({0: "0-1", 1: "0-1", 2: "2-3", 3: "2-3"}, {1, 2, 3}, [1], [2, 3]),  # an affinity mask cuts a core
])
def test_the_bench_gets_the_first_core_and_tenants_spread_over_the_others(tmp_path, siblings, allowed, bench, tenants):
    plan = cpus.CpuPlan.make(allowed, sysfs(tmp_path, siblings))
    assert plan.bench == bench and plan.tenants == tenants
    envs = [plan.env({})[cpus.ENV_CPUS] for _ in range(len(tenants) + 1)]
    assert envs == [str(c) for c in tenants + tenants[:1]]  # round robin
    plan.reset()
    assert plan.env({"A": "1"}) == {"A": "1", cpus.ENV_CPUS: str(tenants[0])}


def test_missing_topology_counts_each_cpu_as_a_core(tmp_path):
    assert cpus.cores({0, 1, 2}, tmp_path) == [[0], [1], [2]]


def test_one_core_is_refused_with_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="at least 2 physical cores"):
        cpus.CpuPlan.make({0, 1}, sysfs(tmp_path, {0: "0-1", 1: "0-1"}))


def test_tenant_code_pins_itself_before_anything_else():
    cpu = sorted(os.sched_getaffinity(0))[-1]
    code = "import os\n" + cpus.APPLY + "print(sorted(os.sched_getaffinity(0)))\n"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, cpus.ENV_CPUS: str(cpu)},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"[{cpu}]"
