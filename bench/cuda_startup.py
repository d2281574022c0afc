"""CUDA start-up under the shim: N processes (default 64) initialize CUDA at once, with the shim and without.

Each process (a small C program) waits at a barrier, then does cuInit, retains and sets the primary context,
allocates and frees 1 MiB, and reports the CLOCK_MONOTONIC time it finished; start-up = finish - barrier release.
With the shim every process claims a slot in one region (memory and compute limits set), like the processes of one
container. Modes alternate over rounds. Then single processes, alternating, isolate the shim's own per-process
cost from the driver's contention. Goal: p99 added start-up <= 100 ms.

Usage: python3 bench/cuda_startup.py --shim /tmp/shim/libalnair.so [--procs 64] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from benchstats import pct

ROOT = Path(__file__).resolve().parents[1]

C_SRC = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
typedef int CUresult; typedef void *CUcontext; typedef unsigned long long CUdeviceptr;
int main(void) {
    char go;
    if (read(0, &go, 1) != 1) return 3; /* the barrier */
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    CUresult (*gpa)(const char *, void **, int, unsigned long long, int *) = dlsym(h, "cuGetProcAddress_v2");
    CUresult (*init)(unsigned); CUresult (*retain)(CUcontext *, int); CUresult (*setcur)(CUcontext);
    CUresult (*alloc)(CUdeviceptr *, size_t); CUresult (*freep)(CUdeviceptr);
    int st;
    gpa("cuInit", (void **)&init, 12000, 0, &st); gpa("cuDevicePrimaryCtxRetain", (void **)&retain, 12000, 0, &st);
    gpa("cuCtxSetCurrent", (void **)&setcur, 12000, 0, &st); gpa("cuMemAlloc", (void **)&alloc, 12000, 0, &st);
    gpa("cuMemFree", (void **)&freep, 12000, 0, &st);
    CUcontext c; CUdeviceptr p;
    int r = init(0) || retain(&c, 0) || setcur(c) || alloc(&p, 1 << 20) || freep(p);
    struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
    printf("%d %llu\n", r, t.tv_sec * 1000000000ull + t.tv_nsec);
    return r;
}
"""


def build(tmp: Path) -> Path:
    """The start-up program (C_SRC), compiled into tmp."""
    (tmp / "s.c").write_text(C_SRC)
    exe = tmp / "startup"
    subprocess.run(["cc", "-O2", "-o", str(exe), str(tmp / "s.c"), "-ldl"], check=True)
    return exe


def start_together(exe: Path, envs: list[dict[str, str]], settle_s: float | None = None) -> list[float]:
    """Start one process per env and release them at one barrier once all are up (after settle_s; process creation
    is not what is measured): ms from the release to each one's finish."""
    procs = [subprocess.Popen([str(exe)], env=e, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for e in envs]
    time.sleep(0.3 + 0.02 * len(envs) if settle_s is None else settle_s)
    t0 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    for p in procs:
        p.stdin.write("g")
        p.stdin.flush()
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=600)
        rc, t = stdout.split()
        assert rc == "0" and p.returncode == 0, (rc, p.returncode)
        out.append((int(t) - t0) / 1e6)
    return out


def one_round(exe: Path, n: int, env: dict[str, str]) -> list[float]:
    return start_together(exe, [env] * n, 1.0 if n > 1 else 0.2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shim", required=True)
    ap.add_argument("--procs", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--singles", type=int, default=10)
    ap.add_argument("--json", default="cuda_startup.json")
    a = ap.parse_args()
    from alnair_agent.node.region import Region

    base = {k: v for k, v in os.environ.items() if not k.startswith(("ALNAIR_", "LD_PRELOAD"))}
    times: dict[str, list[float]] = {"no shim": [], "shim": []}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        exe = build(tmp)
        for _ in range(a.rounds):
            times["no shim"] += one_round(exe, a.procs, base)
            region = tmp / "region"
            Region.create(region, 100 << 30, 30).close()  # a fresh container: every process claims a slot
            times["shim"] += one_round(exe, a.procs, base | {"LD_PRELOAD": a.shim, "ALNAIR_REGION": str(region)})
        # one process at a time, alternating: the shim's own start-up cost without 64-way driver contention
        single: dict[str, list[float]] = {"single, no shim": [], "single, shim": []}
        for _ in range(a.singles):
            single["single, no shim"] += one_round(exe, 1, base)
            region = tmp / "region"
            Region.create(region, 100 << 30, 30).close()
            single["single, shim"] += one_round(exe, 1, base | {"LD_PRELOAD": a.shim, "ALNAIR_REGION": str(region)})
    times.update(single)
    rows = {k: {"n": len(v), "p50_ms": statistics.median(v), "p99_ms": pct(v, 0.99), "max_ms": max(v)}
            for k, v in times.items()}
    added = rows["shim"]["p99_ms"] - rows["no shim"]["p99_ms"]
    added_single = rows["single, shim"]["p50_ms"] - rows["single, no shim"]["p50_ms"]
    result = {"procs": a.procs, "rounds": a.rounds, "rows": rows, "p99_added_ms": added,
              "single_p50_added_ms": added_single, "goal_ms": 100}
    print(f"{'mode':16} {'n':>5} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9}")
    for k, v in rows.items():
        print(f"{k:16} {v['n']:5d} {v['p50_ms']:9.1f} {v['p99_ms']:9.1f} {v['max_ms']:9.1f}")
    print(f"p99 added start-up with the shim: {added:.1f} ms (goal <= 100 ms), {a.procs} processes at once; "
          f"one process alone, p50 added: {added_single:.1f} ms")
    Path(a.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
