"""What every benchmark shares: percentiles (one definition: nearest rank on the sorted sample) and the record of
the machine a run was measured on, written beside the results."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values`, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def machine() -> dict[str, Any]:
    """The machine a run was measured on: platform, Python, CPU count and model."""
    try:
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), "?")
    except OSError:
        cpu = "?"
    return {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(), "cpu": cpu}


def write_json(path: str | Path, results: Any) -> None:
    """`{"machine": ..., "results": results}` to `path` (its folder made if need be)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "results": results}, indent=2))
