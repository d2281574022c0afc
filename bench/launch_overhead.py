"""Host-side cost of one kernel launch with the Alnair shim loaded (compute uncapped) vs without.

Enqueue-only: batches of BATCH launches of an empty kernel (BATCH is well below the driver's launch queue, and the
stream is drained between batches, so the GPU is never the bottleneck); the time of a batch / BATCH is one sample.
The kernel is reached the way PyTorch reaches it: cuLaunchKernel from cuGetProcAddress_v2.

Two comparisons, both interleaved:
  in-process   one process under LD_PRELOAD alternates batches through the shim's hook and through the real
               driver function (the shim's own alnair_hook_real), so both see the same process, clocks and caches;
  processes    processes without the shim and with it (region: memory limit only; and no region at all) alternate.

Usage: python3 bench/launch_overhead.py --shim /tmp/shim/libalnair.so [--json out.json]
Prints a table and writes JSON. Goal: <= 100 ns added per launch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from benchstats import pct

ROOT = Path(__file__).resolve().parents[1]

C_SRC = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
typedef int CUresult; typedef void *CUfunction, *CUstream, *CUmodule, *CUcontext;
typedef CUresult (*launch_t)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void **, void **);
static const char ptx[] = ".version 7.0\n.target sm_50\n.address_size 64\n.visible .entry noop()\n{\n ret;\n}\n";
static unsigned long long now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000ull + t.tv_nsec; }
#define CK(x) do { CUresult r_ = (x); if (r_) { fprintf(stderr, "%s = %d\n", #x, r_); exit(1); } } while (0)
int main(int argc, char **argv) {
    int batches = atoi(argv[1]), batch = atoi(argv[2]), interleave_real = argc > 3 && !strcmp(argv[3], "inproc");
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    CUresult (*gpa)(const char *, void **, int, unsigned long long, int *) = dlsym(h, "cuGetProcAddress_v2");
    CUresult (*init)(unsigned); CUresult (*retain)(CUcontext *, int); CUresult (*setcur)(CUcontext);
    CUresult (*load)(CUmodule *, const void *); CUresult (*getf)(CUfunction *, CUmodule, const char *);
    CUresult (*screate)(CUstream *, unsigned); CUresult (*ssync)(CUstream); launch_t launch, real = NULL;
    int st;
#define G(p, n) CK(gpa(n, (void **)&p, 12000, 0, &st))
    G(init, "cuInit"); G(retain, "cuDevicePrimaryCtxRetain"); G(setcur, "cuCtxSetCurrent");
    G(load, "cuModuleLoadData"); G(getf, "cuModuleGetFunction"); G(screate, "cuStreamCreate");
    G(ssync, "cuStreamSynchronize"); G(launch, "cuLaunchKernel");
    CUcontext ctx; CUmodule mod; CUfunction f; CUstream s;
    CK(init(0)); CK(retain(&ctx, 0)); CK(setcur(ctx)); CK(load(&mod, ptx)); CK(getf(&f, mod, "noop"));
    CK(screate(&s, 1));
    if (interleave_real) {
        int (*count)(void) = dlsym(RTLD_DEFAULT, "alnair_hook_count");
        const char *(*name)(int) = dlsym(RTLD_DEFAULT, "alnair_hook_name");
        void *(*realfn)(int) = dlsym(RTLD_DEFAULT, "alnair_hook_real");
        for (int i = 0; count && i < count(); i++) if (!strcmp(name(i), "cuLaunchKernel")) real = (launch_t)realfn(i);
        if (!real || real == launch) { fprintf(stderr, "no hook/real pair\n"); return 2; }
    }
    for (int w = 0; w < 20; w++) { for (int i = 0; i < batch; i++) launch(f, 1,1,1, 1,1,1, 0, s, NULL, NULL); ssync(s); }
    for (int b = 0; b < batches; b++) {
        for (int which = 0; which < (interleave_real ? 2 : 1); which++) {
            launch_t fn = which ? real : launch;
            unsigned long long t0 = now();
            for (int i = 0; i < batch; i++) CK(fn(f, 1,1,1, 1,1,1, 0, s, NULL, NULL));
            unsigned long long t1 = now();
            CK(ssync(s));
            printf("%s %.2f\n", interleave_real ? (which ? "real" : "hook") : "proc", (double)(t1 - t0) / batch);
        }
    }
    return 0;
}
"""


def build(tmp: Path) -> Path:
    src = tmp / "launch_bench.c"
    src.write_text(C_SRC)
    exe = tmp / "launch_bench"
    subprocess.run(["cc", "-O2", "-o", str(exe), str(src), "-ldl"], check=True)
    return exe


def run(exe: Path, args: list[str], env_extra: dict[str, str]) -> dict[str, list[float]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ALNAIR_", "LD_PRELOAD"))}
    env.update(env_extra)
    out = subprocess.run([str(exe), *args], env=env, capture_output=True, text=True, check=True, timeout=300).stdout
    res: dict[str, list[float]] = {}
    for ln in out.splitlines():
        k, v = ln.split()
        res.setdefault(k, []).append(float(v))
    return res


def summary(xs: list[float]) -> dict[str, float]:
    return {"n": len(xs), "median_ns": statistics.median(xs), "p10_ns": pct(xs, 0.10), "p90_ns": pct(xs, 0.90),
            "mean_ns": statistics.fmean(xs)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shim", required=True)
    ap.add_argument("--json", default="launch_overhead.json")
    ap.add_argument("--batches", type=int, default=400)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    from alnair_agent.node.region import Region, Turn, monotonic_ns

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        exe = build(tmp)
        region = tmp / "region"
        Region.create(region, 64 << 30, 0).close()  # memory capped, compute uncapped: launches are counted only
        capped = tmp / "capped"
        # Compute capped, so every launch takes the metered path (the turn gate, an event pair on 1 launch in 256, a
        # fence every 256), with a window of all but 1 us of each period, so the gate never holds a launch back: what
        # the meter costs the host.
        r = Region.create(capped, 64 << 30, 50)
        r.set_turn(Turn(monotonic_ns(), 50_000_000, 0, 50_000_000 - 1_000))
        r.close()
        shim_region = {"LD_PRELOAD": a.shim, "ALNAIR_REGION": str(region)}
        shim_bare = {"LD_PRELOAD": a.shim, "ALNAIR_REGION": str(tmp / "none")}
        shim_capped = {"LD_PRELOAD": a.shim, "ALNAIR_REGION": str(capped)}
        inproc = run(exe, [str(a.batches), str(a.batch), "inproc"], shim_region)
        procs: dict[str, list[float]] = {"no shim": [], "shim, region (uncapped)": [], "shim, no region": [],
                                         "shim, region (capped: metered)": []}
        for _ in range(a.rounds):  # interleaved processes
            procs["no shim"] += run(exe, [str(a.batches // a.rounds), str(a.batch)], {})["proc"]
            procs["shim, region (uncapped)"] += run(exe, [str(a.batches // a.rounds), str(a.batch)], shim_region)["proc"]
            procs["shim, no region"] += run(exe, [str(a.batches // a.rounds), str(a.batch)], shim_bare)["proc"]
            procs["shim, region (capped: metered)"] += run(exe, [str(a.batches // a.rounds), str(a.batch)],
                                                           shim_capped)["proc"]

    rows = {"in-process: real driver function": summary(inproc["real"]),
            "in-process: through the shim's hook": summary(inproc["hook"])}
    rows.update({f"processes: {k}": summary(v) for k, v in procs.items()})
    added_inproc = statistics.median(h - r for h, r in zip(inproc["hook"], inproc["real"], strict=False))
    added_procs = rows["processes: shim, region (uncapped)"]["median_ns"] - rows["processes: no shim"]["median_ns"]
    added_metered = rows["processes: shim, region (capped: metered)"]["median_ns"] - rows["processes: no shim"]["median_ns"]
    result = {"batch": a.batch, "rows": rows, "added_ns_in_process_median_of_pairs": added_inproc,
              "added_ns_across_processes_median": added_procs, "added_ns_metered_median": added_metered,
              "goal_ns": 100, "goal_metered_ns": 100}
    print(f"{'mode':45} {'median ns':>10} {'p10':>8} {'p90':>8} {'n':>6}")
    for k, v in rows.items():
        print(f"{k:45} {v['median_ns']:10.1f} {v['p10_ns']:8.1f} {v['p90_ns']:8.1f} {v['n']:6d}")
    print(f"added per launch (in-process, median of paired batches): {added_inproc:.1f} ns   "
          f"(across processes, medians): {added_procs:.1f} ns   goal <= 100 ns (uncapped)")
    print(f"added per launch on the metered path (capped, its turn never holding it; across processes, medians): "
          f"{added_metered:.1f} ns")
    Path(a.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
