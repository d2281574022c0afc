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
import tempfile
from pathlib import Path
from typing import Any

from benchstats import write_json
from shares_gpu import SHAPES

from alnair_agent.node.region import Region
from alnair_standins.workloads import plain_env, run_py

ROOT = Path(__file__).resolve().parents[1]

PERIOD_NS = 100_000_000
CAP = 30
MEMORY = 64 << 30

HEAD = """
import os, sys, time, json
from pathlib import Path
phases, seconds, cpu = sys.argv[1].split(","), float(sys.argv[2]), int(sys.argv[3])
ref_seconds, SETTLE_NS = float(sys.argv[4]), int(float(sys.argv[5]) * 1e9)
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
    kind, cap = ph[0], int(ph[1:] or CAP)
    win = PERIOD * cap // 100
    epoch = monotonic_ns()
    if reg is not None:
        if kind in "up":
            reg.set_limits(MEM, 0)
        else:
            reg.set_limits(MEM, cap)
            reg.set_turn(Turn(epoch, PERIOD, 0, PERIOD if kind == "f" else win))
    settle = time.monotonic_ns() + SETTLE_NS
    while time.monotonic_ns() < settle:
        step()
    torch.cuda.synchronize()
    ends = []
    t0 = time.monotonic_ns()
    stop = t0 + int((seconds if kind not in "up" else ref_seconds) * 1e9)
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
    if kind == "w":
        inside = sum(1 for t in ends if (t - epoch) %% PERIOD < win)
        periods = (t1 - t0) / PERIOD
        rec["in_window_rate"] = inside * PER_MARK * UNITS / (periods * win / 1e9)
        buckets = [0] * (win // 1_000_000 + 1)
        for t in ends:
            ph_ms = ((t - epoch) %% PERIOD) // 1_000_000
            if ph_ms < len(buckets):
                buckets[ph_ms] += 1
        rec["window_ms_marks"] = buckets
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


def read_lateness(path: Path) -> dict[str, float] | None:
    """The trace build's 'W' records: how late after its window's start a waiting thread went on (us)."""
    if not path.exists():
        return None
    late = sorted(int(line.split()[2]) / 1e3 for line in path.read_text().splitlines() if line.startswith("W "))
    if not late:
        return None
    return {"n": len(late), "median_us": late[len(late) // 2], "p90_us": late[int(0.9 * (len(late) - 1))],
            "max_us": late[-1]}


async def one(shape: str, build: str, shim: Path | None, a: argparse.Namespace, tmp: Path, n: int) -> dict[str, Any]:
    env = plain_env(0)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    trace = tmp / f"{shape}-{build}-{n}.trace"
    phases = a.phases
    if shim is not None:
        region = tmp / f"region-{n}"
        Region.create(region, MEMORY, 0).close()
        env.update({"LD_PRELOAD": str(shim), "ALNAIR_REGION": str(region), "ALNAIR_TRACE_FILE": str(trace)})
    else:
        phases = ",".join("p" for p in phases.split(",") if p == "u")
    res = await run_py(tenant_code(shape), env, phases, str(a.seconds), str(a.cpu), str(a.ref_seconds),
                       str(a.settle))
    res["probe"] = read_probe(Path(str(trace) + ".sum"))
    res["lateness"] = read_lateness(trace)
    return res


def paired(ph: list[dict[str, Any]], i: int, key: str) -> float | None:
    """Phase i's `key` against the mean of the reference phases just before and after it (the same process, a
    second apart at most): the program's own pace then, whatever mode its host is in."""
    refs = [ph[j]["rate"] for j in (i - 1, i + 1) if 0 <= j < len(ph) and ph[j]["phase"] in ("u", "p")]
    if not refs or key not in ph[i]:
        return None
    return 100 * ph[i][key] / statistics.mean(refs)


def summarise(shape: str, build: str, res: dict[str, Any]) -> dict[str, Any]:
    ph = res["phases"]
    ref = [p["rate"] for p in ph if p["phase"] in ("u", "p")]
    base = statistics.mean(ref)
    steps = [100 * abs(b - a) / statistics.mean((a, b)) for a, b in zip(ref, ref[1:], strict=False)]
    row: dict[str, Any] = {"shape": shape, "build": build, "ref_rate": round(base, 1),
                           "ref_step_spread_pct": round(statistics.median(steps), 1) if steps else None,
                           "ref_range_pct": round(100 * (max(ref) - min(ref)) / base, 1)}
    by: dict[str, dict[str, list[float]]] = {}
    for i, p in enumerate(ph):
        if p["phase"] in ("u", "p"):
            continue
        d = by.setdefault(p["phase"], {})
        for key, name in (("rate", "share"), ("in_window_rate", "in_window")):
            v = paired(ph, i, key)
            if v is not None:
                d.setdefault(name, []).append(v)
    for phase, d in by.items():
        for name, xs in d.items():
            row[f"{phase}_{name}_pct"] = round(statistics.median(xs), 1)
            row[f"{phase}_{name}_each"] = [round(x, 1) for x in xs]
    pr = res.get("probe") or {}
    if pr.get("launch", {}).get("n"):
        nl = pr["launch"]["n"]
        row["per_launch_ns"] = {k: round(v["ns"] / nl) for k, v in pr.items() if v["ns"]}
        row["counts_per_1k_launches"] = {k: round(1000 * v["n"] / nl, 1) for k, v in pr.items()
                                         if k not in ("launch", "pre", "call", "post")}
    if res.get("lateness"):
        row["window_start_lateness_us"] = res["lateness"]
    return row


async def main(a: argparse.Namespace) -> dict[str, Any]:
    builds: dict[str, Path | None] = {"plain": None} if a.plain else {}
    for b in a.build:
        name, _, path = b.partition("=")
        builds[name] = Path(path)
    out: dict[str, Any] = {"phases": a.phases, "seconds": a.seconds, "ref_seconds": a.ref_seconds, "runs": [],
                           "rows": []}
    with tempfile.TemporaryDirectory() as d:
        tmp, n = Path(d), 0
        for _ in range(a.rounds):
            for shape in a.shapes.split(","):
                for build, shim in builds.items():
                    n += 1
                    try:
                        res = await one(shape, build, shim, a, tmp, n)
                    except Exception as e:  # noqa: BLE001 - a diagnostic: record it, go on
                        print(f"{shape} {build}: error {e!r}"[:600], flush=True)
                        out["runs"].append({"shape": shape, "build": build, "error": repr(e)[-2000:]})
                        continue
                    row = summarise(shape, build, res)
                    print(json.dumps({k: v for k, v in row.items() if not k.endswith("_each")}), flush=True)
                    out["runs"].append({"shape": shape, "build": build, **res})
                    out["rows"].append(row)
                    if a.json:
                        write_json(a.json, out)
    kinds = [p for p in dict.fromkeys(a.phases.split(",")) if p not in ("u", "p")]
    head = f"{'shape':8} {'build':8} {'ref/s':>9} {'step±':>6}" + "".join(
        f" {k + (' in-win' if k.startswith('w') else ''):>13}" for k in kinds) + "".join(
        f" {k + ' share':>10}" for k in kinds if k.startswith("w"))
    print("\n" + head)
    for r in out["rows"]:
        line = f"{r['shape']:8} {r['build']:8} {r['ref_rate']:>9} {str(r['ref_step_spread_pct']):>6}"
        for k in kinds:
            line += f" {str(r.get(f'{k}_in_window_pct' if k.startswith('w') else f'{k}_share_pct', '')):>13}"
        for k in kinds:
            if k.startswith("w"):
                line += f" {str(r.get(f'{k}_share_pct', '')):>10}"
        print(line)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", action="append", default=[], metavar="NAME=PATH", help="a shim build to run under")
    ap.add_argument("--shapes", default="train,infer,small")
    ap.add_argument("--phases", default="u,f,u,w20,u,w30,u,w50,u,w70,u,f,u,w20,u,w30,u,w50,u,w70,u",
                    help="u: uncapped (the reference); f: capped, lent the whole GPU; wNN: windows of NN %% of 100 ms")
    ap.add_argument("--seconds", type=float, default=0.6, help="each f / w phase")
    ap.add_argument("--ref-seconds", type=float, default=0.3, help="each u phase")
    ap.add_argument("--settle", type=float, default=0.1, help="before each phase is timed")
    ap.add_argument("--plain", action="store_true", help="also a process with no shim (its u phases only)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--cpu", type=int, default=2, help="pin each tenant to this CPU (-1: no pinning)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    asyncio.run(main(args))
