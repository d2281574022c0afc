"""A capped container's pace inside its turn, through the agent, judged against itself (issue 25).

A host-bound program's pace is its process's host speed, which moves by up to 2x from one process to the next on the
H200 VM (RESULTS.md, "Where the training step's time goes through the agent, profiled"): a reference taken in another
process cannot judge a share at +-3 points. Here one tenant process is judged against its own pace, through the
agent's own Allocate answers and dispatcher:

  the tenant  an elastic container capped at CAP (one of --caps), running one of shares_gpu's program shapes
              (--shapes) for the whole run;
  the switch  a strict container capped at 100 - CAP on the same GPU, a process that launches a tiny kernel every
              5 ms while a file says so, else nothing: while it is active the tenant is on its windows (exactly
              CAP % of each period: the caps leave nothing spare), while it is idle the tenant is lent the whole GPU.

Phases, alternating (--rounds, default 2: lent, windows, lent, windows, lent): each waits until the tenant's region
shows the state (lent or not), settles (--settle), then is timed (--seconds). Each windows phase is judged against
the mean of the lent phases just before and after it:
  share        the tenant's throughput in the windows phase / lent x 100; goal: within +-3 points of CAP (matmul
               shapes may exceed it: the GPU's clocks at a duty, the issue's stated exception; never below CAP - 3);
  pace         share / CAP: the program's pace inside its windows, % of its own pace lent the GPU; goal >= 97 %;
  spread       the change between the two lent phases around it (relative); over REF_TOL the row judges nothing and
               counts as failed (UNSTABLE).
A lent phase itself is a container alone on the GPU, elastic: the same program on the whole GPU, through the shim.

  python3 bench/turn_pace.py --pin --shim /tmp/shim/libalnair.so --json $OUT/turn_pace.json
Prints one row per shape and cap (figure, goal, pass/fail) and writes everything to --json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import shim_trace
from benchstats import machine, write_json
from cpus import APPLY as APPLY_CPUS
from cpus import CpuPlan
from shares_gpu import SHAPES, Progress, Tenants, say

from alnair_standins.workloads import Node, run_py

CAPS = (20, 30, 50, 70)
CAP_TOL = 3.0  # points
PACE_MIN = 97.0  # % of its own pace lent the GPU
REF_TOL = 0.03  # the lent phases around a windows phase may differ by this much (relative) for it to be judged
STATE_WAIT_S = 3.0  # a phase whose state (lent or not) does not show in this long: recorded as such

SWITCH = """
import os, sys, time
""" + APPLY_CPUS + """
onfile, stopfile, ready = sys.argv[1:4]
import torch
torch.cuda._sleep(10)
torch.cuda.synchronize()
with open(ready, "w") as f:
    f.write("1")
n = 0
while not os.path.exists(stopfile):
    if os.path.exists(onfile):
        torch.cuda._sleep(100)  # a few us of GPU: active, and nothing taken from the tenant's windows
        torch.cuda.synchronize()
        n += 1
    time.sleep(0.005)
import json
print(json.dumps({"kernels": n}))
"""


@dataclass(frozen=True)
class Phase:
    kind: str  # "lent" or "windows"
    t0: float  # wall s
    t1: float
    shown: bool  # the tenant's region showed the phase's state before it was timed
    m0: int = 0  # the same span, CLOCK_MONOTONIC ns (the shim's clock: its trace's times)
    m1: int = 0


def judge(cap: int, phases: list[Phase], rate: Any) -> list[dict[str, Any]]:
    """Each windows phase against the lent phases around it; `rate(t0, t1)` is the tenant's units/s there."""
    out = []
    for i, p in enumerate(phases):
        if p.kind != "windows" or i == 0 or i + 1 >= len(phases):
            continue
        before, after = rate(phases[i - 1].t0, phases[i - 1].t1), rate(phases[i + 1].t0, phases[i + 1].t1)
        ref = (before + after) / 2
        share = 100 * rate(p.t0, p.t1) / ref if ref > 0 else 0.0
        spread = abs(after - before) / max(before, after) if max(before, after) > 0 else 1.0
        out.append({"share": round(share, 2), "pace": round(100 * share / cap, 1), "lent_rates": [before, after],
                    "spread": round(spread, 4), "shown": p.shown and phases[i - 1].shown and phases[i + 1].shown})
    return out


def verdict(cap: int, shape: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The shape's figure at a cap: the median windows phase; fails when any reference moved over REF_TOL."""
    if not rows:
        return {"result": "FAIL", "why": "no windows phase measured"}
    rows = sorted(rows, key=lambda r: r["share"])
    mid = rows[len(rows) // 2]
    unstable = any(r["spread"] > REF_TOL or not r["shown"] for r in rows)
    lo = cap - CAP_TOL
    hi = float("inf") if shape.startswith("mm") else cap + CAP_TOL  # the clock exception: never below
    ok = not unstable and lo <= mid["share"] <= hi and mid["pace"] >= PACE_MIN
    return {"share": mid["share"], "pace": mid["pace"], "spread": max(r["spread"] for r in rows),
            "unstable": unstable, "result": "pass" if ok else "FAIL"}


def lent_now(region: Path) -> bool:
    from alnair_agent.node.region import Region

    r = Region.open(region)
    try:
        return r.read_agent_block().get("turn_free_until_ns", 0) > time.monotonic_ns()
    finally:
        r.close()


async def one(shim: Path, shape: str, cap: int, a: argparse.Namespace, cpus: CpuPlan | None) -> dict[str, Any]:
    n_phases = 2 * a.rounds + 1
    loop_s = n_phases * (a.settle + a.seconds + 0.6) + 3.0
    trace_dir: Path | None = a.trace_dir
    async with Node(shim, "elastic") as node, Tenants(cpus, trace_dir) as ts:
        env = await node.admit(cap, 12)
        switch_env = await node.admit(100 - cap, 4, policy="strict")
        if cpus is not None:
            switch_env = cpus.env(switch_env)
        if trace_dir is not None:
            switch_env = {**switch_env, "ALNAIR_TRACE_FILE": str(trace_dir / f"switch-{shape}-{cap}.trace")}
        on, stop, ready = (ts.folder / f"switch.{w}" for w in ("on", "stop", "ready"))
        switch = asyncio.create_task(run_py(SWITCH, switch_env, str(on), str(stop), str(ready)))
        t = ts.start(f"{shape}-{cap}", shape, env, loop_s)
        await ts.ready()
        while not ready.exists():
            if switch.done():
                await switch
            await asyncio.sleep(0.05)
        region = Path(env["ALNAIR_REGION"])
        ts.release(t)
        phases: list[Phase] = []
        for k in range(n_phases):
            kind = "lent" if k % 2 == 0 else "windows"
            if kind == "windows":
                on.write_text("1")
            else:
                on.unlink(missing_ok=True)
            deadline, shown = time.monotonic() + STATE_WAIT_S, False
            while time.monotonic() < deadline:
                if lent_now(region) == (kind == "lent"):
                    shown = True
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(a.settle)
            t0, m0 = time.time(), time.monotonic_ns()
            await asyncio.sleep(a.seconds)
            phases.append(Phase(kind, t0, time.time(), shown, m0, time.monotonic_ns()))
        on.unlink(missing_ok=True)
        stop.write_text("1")
        out = await t.task
        await switch
    p = Progress(out["marks"])
    rows = judge(cap, phases, p.rate)
    traces: list[dict[str, Any]] = []
    if trace_dir is not None:  # where each phase's time went in the shim (a trace build)
        recs = {who: shim_trace.read(trace_dir / f"{name}.trace")
                for who, name in (("tenant", f"{shape}-{cap}"), ("switch", f"switch-{shape}-{cap}"))}
        traces = [{who: shim_trace.summarise(r, x.m0, x.m1) for who, r in recs.items() if r} for x in phases]
        for x, tr in zip(phases, traces, strict=True):
            if "tenant" in tr:
                say(f"  {shape} cap {cap} {x.kind:7}: {json.dumps(tr['tenant'])}")
    return {"shape": shape, "cap": cap, "phases": [vars(x) for x in phases], "rows": rows, "traces": traces,
            "lent_rates": [round(p.rate(x.t0, x.t1), 2) for x in phases if x.kind == "lent"],
            "verdict": verdict(cap, shape, rows)}


async def run(a: argparse.Namespace) -> dict[str, Any]:
    cpus = CpuPlan.make() if a.pin else None
    if cpus is not None:
        cpus.pin_self()
    record: dict[str, Any] = {"machine": machine(), "args": {k: str(v) for k, v in vars(a).items()}, "runs": []}
    for shape in a.shapes.split(","):
        for cap in (int(c) for c in a.caps.split(",")):
            try:
                r = await one(a.shim, shape, cap, a, cpus)
            except Exception as e:  # noqa: BLE001 - a benchmark: record it, go on with the next
                r = {"shape": shape, "cap": cap, "error": repr(e)[-2000:]}
            record["runs"].append(r)
            v = r.get("verdict", {})
            say(f"{shape:8} cap {cap:3}: " + (r["error"][:300] if "error" in r else
                f"share {v.get('share')} % (goal {cap} +-{CAP_TOL:g}), pace in windows {v.get('pace')} % (goal >= "
                f"{PACE_MIN:g}), lent rates {r['lent_rates']} (spread <= {100 * REF_TOL:g} %: "
                f"{'UNSTABLE' if v.get('unstable') else 'held'}) -> {v.get('result')}"))
            if a.json:
                write_json(a.json, record)
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shim", type=Path, default=Path("/tmp/shim/libalnair.so"))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--caps", default=",".join(map(str, CAPS)))
    ap.add_argument("--rounds", type=int, default=2, help="windows phases per cap (each between two lent phases)")
    ap.add_argument("--seconds", type=float, default=0.8, help="each phase, timed")
    ap.add_argument("--settle", type=float, default=0.3, help="each phase, after its state shows, before it is timed")
    ap.add_argument("--pin", action="store_true", help="a CPU of its own for each process (bench/cpus.py)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--trace-dir", type=Path, help="with a shim built -DALNAIR_TRACE: each process's trace there, "
                    "and each phase's summary (bench/shim_trace.py) in the JSON")
    a = ap.parse_args()
    if a.trace_dir is not None:
        a.trace_dir.mkdir(parents=True, exist_ok=True)
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    rec = asyncio.run(run(a))
    fails = [r for r in rec["runs"] if "error" in r]
    print(json.dumps({"runs": len(rec["runs"]), "errors": len(fails),
                      "passed": sum(r.get("verdict", {}).get("result") == "pass" for r in rec["runs"])}))
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
