"""The GPU's clocks, performance state and power, sampled in the background while a benchmark runs (a diagnostic).

A host-bound program capped on turns runs slower inside its windows than alone (issue 25's small-kernel loop at
cap 30: 22 % of its pace alone against 30 +- 3 on an H100), with the shim holding it nowhere (the trace build).
Whether the GPU idles down between windows, and comes back slower, is what this samples: every --every-ms, NVML's
SM and memory clocks, performance state, power and device utilization, with CLOCK_MONOTONIC (the shim's and
bench/turn_trace.py's clock) and wall time, one JSON object per line, until SIGTERM/SIGINT or --seconds.

    python3 bench/nvml_clocks.py --out clocks.jsonl [--every-ms 5] [--seconds 600] &
    ...; kill %1
    python3 bench/nvml_clocks.py --summarise clocks.jsonl --span NAME:T0_NS:T1_NS ...  (mean clocks inside each span)
    python3 bench/nvml_clocks.py --fold clocks.jsonl --turns tt.json   (each bench/turn_trace.py run's loop: its mean
        clocks, and for a capped run the SM clock by phase of its period, in and out of its window)
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import time
from pathlib import Path
from typing import Any


def sample(out: Path, every_ms: float, seconds: float, index: int) -> int:
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(index)
    stop = False

    def _stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    n, end = 0, time.monotonic() + seconds
    with out.open("w") as f:
        while not stop and time.monotonic() < end:
            t = time.monotonic_ns()
            rec: dict[str, Any] = {"mono_ns": t, "wall": time.time()}
            try:
                rec["sm_mhz"] = pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)
                rec["mem_mhz"] = pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM)
                rec["pstate"] = pynvml.nvmlDeviceGetPerformanceState(h)
                rec["power_w"] = pynvml.nvmlDeviceGetPowerUsage(h) / 1000
                rec["util"] = pynvml.nvmlDeviceGetUtilizationRates(h).gpu
            except pynvml.NVMLError as e:
                rec["error"] = str(e)
            f.write(json.dumps(rec) + "\n")
            n += 1
            time.sleep(max(0.0, every_ms / 1000 - (time.monotonic_ns() - t) / 1e9))
    pynvml.nvmlShutdown()
    return n


def span_stats(recs: list[dict[str, Any]], t0: int, t1: int) -> dict[str, Any]:
    """The samples in [t0_ns, t1_ns) of CLOCK_MONOTONIC: their count, mean / min / max SM clock, pstates, power."""
    rs = [r for r in recs if t0 <= r["mono_ns"] < t1]
    if not rs:
        return {"samples": 0}
    sm = [r["sm_mhz"] for r in rs]
    return {"samples": len(rs), "sm_mhz_mean": round(statistics.fmean(sm), 1), "sm_mhz_min": min(sm),
            "sm_mhz_max": max(sm), "pstates": sorted({r["pstate"] for r in rs}),
            "power_w_mean": round(statistics.fmean(r["power_w"] for r in rs), 1)}


def summarise(path: Path, spans: list[tuple[str, int, int]]) -> list[dict[str, Any]]:
    """Per (name, t0_ns, t1_ns) span: `span_stats`."""
    recs = read(path)
    return [{"span": name, **span_stats(recs, t0, t1)} for name, t0, t1 in spans]


def read(path: Path) -> list[dict[str, Any]]:
    """The samples that read everything (one whose NVML call failed part-way, or a line cut short by the sampler's
    end, is skipped)."""
    out = []
    for ln in path.read_text().splitlines():
        try:
            r = json.loads(ln)
        except json.JSONDecodeError:
            continue
        if isinstance(r, dict) and all(k in r for k in ("mono_ns", "sm_mhz", "pstate", "power_w")):
            out.append(r)
    return out


def fold(recs: list[dict[str, Any]], run: dict[str, Any], bins: int = 10) -> dict[str, Any]:
    """One turn_trace tenant's loop (its raw output: t_start, t_end, epoch, offset, period, length) against the clock
    samples taken during it: the mean SM clock over the loop, and for a capped loop (a window shorter than the
    period) the mean by phase of the period in `bins` bins, and over the window's first and last fifths: a GPU that
    idles down between windows shows a lower clock at the window's head than at its tail."""
    t0, t1 = run.get("t_start"), run.get("t_end")
    if t0 is None or t1 is None:
        return {"error": "no t_start/t_end in the run (a turn_trace from before the seventeenth session)"}
    res = span_stats(recs, t0, t1)
    period, length = int(run["period"]), int(run["length"])
    if not res["samples"] or length >= period or period <= 0:
        return res
    rs = [r for r in recs if t0 <= r["mono_ns"] < t1]
    base = int(run["epoch"]) + int(run["offset"])
    by: list[list[float]] = [[] for _ in range(bins)]
    head: list[float] = []
    tail: list[float] = []
    for r in rs:
        ph = (r["mono_ns"] - base) % period
        by[min(bins - 1, ph * bins // period)].append(r["sm_mhz"])
        if ph < length // 5:
            head.append(r["sm_mhz"])
        elif length - length // 5 <= ph < length:
            tail.append(r["sm_mhz"])
    res["window_ms"] = length / 1e6
    res["sm_mhz_by_phase"] = [round(statistics.fmean(b), 1) if b else None for b in by]
    res["in_window_bins"] = [i * period // bins < length for i in range(bins)]
    res["window_head_mhz"] = round(statistics.fmean(head), 1) if head else None
    res["window_tail_mhz"] = round(statistics.fmean(tail), 1) if tail else None
    return res


def fold_runs(clocks: Path, turns: Path) -> list[dict[str, Any]]:
    """`fold` for every tenant of every run in a turn_trace JSON."""
    recs = read(clocks)
    out = []
    doc = json.loads(turns.read_text())
    # turn_trace's --json goes through benchstats.write_json, which wraps it: {"machine": ..., "results": {...}}
    doc = doc.get("results", doc)
    for run in doc.get("runs", []):
        for cap, raw in zip(run.get("caps", []), run.get("raw", []), strict=False):
            out.append({"shape": run.get("shape"), "cap": cap, **fold(recs, raw)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--every-ms", type=float, default=5.0)
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--summarise", type=Path, help="a file this wrote: summarise it")
    ap.add_argument("--span", action="append", default=[], metavar="NAME:T0_NS:T1_NS")
    ap.add_argument("--fold", type=Path, help="a file this wrote: fold it by the turns of --turns")
    ap.add_argument("--turns", type=Path, help="bench/turn_trace.py's --json of the same run")
    a = ap.parse_args()
    if a.fold:
        if a.turns is None:
            ap.error("--fold needs --turns")
        for row in fold_runs(a.fold, a.turns):
            print(json.dumps(row))
        return
    if a.summarise:
        spans = [(s.split(":")[0], int(s.split(":")[1]), int(s.split(":")[2])) for s in a.span]
        print(json.dumps(summarise(a.summarise, spans), indent=1))
        return
    if a.out is None:
        ap.error("--out or --summarise")
    n = sample(a.out, a.every_ms, a.seconds, a.index)
    print(f"nvml_clocks: {n} samples to {a.out}")


if __name__ == "__main__":
    main()
