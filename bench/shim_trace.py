"""The trace build's records (make -C shim CFLAGS='-O2 -DALNAIR_TRACE'), summed over a span of time.

A trace build writes, at process exit, one line per record to $ALNAIR_TRACE_FILE: `kind t a b c d` (t: the shim's
CLOCK_MONOTONIC ns; shim/*.c's TRACE calls say what a..d are), and the probes' counts and ns to `<file>.sum`.
`summarise` answers, for a span (a benchmark's phase), where a capped launch path spent or lost time:

  windows   'W': a waiting thread went on in its window: how late after the window's start (us), and how much of
            the window was left then (ms; a window whose start the debt moved has less left)
  refused   'g': the gate refused a launch on its estimate (backlog, left, cost)
  drains    'd': the gate measured the queue: count, ms waited
  trueups   'f': a fence interval's GPU time against what was charged: count, ms the GPU ran over the charge (owed:
            skipped from the next windows' starts), ms under it (credited)
  inflight  'i': waits on the in-flight bound: count, ms
  samples   's': samples read; 'w': waits for the sample in flight: count, ms
  holds     'h': held back for a latency container: count, ms

`excess_by_phase` answers where in its windows a tenant's true-ups ran over their charge (a window's start is
a 'W' record's t - a; a true-up belongs to the last start before it): excess owed at a window's head is work that
ran interleaved with the previous holder's tail, not the tenant's own overrun. 'H' records (a -DHEAD_GUARD_NS
build) are the excess such a build neither counted nor owed. From the command line, one table per trace file:

    python3 bench/shim_trace.py --bucket-ms 5 DIR/mm-newcomer.trace DIR/mm-lender.trace [--json out.json]
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from pathlib import Path
from typing import Any

HEAD_MS = 15.0  # a window's head: where the previous holder's tail runs interleaved (bench/RESULTS.md, 2026-12-06)


def read(path: Path) -> list[tuple[str, int, int, int, int, int]]:
    """A trace file's records, in time order; [] when there is none (not a trace build, or the process died)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        f = line.split()
        if len(f) == 6:
            out.append((f[0], int(f[1]), int(f[2]), int(f[3]), int(f[4]), int(f[5])))
    out.sort(key=lambda r: r[1])
    return out


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return round(xs[len(xs) // 2], 3) if xs else None


def summarise(recs: list[tuple[str, int, int, int, int, int]], t0_ns: int, t1_ns: int) -> dict[str, Any]:
    """What the records in [t0_ns, t1_ns) say (see the module docstring); times in ms unless named otherwise."""
    span = [r for r in recs if t0_ns <= r[1] < t1_ns]
    by: dict[str, list[tuple[str, int, int, int, int, int]]] = {}
    for r in span:
        by.setdefault(r[0], []).append(r)
    w, f = by.get("W", []), by.get("f", [])
    over = sum(r[2] - r[3] for r in f if r[2] > r[3])
    under = sum(r[3] - r[2] for r in f if r[3] > r[2])
    return {
        "span_ms": round((t1_ns - t0_ns) / 1e6, 1),
        "windows": {"n": len(w), "late_us_median": _median([r[2] / 1e3 for r in w]),
                    "left_ms_median": _median([r[3] / 1e6 for r in w])},
        "refused": len(by.get("g", [])),
        "drains": {"n": len(by.get("d", [])), "ms": round(sum(r[2] for r in by.get("d", [])) / 1e6, 3)},
        "trueups": {"n": len(f), "over_ms": round(over / 1e6, 3), "under_ms": round(under / 1e6, 3)},
        "inflight": {"n": len(by.get("i", [])), "ms": round(sum(r[2] for r in by.get("i", [])) / 1e6, 3)},
        "samples": len(by.get("s", [])),
        "sample_waits": {"n": len(by.get("w", [])), "ms": round(sum(r[2] for r in by.get("w", [])) / 1e6, 3)},
        "holds": {"n": len(by.get("h", [])), "ms": round(sum(r[2] for r in by.get("h", [])) / 1e6, 3)},
    }


def excess_by_phase(recs: list[tuple[str, int, int, int, int, int]], bucket_ms: float = 5.0,
                    past_ms: float = 100.0) -> dict[str, Any]:
    """The true-ups' excess (ms over their charge) and count by phase since the window's start, in buckets of
    `bucket_ms`; a true-up more than `past_ms` after its window's start (a lease, no windows) is in bucket "lease".
    "head_ms": the excess in the first HEAD_MS of windows; "guarded_ms": what a HEAD_GUARD_NS build left unowed."""
    starts = sorted({r[1] - r[2] for r in recs if r[0] == "W"})
    buckets: dict[str, list[float]] = {}
    total = head = 0.0
    for k, t, a, b, *_ in recs:
        if k != "f":
            continue
        i = bisect.bisect_right(starts, t) - 1
        if i < 0:
            continue
        phase = (t - starts[i]) / 1e6
        key = "lease" if phase >= past_ms else f"{int(phase // bucket_ms) * bucket_ms:g}"
        over = (a - b) / 1e6
        cell = buckets.setdefault(key, [0.0, 0])
        cell[0] += over
        cell[1] += 1
        total += over
        head += over if phase < HEAD_MS else 0.0
    guarded = sum(r[2] for r in recs if r[0] == "H") / 1e6
    return {"windows": len(starts), "total_ms": round(total, 3), "head_ms": round(head, 3),
            "guarded_ms": round(guarded, 3),
            "buckets": {k: {"excess_ms": round(v[0], 3), "n": int(v[1])} for k, v in buckets.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="where in their windows the true-ups of trace files ran over")
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--bucket-ms", type=float, default=5.0)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    if a.bucket_ms <= 0:
        ap.error("--bucket-ms must be above 0")
    out = {}
    for path in a.traces:
        recs = read(path)
        if not recs:
            print(f"{path}: no records (not a trace build, or the process died)")
            continue
        r = out[str(path)] = excess_by_phase(recs, a.bucket_ms)
        print(f"{path}: {r['windows']} windows; true-ups over their charge {r['total_ms']:.1f} ms, "
              f"{r['head_ms']:.1f} ms of it in windows' first {HEAD_MS:g} ms; left unowed by the head guard {r['guarded_ms']:.1f} ms")
        order = sorted((k for k in r["buckets"] if k != "lease"), key=float) + (["lease"] if "lease" in r["buckets"] else [])
        print("  phase ms  excess ms      n")
        for k in order:
            c = r["buckets"][k]
            print(f"  {k:>8}  {c['excess_ms']:9.1f}  {c['n']:5d}")
    if a.json is not None:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
