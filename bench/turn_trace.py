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
import bisect
import gzip
import json
import os
import time
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
epoch, offset = ag.get("turn_epoch_ns", 0), ag.get("turn_offset_ns", 0)
length = ag.get("turn_length_ns") or period  # no window (no compute cap, no region): always its turn
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
profile = None
prof_path = os.environ.get("TT_PROFILE")
if prof_path:
    # A second loop under torch.profiler (CUDA activity: every kernel's GPU start and end, the runtime calls), its
    # clock tied to CLOCK_MONOTONIC by a marker kernel launched on an idle GPU at a known time, before and after.
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile
    pmarks, psteps = [], []

    def marker():
        torch.cuda.synchronize()
        pmarks.append(time.monotonic_ns())
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()

    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
        marker()
        pend = time.monotonic_ns() + int(float(os.environ.get("TT_PROFILE_S", "1")) * 1e9)
        while True:
            step()
            t = time.monotonic_ns()
            psteps.append(t)
            if t >= pend:
                break
        marker()
    prof.export_chrome_trace(prof_path)
    profile = {"path": prof_path, "marks": pmarks, "steps": psteps}
print(json.dumps({"steps": len(ts), "loop_ns": loop_ns, "t_start": t_start, "t_end": ts[-1], "period": period,
                  "offset": offset, "length": length,
                  "epoch": epoch, "spare": ag.get("turn_spare_ns", 0), "ts": ts if prof_path else None,
                  "buckets": buckets, "top_gaps": gaps[:12], "before": before, "after": after, "profile": profile,
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


GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _union(iv: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _overlap(iv: list[tuple[int, int]], lo: int, hi: int) -> int:
    i = bisect.bisect_left(iv, (lo, lo)) - 1
    total = 0
    for a, b in iv[max(i, 0):]:
        if a >= hi:
            break
        total += max(0, min(b, hi) - max(a, lo))
    return total


def profile_summary(o: dict, events: list[dict]) -> dict[str, Any]:
    """Where the GPU was busy in the profiled loop (--profile), window by window: the GPU's busy part of each window
    (the union of its kernels and copies there), what ran past the window, how late the first kernel began after
    the window's start and how early the last one ended before its end, and the runtime calls that held the host
    inside windows (a gate wait is a long cuLaunchKernel, a loss.item() a long sync or copy)."""
    prof = o["profile"]
    gpu = [(int(e["ts"] * 1000), int((e["ts"] + e.get("dur", 0)) * 1000), e.get("name", "")) for e in events
           if e.get("ph") == "X" and e.get("cat") in GPU_CATS]
    # the marker's launch call (not its kernel, which the gate may hold until the window) began at its mark
    spin_corr = sorted((e["ts"], e.get("args", {}).get("correlation")) for e in events
                       if e.get("cat") == "kernel" and "spin" in e.get("name", ""))
    calls = {e["args"]["correlation"]: e["ts"] for e in events
             if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    starts = [int(calls[c] * 1000) for _, c in spin_corr if c in calls]
    if len(starts) < 2 or len(prof["marks"]) < 2:
        return {"error": f"{len(starts)} marker launches found"}
    offs = [m - s for m, s in zip(prof["marks"], (starts[0], starts[-1]), strict=False)]
    off = offs[0]
    busy = _union([(a + off, b + off) for a, b, n in gpu if "spin" not in n])
    t0, t1 = prof["marks"][0] + 1_000_000, prof["steps"][-1]
    period, offset, length = o["period"], o["offset"], o["length"]
    res: dict[str, Any] = {"clock_skew_us": round(abs(offs[0] - offs[1]) / 1e3, 1), "span_ms": round((t1 - t0) / 1e6, 1),
                           "busy_pct": round(100 * _overlap(busy, t0, t1) / max(1, t1 - t0), 1),
                           "steps_per_s": round(len(prof["steps"]) / max(1e-9, (t1 - prof["marks"][0]) / 1e9), 1)}
    epoch = o["epoch"]
    for name in ("cudaLaunchKernel", "cudaStreamIsCapturing"):
        ds = sorted(e["dur"] for e in events if e.get("cat") == "cuda_runtime" and e.get("name") == name
                    and e.get("dur", 0) < 50 and t0 <= int(e["ts"] * 1000) + off < t1)
        if ds:
            res[f"{name}_us"] = round(ds[len(ds) // 2], 2)
    if length >= period:
        return res
    k0 = (t0 - epoch - offset) // period + 1
    rows = []
    for k in range(k0, 10**9):
        ws = epoch + k * period + offset
        we = ws + length
        if we > t1:
            break
        inside = _overlap(busy, ws, we)
        after = _overlap(busy, we, we + (period - length))
        first = next((a for a, b in busy if b > ws), None)
        last = max((min(b, we) for a, b in busy if a < we and b > ws), default=None)
        rows.append((inside, after, (first - ws) if first is not None and first < we else length,
                     (we - last) if last is not None else length))
    if not rows:
        return res
    n = len(rows)
    res.update({"windows": n, "in_window_busy_pct": round(100 * sum(r[0] for r in rows) / (n * length), 1),
                "past_window_ms": round(sum(r[1] for r in rows) / n / 1e6, 3),
                "first_kernel_late_ms": round(sorted(r[2] for r in rows)[n // 2] / 1e6, 3),
                "last_kernel_early_ms": round(sorted(r[3] for r in rows)[n // 2] / 1e6, 3)})
    # the host's time in runtime calls inside windows (each call clipped to its window): a gate wait is a long
    # cudaLaunchKernel, a loss.item() a long cudaStreamSynchronize; ms per window
    held: dict[str, float] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("cuda_runtime", "cuda_driver"):
            continue
        a = int(e["ts"] * 1000) + off
        b = a + int(e.get("dur", 0) * 1000)
        ws = epoch + (a - epoch - offset) // period * period + offset
        if t0 <= a < t1 and a < ws + length:
            clip = min(b, ws + length) - a
            name = e["name"] + (" >= 50 us" if clip >= 50_000 else "")
            held[name] = held.get(name, 0.0) + clip / 1e6
    res["runtime_ms_per_window"] = {k: round(v / n, 3) for k, v in sorted(held.items(), key=lambda kv: -kv[1])[:6]}
    # steps completed per window, and the host's gaps between steps there
    ends = prof["steps"]
    res["steps_per_window"] = round(sum(1 for t in ends if t0 <= t < t1 and (t - epoch - offset) % period < length)
                                    / n, 2)
    return res


async def one(shim: Path, shape: str, caps: list[int], seconds: float, settings: dict, folder: Path,
              trace_dir: Path | None = None, cpus: CpuPlan | None = None, idle: int = 0,
              profile_s: float = 0.0, skip: int = 0) -> list[dict]:
    """Tenants at `caps` together on one node (one cap: alone; 0 = no shim, no node); `idle` more containers at the
    first cap admitted on the node and never started (strict: their windows stay theirs, so the tenant's window is
    followed by another's, as on a shared node); `profile_s`: a profiled loop after the timed one."""
    envs: list[dict[str, str]]
    if caps == [0]:
        envs, node = [plain_env(0)], None
    else:
        node = Node(shim, "strict", "on", **settings)
        await node.__aenter__()
        envs = [await node.admit(max(c, 0), 12) for c in caps]  # -1: the shim and a region, no compute cap
        for _ in range(idle):
            await node.admit(max(caps[0], 0), 12)
    try:
        names = [folder / f"{shape}-{'-'.join(map(str, caps))}-{i}" for i in range(len(caps))]
        go = folder / f"go-{shape}-{'-'.join(map(str, caps))}"
        if cpus is not None:
            cpus.reset(skip)
            envs = [cpus.env(e) for e in envs]
        if trace_dir is not None:
            envs = [{**e, "ALNAIR_TRACE_FILE": str(trace_dir / f"{n.name}.trace")} for e, n in zip(envs, names, strict=False)]
        if profile_s > 0:
            envs = [{**e, "TT_PROFILE": f"{n}-{idle}.prof.json", "TT_PROFILE_S": str(profile_s)}
                    for e, n in zip(envs, names, strict=False)]
        tasks = [asyncio.create_task(run_py(code(shape), e, f"{seconds}", str(go), str(n) + ".ready"))
                 for e, n in zip(envs, names, strict=False)]
        while not all(Path(str(n) + ".ready").exists() for n in names):
            if any(t.done() for t in tasks):
                break
            await asyncio.sleep(0.05)
        go.write_text("go")
        c0, w0 = os.times(), time.monotonic()
        outs = list(await asyncio.gather(*tasks))
        c1, w1 = os.times(), time.monotonic()
        for o in outs:
            o["bench_cpu_pct"] = round(100 * (c1.user + c1.system - c0.user - c0.system) / max(1e-9, w1 - w0), 1)
        for o in outs:
            if o.get("profile"):
                path = Path(o["profile"]["path"])
                events = json.loads(path.read_text()).get("traceEvents", [])
                o["profile_summary"] = profile_summary(o, events)
                keep = (trace_dir or folder) / (path.name + ".gz")
                keep.write_bytes(gzip.compress(path.read_bytes(), 6))
                path.unlink()
                o["profile"]["path"] = str(keep)
        return outs
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
        groups = ([[int(c)] for c in a.caps.split(",")] + ([[int(c) for c in a.pair.split(",")]] if a.pair else [])) \
            * a.repeat
        for caps in groups:
            try:
                outs = await one(a.shim, shape, caps, a.seconds, dict(a.setting), folder, a.trace_dir, cpus,
                                 idle=a.idle if caps[0] > 0 else 0, profile_s=a.profile, skip=a.cpu_skip)
            except Exception as e:  # noqa: BLE001 - a diagnostic: record it, go on
                print(f"{shape} {caps}: error {e!r}"[:400], flush=True)
                out["runs"].append({"shape": shape, "caps": caps, "error": repr(e)[-2000:]})
                continue
            sums = [summarise(o, ref) for o in outs]
            if caps == [0]:
                ref = sums[0]
            for s_, o in zip(sums, outs, strict=False):
                s_["bench_cpu_pct"] = o.get("bench_cpu_pct")
            for c, s, o in zip(caps, sums, outs, strict=False):
                if "profile_summary" in o:
                    s["profile"] = o["profile_summary"]
                print(f"{shape:8} cap {c:3} of {caps}{f' +{a.idle} idle' if a.idle and c > 0 else ''}: "
                      f"{json.dumps(s)}", flush=True)
            out["runs"].append({"shape": shape, "caps": caps, "summary": sums,
                                "idle": a.idle if caps[0] > 0 else 0,
                                "raw": [{k: v for k, v in o.items() if k not in ("top_gaps", "ts")} for o in outs]})
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
    ap.add_argument("--cpu-skip", type=int, default=0, help="--pin: start the tenants this many CPUs further on")
    ap.add_argument("--repeat", type=int, default=1, help="run the list of caps this many times, one after another")
    ap.add_argument("--idle", type=int, default=0,
                    help="this many idle strict containers at the same cap beside each capped run (their windows follow)")
    ap.add_argument("--profile", type=float, default=0.0,
                    help="then this many seconds under torch.profiler: the GPU's busy part of each window, and why")
    a = ap.parse_args()
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    res = asyncio.run(run(a))
    if a.json:
        write_json(a.json, res)


if __name__ == "__main__":
    main()
