"""Percentiles for the benchmarks (one definition: nearest rank on the sorted sample)."""

from __future__ import annotations


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values`, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]
