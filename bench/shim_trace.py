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
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


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
