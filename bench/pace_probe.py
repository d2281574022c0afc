"""Where a program's pace goes under the shim (issue 25): one process, its own reference, phases in turn.

Each run is one tenant process of a shape (bench/shares_gpu.py's SHAPES) that switches its own region between
phases while it runs, so every phase is judged against the same process's pace (host-bound programs' pace moves
20-50 % between processes on the H200 VM; inside one process it is steadier):
  u   the shim loaded, no compute cap (the region's compute_limit 0: launches are only counted): the reference;
  f   capped at 30 and lent the whole GPU (a turn whose window is its whole period: what an elastic container
      alone on a GPU gets): every launch takes the metered path and no turn ever holds one back;
  w   capped at 30 on windows (30 ms of every 100 ms): its pace while the clock is in its window (steps that end
      in it / the windows' time) and overall.
A run with --build plain has no shim at all (phases are only repeated segments: that process's own spread).
With a diagnostic build (make -C shim CFLAGS="-O2 -DALNAIR_TRACE"), the shim's per-launch host time (before the
driver call, in it, after it), its waits and its event calls are summed per process and reported.

    python3 bench/pace_probe.py --build normal=/tmp/shim/libalnair.so --build trace=/tmp/shim-trace/libalnair.so \\
        --shapes train,infer,small --phases u,f,w,u,f,w,u --json $OUT/pace_probe.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests" / "gpu")]

from benchstats import machine, write_json  # noqa: E402
from shares_gpu import SHAPES  # noqa: E402
from workloads import plain_env, run_py  # noqa: E402

from alnair_agent.node.region import Region  # noqa: E402

PERIOD_NS = 100_000_000
CAP = 30
MEMORY = 64 << 30

HEAD = """
import os, sys, time, json
from pathlib import Path
phases, seconds, cpu = sys.argv[1].split(","), float(sys.argv[2]), int(sys.argv[3])
if cpu >= 0:
    os.sched_setaffinity(0, {cpu})
import torch
torch.manual_seed(0)
"""

TAIL = """
from alnair_agent.node.region import Region, Turn, monotonic_ns
path = os.environ.get("ALNAIR_REGION")
reg = Region.open(Path(path)) if path and os.environ.get("LD_PRELOAD") else None
PERIOD, CAP, MEM = %(period)d, %(cap)d, %(memory)d
WIN = PERIOD * CAP // 100
for _ in range(20):
    step()
torch.cuda.synchronize()
out = []
for ph in phases:
    epoch = monotonic_ns()
    if reg is not None:
        if ph == "u":
            reg.set_limits(MEM, 0)
        else:
            reg.set_limits(MEM, CAP)
            reg.set_turn(Turn(epoch, PERIOD, 0, PERIOD if ph == "f" else WIN))
    settle = time.monotonic_ns() + 200_000_000
    while time.monotonic_ns() < settle:
        step()
    torch.cuda.synchronize()
    ends = []
    t0 = time.monotonic_ns()
    stop = t0 + int(seconds * 1e9)
    while True:
        for _ in range(PER_MARK):
            step()
        t = time.monotonic_ns()
        ends.append(t)
        if t >= stop:
            break
    torch.cuda.synchronize()
    t1 = time.monotonic_ns()
    steps = len(ends) * PER_MARK * UNITS
    rec = {"phase": ph, "steps": steps, "seconds": (t1 - t0) / 1e9, "rate": steps / ((t1 - t0) / 1e9)}
    gaps = sorted(b - a for a, b in zip([t0] + ends, ends))
    rec["median_mark_us"] = gaps[len(gaps) // 2] / 1e3
    if ph == "w":
        inside = sum(1 for t in ends if (t - epoch) %% PERIOD < WIN)
        periods = (t1 - t0) / PERIOD
        rec["in_window_rate"] = inside * PER_MARK * UNITS / (periods * WIN / 1e9)
    out.append(rec)
if reg is not None:
    reg.set_limits(MEM, 0)
print(json.dumps({"phases": out}), flush=True)
"""


def tenant_code(shape: str) -> str:
    body = SHAPES[shape].body
    return HEAD + body + TAIL % {"period": PERIOD_NS, "cap": CAP, "memory": MEMORY}


def read_probe(path: Path) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        name, n, ns = line.split()
        out[name] = {"n": int(n), "ns": int(ns)}
    return out


async def one(shape: str, build: str, shim: Path | None, phases: str, seconds: float, tmp: Path, n: int,
              cpu: int) -> dict[str, Any]:
    env = plain_env(0)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    trace = tmp / f"{shape}-{build}-{n}.trace"
    if shim is not None:
        region = tmp / f"region-{n}"
        Region.create(region, MEMORY, 0).close()
        env.update({"LD_PRELOAD": str(shim), "ALNAIR_REGION": str(region), "ALNAIR_TRACE_FILE": str(trace)})
    run_phases = phases if shim is not None else ",".join("p" for _ in phases.split(","))
    res = await run_py(tenant_code(shape), env, run_phases, str(seconds), str(cpu))
    res["probe"] = read_probe(Path(str(trace) + ".sum"))
    return res


def summarise(shape: str, build: str, res: dict[str, Any]) -> dict[str, Any]:
    ph = res["phases"]
    ref = [p["rate"] for p in ph if p["phase"] in ("u", "p")]
    base = statistics.mean(ref) if ref else float("nan")
    row: dict[str, Any] = {"shape": shape, "build": build, "ref_rate": round(base, 1),
                           "ref_spread_pct": round(100 * (max(ref) - min(ref)) / base, 1) if ref else None}
    for kind in ("f", "w"):
        xs = [p for p in ph if p["phase"] == kind]
        if xs:
            row[f"{kind}_pct"] = round(100 * statistics.mean(p["rate"] for p in xs) / base, 1)
        if kind == "w" and xs:
            row["w_in_window_pct"] = round(100 * statistics.mean(p["in_window_rate"] for p in xs) / base, 1)
    pr = res.get("probe") or {}
    if pr.get("launch", {}).get("n"):
        nl = pr["launch"]["n"]
        row["per_launch_ns"] = {k: round(v["ns"] / nl) for k, v in pr.items() if v["ns"]}
        row["counts_per_1k_launches"] = {k: round(1000 * v["n"] / nl, 1) for k, v in pr.items()
                                         if k not in ("launch", "pre", "call", "post")}
    return row


async def main(a: argparse.Namespace) -> dict[str, Any]:
    builds: dict[str, Path | None] = {"plain": None}
    for b in a.build:
        name, _, path = b.partition("=")
        builds[name] = Path(path)
    out: dict[str, Any] = {"machine": machine(), "phases": a.phases, "seconds": a.seconds, "runs": [], "rows": []}
    with tempfile.TemporaryDirectory() as d:
        tmp, n = Path(d), 0
        for _ in range(a.rounds):
            for shape in a.shapes.split(","):
                for build, shim in builds.items():
                    n += 1
                    try:
                        res = await one(shape, build, shim, a.phases, a.seconds, tmp, n, a.cpu)
                    except Exception as e:  # noqa: BLE001 - a diagnostic: record it, go on
                        print(f"{shape} {build}: error {e!r}"[:600], flush=True)
                        out["runs"].append({"shape": shape, "build": build, "error": repr(e)[-2000:]})
                        continue
                    row = summarise(shape, build, res)
                    print(json.dumps(row), flush=True)
                    out["runs"].append({"shape": shape, "build": build, **res})
                    out["rows"].append(row)
                    if a.json:
                        write_json(a.json, out)
    print(f"\n{'shape':8} {'build':8} {'ref/s':>9} {'spread':>7} {'lent':>7} {'window':>7} {'in-win':>7}")
    for r in out["rows"]:
        print(f"{r['shape']:8} {r['build']:8} {r['ref_rate']:>9} {str(r['ref_spread_pct']):>7} "
              f"{str(r.get('f_pct', '')):>7} {str(r.get('w_pct', '')):>7} {str(r.get('w_in_window_pct', '')):>7}")
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", action="append", default=[], metavar="NAME=PATH", help="a shim build to run under")
    ap.add_argument("--shapes", default="train,infer,small")
    ap.add_argument("--phases", default="u,f,w,u,f,w,u")
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--cpu", type=int, default=2, help="pin each tenant to this CPU (-1: no pinning)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    asyncio.run(main(args))
