"""Where a capped tenant's time goes inside its turns (H200 diagnostic for issue 18's shares).

Each run: one tenant of a shape (bench/shares_gpu.py's SHAPES) alone on a fresh node at a cap (0: no shim, the
reference), its loop timed on the host after every step (CLOCK_MONOTONIC, the shim's clock). From the region (its
turn and its slots' counters, read before and after the loop) it reports:
  rate        steps/s over the loop, and % of the reference's rate;
  in-window   steps/s while the clock is in the window (by 1 ms phase buckets of the period), % of the reference;
  wait        the slots' wait_ns growth / loop time; overrun_ns growth; gpu_ns growth / loop time (% of the GPU);
  phase       steps completed per 1 ms bucket of the period (the JSON), to see where in a window work stops.

    python3 bench/turn_trace.py --shim /tmp/shim/libalnair.so --shapes small,train --caps 0,30,70 --json t.json
        [--setting turn_period_s=0.1] [--pair 30,70]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from benchstats import machine, write_json
from cpus import CpuPlan
from shares_gpu import SHAPES, TENANT_HEAD, parse_setting

from alnair_standins.workloads import Node, plain_env, run_py

TAIL = """
import os
from pathlib import Path
def region_state():
    path = os.environ.get("ALNAIR_REGION")
    if not path:
        return None
    from alnair_agent.node.region import Region
    r = Region.open(Path(path))
    try:
        slots = r.slots()
        keys = ("launches", "gpu_ns", "overrun_ns", "wait_ns")
        return {"agent": r.read_agent_block(), "slots": {k: sum(getattr(s, k) for s in slots) for k in keys}}
    finally:
        r.close()
for _ in range(20):
    step()
torch.cuda.synchronize()
with open(ready + ".tmp", "w") as f:
    f.write("1")
os.rename(ready + ".tmp", ready)
while not os.path.exists(barrier):
    time.sleep(0.0005)
before = region_state()
ts = []
t_start = time.monotonic_ns()
end = t_start + int(seconds * 1e9)
while True:
    step()
    t = time.monotonic_ns()
    ts.append(t)
    if t >= end:
        break
torch.cuda.synchronize()
after = region_state()
ag = (after or {}).get("agent") or {}
period = ag.get("turn_period_ns") or 50_000_000
epoch, offset, length = ag.get("turn_epoch_ns", 0), ag.get("turn_offset_ns", 0), ag.get("turn_length_ns", period)
buckets = [0] * max(1, period // 1_000_000)
gaps = []
prev = t_start
for t in ts:
    ph = (t - epoch - offset) % period
    buckets[min(len(buckets) - 1, ph // 1_000_000)] += 1
    gaps.append((t - prev, (prev - epoch - offset) % period))
    prev = t
gaps.sort(reverse=True)
loop_ns = ts[-1] - t_start
print(json.dumps({"steps": len(ts), "loop_ns": loop_ns, "period": period, "offset": offset, "length": length,
                  "buckets": buckets, "top_gaps": gaps[:12], "before": before, "after": after,
                  "median_step_ns": sorted(b - a for a, b in zip([t_start] + ts, ts))[len(ts) // 2]}), flush=True)
"""


def code(shape: str) -> str:
    return TENANT_HEAD + SHAPES[shape].body + TAIL


def summarise(o: dict, ref: dict | None) -> dict[str, Any]:
    loop_s = o["loop_ns"] / 1e9
    periods = loop_s / (o["period"] / 1e9)
    nb = len(o["buckets"])
    in_w = [o["buckets"][i] for i in range(nb) if i * 1_000_000 < o["length"]]
    rate = o["steps"] / loop_s
    res: dict[str, Any] = {"steps": o["steps"], "rate": round(rate, 1), "median_step_us": o["median_step_ns"] / 1e3,
                           "window_ms": o["length"] / 1e6, "period_ms": o["period"] / 1e6}
    if in_w and periods > 0:
        res["in_window_rate"] = round(sum(in_w) / (len(in_w) * 1e-3 * periods), 1)
    if ref:
        res["pct_of_ref"] = round(100 * rate / ref["rate"], 1)
        if "in_window_rate" in res:
            res["in_window_pct_of_ref"] = round(100 * res["in_window_rate"] / ref["rate"], 1)
    if o.get("before") and o.get("after"):
        d = {k: o["after"]["slots"][k] - o["before"]["slots"][k] for k in o["after"]["slots"]}
        res["slots"] = {"launches_per_step": round(d["launches"] / max(1, o["steps"]), 2),
                        "wait_pct": round(100 * d["wait_ns"] / o["loop_ns"], 1),
                        "gpu_pct": round(100 * d["gpu_ns"] / o["loop_ns"], 1),
                        "overrun_ms": round(d["overrun_ns"] / 1e6, 2)}
    res["top_gaps_ms_at_phase_ms"] = [[round(g / 1e6, 2), round(p / 1e6, 1)] for g, p in o["top_gaps"][:6]]
    return res


async def one(shim: Path, shape: str, caps: list[int], seconds: float, settings: dict, folder: Path,
              trace_dir: Path | None = None, cpus: CpuPlan | None = None) -> list[dict]:
    """Tenants at `caps` together on one node (one cap: alone; 0 = no shim, no node)."""
    envs: list[dict[str, str]]
    if caps == [0]:
        envs, node = [plain_env(0)], None
    else:
        node = Node(shim, "strict", "on", **settings)
        await node.__aenter__()
        envs = [await node.admit(max(c, 0), 12) for c in caps]  # -1: the shim and a region, no compute cap
    try:
        names = [folder / f"{shape}-{'-'.join(map(str, caps))}-{i}" for i in range(len(caps))]
        go = folder / f"go-{shape}-{'-'.join(map(str, caps))}"
        if cpus is not None:
            cpus.reset()
            envs = [cpus.env(e) for e in envs]
        if trace_dir is not None:
            envs = [{**e, "ALNAIR_TRACE_FILE": str(trace_dir / f"{n.name}.trace")} for e, n in zip(envs, names, strict=False)]
        tasks = [asyncio.create_task(run_py(code(shape), e, f"{seconds}", str(go), str(n) + ".ready"))
                 for e, n in zip(envs, names, strict=False)]
        while not all(Path(str(n) + ".ready").exists() for n in names):
            if any(t.done() for t in tasks):
                break
            await asyncio.sleep(0.05)
        go.write_text("go")
        return list(await asyncio.gather(*tasks))
    finally:
        if node is not None:
            await node.__aexit__(None, None, None)


async def run(a: argparse.Namespace) -> dict:
    cpus = CpuPlan.make() if a.pin else None
    if cpus is not None:
        cpus.pin_self()
        print(f"pinned: {cpus.describe()}", flush=True)
    out: dict[str, Any] = {"machine": machine(), "settings": dict(a.setting), "runs": [],
                           "cpus": cpus.describe() if cpus is not None else None}
    folder = Path("/tmp/aln-trace")
    folder.mkdir(exist_ok=True)
    for shape in a.shapes.split(","):
        ref = None
        groups = [[int(c)] for c in a.caps.split(",")] + ([[int(c) for c in a.pair.split(",")]] if a.pair else [])
        for caps in groups:
            try:
                outs = await one(a.shim, shape, caps, a.seconds, dict(a.setting), folder, a.trace_dir, cpus)
            except Exception as e:  # noqa: BLE001 - a diagnostic: record it, go on
                print(f"{shape} {caps}: error {e!r}"[:400], flush=True)
                out["runs"].append({"shape": shape, "caps": caps, "error": repr(e)[-2000:]})
                continue
            sums = [summarise(o, ref) for o in outs]
            if caps == [0]:
                ref = sums[0]
            for c, s in zip(caps, sums, strict=False):
                print(f"{shape:8} cap {c:3} of {caps}: {json.dumps(s)}", flush=True)
            out["runs"].append({"shape": shape, "caps": caps, "summary": sums,
                                "raw": [{k: v for k, v in o.items() if k != "top_gaps"} for o in outs]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shim", type=Path, default=Path("/tmp/shim/libalnair.so"))
    ap.add_argument("--shapes", default="small,train")
    ap.add_argument("--caps", default="0,30,70", help="each alone; 0: no shim (the reference; put it first); -1: shim, uncapped")
    ap.add_argument("--pair", default="", help="caps of tenants run together on one node, e.g. 30,70")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--setting", type=parse_setting, action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--pin", action="store_true", help="a CPU of its own for each tenant (bench/cpus.py)")
    ap.add_argument("--trace-dir", type=Path, help="with a shim built -DALNAIR_TRACE: each tenant's trace goes here")
    a = ap.parse_args()
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    res = asyncio.run(run(a))
    if a.json:
        write_json(a.json, res)


if __name__ == "__main__":
    main()
