"""CUDA start-up added by the shim, measured the way this VM can resolve it (issue 7).

64 processes creating contexts at once take ~15 s each on the H200 VM with or without the shim (the driver
serializes them), so the 64-at-once spread hides a 100 ms goal (bench/cuda_startup.py). Here:
  pairs   one process without the shim and one with it (a region, limits set, a slot claimed) start at the same
          barrier, many times, spawn order alternating: both see the same driver contention, and the per-pair
          difference is the shim's added start-up;
  N at once  N (default 8) processes, all with or all without the shim, modes alternating, many repetitions.
Each process is the C program of bench/cuda_startup.py: cuInit, retain + set the primary context, cuMemAlloc and
cuMemFree 1 MiB. Prints a table, writes JSON. Figures are whatever this machine measures; nothing is hard-coded.

Usage: python3 bench/shim_startup.py --shim /tmp/shim/libalnair.so [--pairs 40] [--n 8] [--reps 10] [--json f]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchstats import pct
from cuda_startup import build, start_together

ROOT = Path(__file__).resolve().parents[1]


def summary(v: list[float]) -> dict:
    return {"n": len(v), "p50_ms": statistics.median(v), "p90_ms": pct(v, 0.9), "p99_ms": pct(v, 0.99),
            "mean_ms": statistics.fmean(v), "max_ms": max(v)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shim", required=True)
    ap.add_argument("--pairs", type=int, default=40)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default="shim_startup.json")
    a = ap.parse_args()
    from alnair_agent.node.region import Region

    base = {k: v for k, v in os.environ.items() if not k.startswith(("ALNAIR_", "LD_PRELOAD"))}
    rows: dict[str, list[float]] = {"pair, no shim": [], "pair, shim": [], "pair, shim - no shim": [],
                                    f"{a.n} at once, no shim": [], f"{a.n} at once, shim": []}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        exe = build(tmp)

        def shimmed() -> dict[str, str]:
            region = tmp / f"region{time.monotonic_ns()}"
            Region.create(region, 100 << 30, 30).close()  # a fresh container
            return base | {"LD_PRELOAD": a.shim, "ALNAIR_REGION": str(region)}

        for i in range(a.pairs):
            envs = [base, shimmed()] if i % 2 == 0 else [shimmed(), base]
            t = start_together(exe, envs)
            plain, shim = (t[0], t[1]) if i % 2 == 0 else (t[1], t[0])
            rows["pair, no shim"].append(plain)
            rows["pair, shim"].append(shim)
            rows["pair, shim - no shim"].append(shim - plain)
        for i in range(a.reps):
            order = [("no shim", None), ("shim", 1)] if i % 2 == 0 else [("shim", 1), ("no shim", None)]
            for mode, with_shim in order:
                env = shimmed() if with_shim else base
                rows[f"{a.n} at once, {mode}"] += start_together(exe, [env] * a.n)
    table = {k: summary(v) for k, v in rows.items()}
    n_added = table[f"{a.n} at once, shim"]["p99_ms"] - table[f"{a.n} at once, no shim"]["p99_ms"]
    result = {"pairs": a.pairs, "n": a.n, "reps": a.reps, "rows": table, "goal_ms": 100,
              "pair_added_p50_ms": table["pair, shim - no shim"]["p50_ms"],
              "pair_added_p99_ms": table["pair, shim - no shim"]["p99_ms"], f"n{a.n}_p99_added_ms": n_added}
    print(f"{'mode':24} {'n':>4} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9} {'max ms':>9}")
    for k, v in table.items():
        print(f"{k:24} {v['n']:4d} {v['p50_ms']:9.1f} {v['p90_ms']:9.1f} {v['p99_ms']:9.1f} {v['max_ms']:9.1f}")
    print(f"added by the shim: pairs p50 {result['pair_added_p50_ms']:.1f} ms, p99 {result['pair_added_p99_ms']:.1f} ms;"
          f" {a.n} at once p99 {n_added:.1f} ms (goal <= 100 ms)")
    Path(a.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
