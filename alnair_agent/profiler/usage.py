"""The `ai.centaurus.io/usage` pod annotation: its schema (declared once; the README's table is generated from it)
and one container's figures over its whole life.

The value is a JSON object keyed by container name; each entry holds the fields of `FIELDS`. Utilizations are
percent of the whole GPU, as NVML reports them; a container's GPU utilization is its own share (the sum of its
processes' NVML per-process SM utilization). Means are over the time its processes were on the GPU.

A container of several GPUs has one allocation, and one set of figures, per GPU: its entry holds `FIELDS` combined
over its GPUs by each field's rule (`Field.several`), plus `gpus`, the list of its GPUs' own entries in the order it
sees them. A one-GPU container's entry is exactly the fields, as it has always been (no `gpus`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from alnair_agent.constants import USAGE_ANNOTATION


@dataclass(frozen=True)
class Field:
    name: str
    unit: str
    meaning: str
    several: str = "sum"  # how a container of several GPUs combines its GPUs' figures: a key of COMBINE


def _numbers(values: list[Any]) -> list[float]:
    return [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]


def _sum(values: list[Any]) -> float | int:
    ints = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    if len(ints) == len(_numbers(values)):
        return sum(ints)  # bytes and percent limits stay integers
    return round(sum(_numbers(values)), 3)


def _time(values: list[Any], last: bool) -> str | None:
    """The earliest (or latest) of RFC 3339 times, as written; None when there is none."""
    times = sorted((t, v) for v in values if (t := _parse_time(v)) is not None)
    return (times[-1] if last else times[0])[1] if times else None


# The rules a container of several GPUs combines its GPUs' figures by: (the README's words, the function).
COMBINE: dict[str, tuple[str, Any]] = {
    "list": ("its GPUs' values, comma-separated, in `gpus` order",
             lambda vs: ",".join(str(v) for v in vs)),
    "state": ("`ended` once every GPU's is", lambda vs: "ended" if vs and all(v == "ended" for v in vs) else "running"),
    "sum": ("the sum over its GPUs", _sum),
    "max": ("the largest of its GPUs'", lambda vs: max(_numbers(vs), default=0.0)),
    "earliest": ("the earliest of its GPUs'", lambda vs: _time(vs, last=False)),
    "latest": ("the latest of its GPUs' (null: none yet)", lambda vs: _time(vs, last=True)),
}


FIELDS: tuple[Field, ...] = (
    Field("gpu", "UUID", "The GPU the container was given.", "list"),
    Field("allocation", "id", "The agent's allocation id (its workspace folder).", "list"),
    Field("state", "text", "`running`, or `ended` once the container has ended (final write).", "state"),
    Field("memory_limit_bytes", "bytes", "GPU memory limit the shim enforced (0: none)."),
    Field("compute_limit_percent", "%", "Compute cap the shim enforced (0: none)."),
    Field("gpu_util_mean", "% of the GPU", "Mean of the container's own GPU utilization while its processes "
          "were on the GPU. A compute-capped container: the GPU time its kernels ran in its turns, as the shim timed "
          "them, scaled down where the capped containers of its GPU together claim more than NVML's device "
          "utilization; any other: NVML's per-process SM utilization, or under MPS (NVML books every client's work "
          "to the server) what the server ran beyond the capped containers' figures, split among the GPU's "
          "uncapped containers by the launches their shims counted."),
    Field("gpu_util_max", "% of the GPU", "Highest sampled GPU utilization of the container."),
    Field("memcpy_util_mean", "% of the GPU", "Mean memory-copy utilization of the container while its processes "
          "were on the GPU: their kernels' memory traffic (NVML per process; a compute-capped container: its part, by "
          "the GPU time its shim counted, of what NVML gave the capped containers' processes, since on a "
          "time-sliced GPU NVML's per-process figure is a draw) plus its share, by bytes copied, of the GPU's "
          "copy-engine time that no process's kernels explain."),
    Field("memcpy_util_max", "% of the GPU", "Highest sampled memory-copy utilization."),
    Field("memory_max_bytes", "bytes", "Most GPU memory its processes held at once (NVML, else the shim's count)."),
    Field("gpu_seconds", "s", "GPU time: the integral of its GPU utilization over time (1 s at 100 % = 1)."),
    Field("throttled_seconds", "s", "Time its processes waited for their turn on the GPU (held back by its cap)."),
    Field("observed_seconds", "s", "Time its processes were seen on the GPU (the means are over this).", "max"),
    Field("first_seen", "RFC 3339", "When the agent admitted the container.", "earliest"),
    Field("last_seen", "RFC 3339", "Last sample that saw one of its processes on the GPU (null: none yet).", "latest"),
)
FIELD_NAMES = tuple(f.name for f in FIELDS)
assert all(f.several in COMBINE for f in FIELDS)
# A container of several GPUs only: its GPUs' own entries (each with FIELDS), in the order it sees them.
GPUS_FIELD = Field("gpus", "list", "Several GPUs only: one entry per GPU, in the order the container sees them "
                   "(`NVIDIA_VISIBLE_DEVICES`, CUDA device 0 first), each with the fields above for that GPU alone.",
                   "")


def rfc3339(t: float | None) -> str | None:
    if t is None:
        return None
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def _parse_time(v: Any) -> float | None:
    if not isinstance(v, str):
        return None
    try:
        return datetime.fromisoformat(v.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


@dataclass
class SlotCounter:
    """One counter of a container's region slots, keyed by (index, pid, start_time): what grew since the last
    read. Counters only grow but a slot may be reused by a new process; the first read only sets the baseline
    (what was counted before it is not this window's)."""

    seen: dict[tuple[int, int, int], int] = field(default_factory=dict)
    started: bool = False

    def grown(self, slots: list[tuple[tuple[int, int, int], int]]) -> int:
        grown, live = 0, {}
        for key, value in slots:
            before = self.seen.get(key)
            if before is not None and value > before:
                grown += value - before
            elif before is None and self.started:
                grown += value  # a process that started (and counted) since the last read
            live[key] = value if before is None else max(value, before)
        self.seen, self.started = live, True
        return grown


@dataclass
class ContainerUsage:
    """One container's figures, accumulated sample by sample."""

    gpu: str
    allocation: str
    first_seen: float  # unix time
    memory_limit_bytes: int = 0
    compute_limit_percent: int = 0
    state: str = "running"
    observed_s: float = 0.0
    gpu_util_integral: float = 0.0  # percent x seconds
    gpu_util_max: float = 0.0
    memcpy_util_integral: float = 0.0
    memcpy_util_max: float = 0.0
    memory_max_bytes: int = 0
    throttled_s: float = 0.0
    last_seen: float | None = None
    # last wait_ns per live region slot (index, pid, start_time): counters only grow, a slot may be reused
    wait_seen: dict[tuple[int, int, int], int] = field(default_factory=dict)
    # the latest sample, for /metrics
    gpu_util_now: float = 0.0
    memcpy_util_now: float = 0.0
    copies: SlotCounter = field(default_factory=SlotCounter)  # the slots' copy_bytes
    gpu_time: SlotCounter = field(default_factory=SlotCounter)  # the slots' gpu_ns (metered launches)
    launches: SlotCounter = field(default_factory=SlotCounter)  # the slots' launch counters (uncapped, under MPS)
    memory_now_bytes: int = 0
    resumed: bool = False  # figures of an earlier agent run looked for (see resume)

    def add(self, now: float, dt: float, gpu_util: float, memcpy_util: float, memory_bytes: int) -> None:
        """A sample window of `dt` seconds in which the container had processes on the GPU."""
        gpu_util = min(max(gpu_util, 0.0), 100.0)
        memcpy_util = min(max(memcpy_util, 0.0), 100.0)
        self.observed_s += dt
        self.gpu_util_integral += gpu_util * dt
        self.memcpy_util_integral += memcpy_util * dt
        self.gpu_util_max = max(self.gpu_util_max, gpu_util)
        self.memcpy_util_max = max(self.memcpy_util_max, memcpy_util)
        self.memory_max_bytes = max(self.memory_max_bytes, memory_bytes)
        self.gpu_util_now, self.memcpy_util_now, self.memory_now_bytes = gpu_util, memcpy_util, memory_bytes
        self.last_seen = now

    def idle(self) -> None:
        self.gpu_util_now = self.memcpy_util_now = 0.0
        self.memory_now_bytes = 0

    def add_waits(self, slots: list[tuple[tuple[int, int, int], int]]) -> None:
        """Region slots' wait_ns counters ((index, pid, start_time), wait_ns): add what grew since last read."""
        live = {}
        for key, wait_ns in slots:
            before = self.wait_seen.get(key, 0)
            if wait_ns > before:
                self.throttled_s += (wait_ns - before) / 1e9
            live[key] = max(wait_ns, before)
        self.wait_seen = live

    def add_copies(self, slots: list[tuple[tuple[int, int, int], int]]) -> int:
        """Region slots' copy_bytes counters ((index, pid, start_time), bytes): the bytes copied since last read."""
        return self.copies.grown(slots)

    @property
    def gpu_seconds(self) -> float:
        return self.gpu_util_integral / 100.0

    def entry(self) -> dict[str, object]:
        mean = (lambda v: round(v / self.observed_s, 2)) if self.observed_s > 0 else (lambda v: 0.0)
        out: dict[str, object] = {
            "gpu": self.gpu,
            "allocation": self.allocation,
            "state": self.state,
            "memory_limit_bytes": self.memory_limit_bytes,
            "compute_limit_percent": self.compute_limit_percent,
            "gpu_util_mean": mean(self.gpu_util_integral),
            "gpu_util_max": round(self.gpu_util_max, 2),
            "memcpy_util_mean": mean(self.memcpy_util_integral),
            "memcpy_util_max": round(self.memcpy_util_max, 2),
            "memory_max_bytes": self.memory_max_bytes,
            "gpu_seconds": round(self.gpu_seconds, 3),
            "throttled_seconds": round(self.throttled_s, 3),
            "observed_seconds": round(self.observed_s, 3),
            "first_seen": rfc3339(self.first_seen),
            "last_seen": rfc3339(self.last_seen),
        }
        assert tuple(out) == FIELD_NAMES
        return out

    def resume(self, entry: Any) -> None:
        """Add the figures an earlier agent run wrote for the same allocation (after a restart); once."""
        self.resumed = True
        if not isinstance(entry, dict) or entry.get("allocation") != self.allocation:
            return

        def num(name: str, top: float = 1e12) -> float:
            v = entry.get(name)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= top:
                return float(v)
            return 0.0

        observed = num("observed_seconds")
        self.observed_s += observed
        self.gpu_util_integral += num("gpu_util_mean", 100) * observed
        self.memcpy_util_integral += num("memcpy_util_mean", 100) * observed
        self.gpu_util_max = max(self.gpu_util_max, num("gpu_util_max", 100))
        self.memcpy_util_max = max(self.memcpy_util_max, num("memcpy_util_max", 100))
        self.memory_max_bytes = max(self.memory_max_bytes, int(num("memory_max_bytes")))
        self.throttled_s += num("throttled_seconds")
        self.first_seen = _parse_time(entry.get("first_seen")) or self.first_seen
        if self.last_seen is None:
            self.last_seen = _parse_time(entry.get("last_seen"))


def container_entry(parts: list[dict[str, object]], several: bool) -> dict[str, object]:
    """A container's entry from its GPUs' entries (in the order it sees its GPUs): the one entry itself for a
    one-GPU container; for several, each field combined by its rule, and `gpus`."""
    if not several and len(parts) == 1:
        return parts[0]
    out: dict[str, object] = {f.name: COMBINE[f.several][1]([p.get(f.name) for p in parts]) for f in FIELDS}
    out[GPUS_FIELD.name] = list(parts)
    return out


def gpu_entry(entry: Any, allocation: str) -> Any:
    """The figures of one allocation in a container's entry as found on a pod: the entry of its GPU in `gpus` for a
    container of several GPUs, else the entry itself (None when neither names that allocation)."""
    if not isinstance(entry, dict):
        return None
    gpus = entry.get(GPUS_FIELD.name)
    if isinstance(gpus, list):
        return next((g for g in gpus if isinstance(g, dict) and g.get("allocation") == allocation), None)
    return entry if entry.get("allocation") == allocation else None


def parse_usage(text: str) -> dict[str, Any]:
    """The annotation's entries as found on a pod ({} when absent or not a JSON object)."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def render_usage(entries: dict[str, Any]) -> str:
    return json.dumps(entries, sort_keys=True, separators=(",", ":"))


def markdown_table() -> str:
    """The README's table of the annotation's fields."""
    rows = ["| Field | Unit | Meaning | Several GPUs |", "| --- | --- | --- | --- |"]
    rows += [f"| `{f.name}` | {f.unit} | {f.meaning} | {COMBINE[f.several][0]} |" for f in FIELDS]
    rows.append(f"| `{GPUS_FIELD.name}` | {GPUS_FIELD.unit} | {GPUS_FIELD.meaning} | |")
    return "\n".join(rows) + "\n"


__all__ = ["USAGE_ANNOTATION", "FIELDS", "GPUS_FIELD", "ContainerUsage", "container_entry", "gpu_entry",
           "parse_usage", "render_usage", "markdown_table"]

if __name__ == "__main__":
    import sys

    sys.stdout.write(markdown_table())
