"""CPU placement for GPU benchmarks whose tenants are host-bound (launch-bound loops, batch-1 inference).

A launch-bound PyTorch loop's pace is its host thread's: on the H200 VM the same program alone ran at 52.8k or 66.5k
iterations/s from one process to the next, more than the effects the shares benchmark measures. On a node, pods
with guaranteed CPUs get CPUs of their own (kubelet's static CPU manager); `--pin` gives each tenant process one
logical CPU of its own, spread over physical cores first, and keeps the benchmark process (the agent, the NVML
sampler) on the first core, so a tenant's pace is neither another tenant's nor the agent's. Pinning is handed to
the child through BENCH_CPUS (comma-separated CPU ids), which the tenant code applies before importing torch:
every thread it starts later inherits it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

ENV_CPUS = "BENCH_CPUS"
SYSFS = Path("/sys/devices/system/cpu")
# Tenant code's first lines: apply BENCH_CPUS (a bad value is an error: a benchmark must not silently run unpinned).
APPLY = f"""
_cpus = os.environ.get({ENV_CPUS!r}, "")
if _cpus:
    os.sched_setaffinity(0, {{int(c) for c in _cpus.split(",")}})
"""


def cores(allowed: set[int], sysfs: Path = SYSFS) -> list[list[int]]:
    """The allowed CPUs grouped by physical core (their thread siblings), cores in order of their first CPU."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for cpu in sorted(allowed):
        sib = sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list"
        try:
            ids = tuple(sorted(c for c in parse_list(sib.read_text()) if c in allowed)) or (cpu,)
        except (OSError, ValueError):
            ids = (cpu,)
        groups.setdefault(ids, list(ids))
    return sorted(groups.values(), key=lambda g: g[0])


def parse_list(text: str) -> list[int]:
    """A kernel CPU list ("0-3,8,10-11")."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


@dataclass
class CpuPlan:
    """The benchmark process on the first core; tenants on the others, one logical CPU each, the first thread of
    every core before any second thread, handed out round-robin (a scenario's running tenants are few and come
    first; idle ones wait at their barriers)."""

    bench: list[int]
    tenants: list[int]
    _next: int = field(default=0, repr=False)

    @classmethod
    def make(cls, allowed: set[int] | None = None, sysfs: Path = SYSFS) -> "CpuPlan":
        allowed = set(os.sched_getaffinity(0)) if allowed is None else allowed
        cs = cores(allowed, sysfs)
        if len(cs) < 2:
            raise RuntimeError(f"--pin needs at least 2 physical cores; this process may use CPUs {sorted(allowed)}")
        rest = cs[1:]
        order = [c[i] for i in range(max(len(c) for c in rest)) for c in rest if i < len(c)]
        return cls(bench=cs[0], tenants=order)

    def pin_self(self) -> None:
        os.sched_setaffinity(0, set(self.bench))

    def env(self, env: dict[str, str]) -> dict[str, str]:
        """`env` with the next tenant CPU."""
        cpu = self.tenants[self._next % len(self.tenants)]
        self._next += 1
        return {**env, ENV_CPUS: str(cpu)}

    def reset(self, skip: int = 0) -> None:
        """A new scenario: its tenants take CPUs from the first again (`skip` further on)."""
        self._next = skip

    def describe(self) -> dict[str, list[int]]:
        return {"bench": self.bench, "tenants": self.tenants}
