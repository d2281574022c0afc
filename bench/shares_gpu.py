"""Shares of one really shared GPU (H200), for every program shape: issue 18's "Must hold on the H200".

The agent runs in-process with the NVML backend and the kubelet emulator (tests/gpu/workloads.py's Node); every
tenant is a PyTorch process started the way its container would be, from the agent's own Allocate answers (their
variables and mounts, the shim preloaded, CUDA_VISIBLE_DEVICES for NVIDIA_VISIBLE_DEVICES), so the figures hold
whatever the sharing mechanism behind those answers is.

Program shapes (--shapes, comma-separated; default all):
  mm       bf16 4096x4096 matmuls back to back (never waits for the GPU; CUDA events every 4 matmuls);
  mm-sync  the same, torch.cuda.synchronize() every 20 matmuls (host time after each);
  small    a launch-bound loop of small kernels: x.mul_().add_() on 64K fp32 (CUDA events every 50 iterations);
  train    a training step of a 4-layer MLP (4096 wide, batch 512, bf16 autocast) with AdamW, loss.item() every step;
  infer    batch-1 inference of a 6-layer nn.TransformerEncoder (d 1024, 128 tokens, bf16, no_grad), the result
           copied to the host every step.
Each tenant sets up (model, tensors, 20 warm-up steps), waits at a start barrier (a file: the slow Python, torch and
CUDA start-ups of a scenario's tenants overlap, and their measured loops start together), runs its loop, and prints
its completion marks (wall time, units done) at the end.

A share is a tenant's units per second over a window / the same program's units per second alone on the whole GPU
without the shim x 100. The alone reference is measured first, --alone-repeat (2) times per shape in processes of
their own, and the fastest run is taken (the batch-1 inference loop is bimodal on the H200 VM: a process runs it at
~740 or ~460 inferences/s, whatever the shim); its table row gives every run's rate, NVML's device utilization alone,
and UNSTABLE where the runs differ by over 10 %.
Marks are interpolated linearly. With S = --seconds (3): settle S/3, then a measured window of S (+ 0.2 s margin).
Scenarios (--only, comma-separated; default all):
  caps     strict, alone, at each of --caps (20/30/50/70): the share and NVML's device utilization (sampled every
           100 ms) over the window after the settle; goal: each within +-3 points of the cap. (A program that leaves
           the GPU idle part of the time alone, see its NVML alone, cannot meet both: both are shown.) Never two caps
           on one node; tenants of other shapes at the same cap are admitted on the same node while they fit in
           100 % (they wait, set up and idle, at their barriers while one runs, so their start-ups overlap;
           --caps-one-per-node: a node each).
  pair     30 % + 70 % strict together: throughput ratio (goal 3/7 within +-10 %); each share against its cap x f,
           f = sum of shares / sum of caps when below 1 (goal: each within 3 points, f >= 0.9).
  three    20 / 30 / 50 % strict together: the same scaled-cap rule.
  usage    in the pair and three runs: each container's GPU utilization as the agent's profiler has it, the growth of
           its gpu_util_integral over the profiler's own sampled seconds between its first and last sample in the
           window; truth = NVML's device utilization over those samples' span x the tenant's share / the sum of the
           shares (the device's busy time split by the work each did); goal +-3 points. The annotation's
           gpu_util_mean (the container's whole life) is recorded beside it.
  elastic  policy elastic: a 30 % tenant alone (its share over 2S/3 after the settle, goal >= 95 %), then a 70 %
           tenant (set up beside it, idle at its barrier until then) is released: from the newcomer's first mark,
           the time from which every 100 ms window (slid by 10 ms, over S) holds the newcomer at >= 90 % of 70 and
           the time from which every one holds the lender at <= 33 % (goals <= 200 ms each). Each is judged
           against its own pace alone in the same process (the lender's lone phase; the newcomer's after the lender
           ends, S/2 lent the whole GPU): host-bound programs' pace differs by up to 35 % between processes (issue
           18's H200 runs), so the reference from other processes misjudged both. The times against that reference
           are kept beside them.
Run order: the alone references, then pair, three, elastic, caps (the shared scenarios first: a run cut short keeps
those); the JSON is rewritten after every scenario, and a failing scenario is recorded and the next one runs.

  python3 bench/shares_gpu.py --shim /tmp/shim/libalnair.so --json $OUT/shares.json
Prints one table (shape x scenario: figure, goal, pass/fail) and writes everything (per-window series, not the raw
marks) as JSON. Exit status 1 when something could not be measured (an error, recorded) or the run was stopped
(SIGTERM: the scenario under way is cleaned up and the table of the others printed); goals missed are figures: 0.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import functools
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchstats import write_json
from cpus import APPLY as APPLY_CPUS
from cpus import CpuPlan

from alnair_agent.constants import ENV_ALLOCATION_ID
from alnair_standins.workloads import Node, NvmlUtilization, plain_env, run_py  # light: heavy imports happen when used

# -- goals (issue 18) ----------------------------------------------------------------------------------------------
CAP_TOL = 3.0  # points: a share, NVML, a scaled cap, a usage figure
RATIO_TOL = 0.10  # relative, on the pair's throughput ratio against 3/7
REF_SPREAD = 0.10  # alone runs of one program further apart than this: its reference is marked unstable
MIN_F = 0.9  # what the GPU may lose to sharing two or three contexts, at most
LONE_MIN = 95.0  # an elastic tenant alone, % of its program alone
ARRIVE_S = 0.2  # elastic give-back, from the newcomer's first mark
ARRIVE_FRAC = 0.9  # the newcomer at >= 90 % of its cap
TAIL_SETTLE_S = 0.3  # after the lender's end, before the newcomer's own pace alone (idle detection + a lease)
TAIL_MIN_S = 0.5  # a newcomer alone for less than this after the settle has no pace of its own
WINDOW_S, SLIDE_S = 0.1, 0.01  # the per-window figures: 100 ms windows, slid by 10 ms for the elastic times

PAIR, THREE, ELASTIC = (30, 70), (20, 30, 50), (30, 70)
CAPS = (20, 30, 50, 70)
SCENARIOS = ("caps", "pair", "three", "usage", "elastic")
STARTUP_S = 9.0  # a node, its tenants' Python + torch + CUDA + model set-up (overlapped), and their exits, on the H200
EXIT_S = 0.6  # a tenant's process exit, one after another (caps, alone)
READY_TIMEOUT_S = 180.0

# -- the tenants ---------------------------------------------------------------------------------------------------
# argv: seconds, barrier file, ready file. The pid goes to <ready>.pid before torch is imported (so a tenant that
# hangs can be killed by its id); <ready> appears once set up; the loop starts when <barrier> reads "go" ("abort":
# exit). Loops that never wait for the GPU take marks from CUDA events (converted to wall time from an event
# recorded when the GPU was idle); loops that wait take host time after each wait.
TENANT_HEAD = """
import os, sys, time
""" + APPLY_CPUS + """
born = time.time()
seconds, barrier, ready = float(sys.argv[1]), sys.argv[2], sys.argv[3]
with open(ready + ".pid", "w") as f:
    f.write(str(os.getpid()))
import json, torch
torch.manual_seed(0)
"""

# A tenant set up: says so (the ready file, its pid inside) and waits at its barrier ("go"; "abort": exit 3; the
# benchmark gone: exit 4). Every benchmark's tenants share it.
BARRIER = """
set_up = time.time()
ppid = os.getppid()
with open(ready + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(ready + ".tmp", ready)
while not os.path.exists(barrier):
    if os.getppid() != ppid:  # the benchmark is gone: nobody will release this tenant
        sys.exit(4)
    time.sleep(0.0005)
with open(barrier) as f:
    if f.read() != "go":
        sys.exit(3)
"""

TENANT_TAIL = """
for _ in range(20):  # warm-up (cuBLAS handles, allocator, autocast caches): not measured
    step()
torch.cuda.synchronize()
""" + BARRIER + """if SYNCED:
    start = time.time()
    marks, n, end = [[start, 0]], 0, start + seconds
    while time.time() < end:
        step()
        n += UNITS
        marks.append([time.time(), n])
    host_end = time.time()
else:
    t0 = torch.cuda.Event(enable_timing=True)
    t0.record()
    torch.cuda.synchronize()
    start = time.time()
    events, n, end = [], 0, start + seconds
    while time.time() < end:
        for _ in range(PER_MARK):
            step()
        n += PER_MARK * UNITS
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        events.append((e, n))
    host_end = time.time()  # it stops issuing here; what it queued still completes (and is marked)
    torch.cuda.synchronize()
    marks = [[start, 0]] + [[start + t0.elapsed_time(e) / 1000, k] for e, k in events]
print(json.dumps({"unit": UNIT, "born": born, "set_up": set_up, "start": start, "host_end": host_end,
                  "end": time.time(), "marks": marks, "torch": torch.__version__,
                  "device": torch.cuda.get_device_name()}), flush=True)
"""


@dataclass(frozen=True)
class Shape:
    name: str
    unit: str
    body: str  # defines step() and SYNCED, PER_MARK, UNITS

    @property
    def code(self) -> str:
        return TENANT_HEAD + self.body + f"UNIT = {self.unit!r}\n" + TENANT_TAIL


SHAPES: dict[str, Shape] = {s.name: s for s in (
    Shape("mm", "matmul", """
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
def step():
    a @ a
SYNCED, PER_MARK, UNITS = False, 4, 1
"""),
    Shape("mm-sync", "matmul", """
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
def step():  # 20 matmuls, then wait for them: what loss.item() or logging does to a training loop
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
SYNCED, PER_MARK, UNITS = True, 1, 20
"""),
    Shape("small", "iteration", """
x = torch.ones(1 << 16, device="cuda")
def step():  # two ~2 us kernels: the host's launches, not the GPU, set the pace
    x.mul_(0.999).add_(0.001)
SYNCED, PER_MARK, UNITS = False, 50, 1
"""),
    Shape("train", "step", """
width, batch = 4096, 512
m = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())
                          for _ in range(4)]).cuda()
opt = torch.optim.AdamW(m.parameters(), 1e-4)
x, y = torch.randn(batch, width, device="cuda"), torch.randn(batch, width, device="cuda")
def step():
    with torch.autocast("cuda", torch.bfloat16):
        loss = torch.nn.functional.mse_loss(m(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    loss.item()
SYNCED, PER_MARK, UNITS = True, 1, 1
"""),
    Shape("infer", "inference", """
layer = torch.nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True)
m = torch.nn.TransformerEncoder(layer, 6).cuda().eval().to(torch.bfloat16)
x = torch.randn(1, 128, 1024, device="cuda", dtype=torch.bfloat16)
def step():
    with torch.no_grad():
        m(x)[:, -1].float().cpu()
SYNCED, PER_MARK, UNITS = True, 1, 1
"""),
)}


# -- analysis: pure functions of marks and samples (no torch, no GPU; tests/test_bench_shares.py) -------------------
class Progress:
    """A tenant's completion marks: units done by each wall time, linear between two marks (a mark says when that
    many units had completed; between two, the work is taken as evenly spread)."""

    def __init__(self, marks: Iterable[Sequence[float]]) -> None:
        pts = sorted((float(t), float(k)) for t, k in marks)
        if not pts:
            raise ValueError("no marks")
        self.times = [t for t, _ in pts]
        self.units = [k for _, k in pts]

    def at(self, t: float) -> float:
        i = bisect.bisect_right(self.times, t)
        if i == 0:
            return self.units[0]
        if i == len(self.times):
            return self.units[-1]
        t0, t1, k0, k1 = self.times[i - 1], self.times[i], self.units[i - 1], self.units[i]
        return k0 + (k1 - k0) * (t - t0) / (t1 - t0) if t1 > t0 else k1

    def rate(self, t0: float, t1: float) -> float:
        return (self.at(t1) - self.at(t0)) / (t1 - t0)

    def first_after(self, t: float) -> float | None:
        """When the first unit after `t` completed (the first mark above the units done at `t`)."""
        base = self.at(t)
        return next((tt for tt, k in zip(self.times, self.units, strict=False) if tt >= t and k > base), None)


def share(p: Progress, alone_rate: float, t0: float, t1: float) -> float:
    """% of what the same program does alone on the whole GPU, over wall time [t0, t1]."""
    return 100.0 * p.rate(t0, t1) / alone_rate


def share_series(p: Progress, alone_rate: float, t0: float, t1: float, width: float = WINDOW_S,
                 step: float | None = None) -> list[float]:
    """The share over windows [t0 + i step, t0 + i step + width] that end by t1 (step: width, i.e. a grid)."""
    step = width if step is None else step
    n = int(math.floor((t1 - t0 - width) / step + 1e-9)) + 1
    return [share(p, alone_rate, t0 + i * step, t0 + i * step + width) for i in range(max(n, 0))]


def held_from(xs: Sequence[float], ok: Callable[[float], bool], step: float) -> float | None:
    """The first time (i x step) from which every window holds `ok`; None when the last one does not (or none)."""
    i = len(xs)
    while i > 0 and ok(xs[i - 1]):
        i -= 1
    return None if i == len(xs) else round(i * step, 6)


@dataclass(frozen=True)
class Scaled:
    """The scaled-cap rule: caps that add up to 100 % or less are each a ceiling every tenant also reaches, and
    what the GPU loses to sharing is split in proportion to the caps: each share within CAP_TOL of cap x min(f, 1),
    f = sum of shares / sum of caps, and f >= MIN_F."""

    f: float
    targets: list[float]
    errors: list[float]
    ok: bool


def scaled_caps(caps: Sequence[float], shares: Sequence[float], tol: float = CAP_TOL, min_f: float = MIN_F) -> Scaled:
    f = sum(shares) / sum(caps)
    targets = [c * min(f, 1.0) for c in caps]
    errors = [s - t for s, t in zip(shares, targets, strict=False)]
    return Scaled(f, targets, errors, f >= min_f and all(abs(e) <= tol for e in errors))


def ratio_ok(ratio: float, want: float = PAIR[0] / PAIR[1], tol: float = RATIO_TOL) -> bool:
    return abs(ratio / want - 1.0) <= tol


def usage_truth(device_util: float, shares: Sequence[float]) -> list[float]:
    """What each tenant did of the GPU: the device's busy % split by the work each did (its share)."""
    total = sum(shares)
    return [device_util * s / total if total > 0 else 0.0 for s in shares]


@dataclass(frozen=True)
class Snapshot:
    """The profiler after one of its samples: when the sample was taken (wall s), its seconds sampled so far, and
    per allocation the integral of its GPU utilization (percent x s) and its annotation's gpu_util_mean."""

    t: float
    sampled_s: float
    integrals: dict[str, float]
    means: dict[str, float]


def usage_between(snaps: Sequence[Snapshot], alloc: str, t0: float, t1: float) -> tuple[float, float, float] | None:
    """The allocation's mean GPU utilization as the profiler has it over its samples in [t0, t1]: the integral's
    growth over the sampled seconds between the first and last sample there; with that span (wall s)."""
    inside = [s for s in snaps if t0 <= s.t <= t1 and alloc in s.integrals]
    if len(inside) < 2 or inside[-1].sampled_s <= inside[0].sampled_s:
        return None
    a, b = inside[0], inside[-1]
    return (b.integrals[alloc] - a.integrals[alloc]) / (b.sampled_s - a.sampled_s), a.t, b.t


def r1(x: float | None, nd: int = 1) -> float | None:
    """Rounded for the JSON; NaN (no samples) as null."""
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(x, nd)


Nvml = Callable[[float, float], float]  # mean device utilization over wall [t0, t1] (NvmlUtilization.mean)


def window(outs: Sequence[dict], settle: float) -> tuple[float, float]:
    """When every tenant runs: from the last one's start + settle to the first one's end of issuing work."""
    t0 = max(o["start"] for o in outs) + settle
    t1 = min(o["host_end"] for o in outs)
    if t1 - t0 < 2 * WINDOW_S:
        raise ValueError(f"the tenants ran together for {t1 - t0:.2f} s after the settle: too short to measure")
    return t0, t1


def tenant_record(o: dict) -> dict:
    """What the JSON keeps of a tenant's output (not its marks)."""
    return {"unit": o["unit"], "setup_s": r1(o["set_up"] - o["born"], 2), "loop_s": r1(o["host_end"] - o["start"], 3),
            "units": o["marks"][-1][1], "marks": len(o["marks"])}


def analyse_alone(o: dict, nvml: Nvml, settle: float) -> dict:
    p, t0, t1 = Progress(o["marks"]), o["start"] + settle, o["host_end"]
    rate = p.rate(t0, t1)
    if rate <= 0:
        raise ValueError("the program did no work alone")
    return {"rate": rate, "unit": o["unit"], "nvml": r1(nvml(t0, t1)), "window_s": r1(t1 - t0, 3),
            "rate_per_100ms": [r1(x * rate / 100, 1) for x in share_series(p, rate, t0, t1)],
            "tenant": tenant_record(o), "torch": o.get("torch"), "device": o.get("device")}


def reference(runs: Sequence[dict]) -> dict:
    """A program's alone reference from its repeated runs: the fastest (the pace it reaches alone; a share against
    it never overstates what a tenant got), with every run's rate and their spread (a program whose pace alone
    varies by more than REF_SPREAD between processes has shares no better than that). An error when none ran."""
    ok = [r for r in runs if "rate" in r]
    if not ok:
        return next((r for r in runs if "error" in r), {"error": "no alone run"})
    best = max(ok, key=lambda r: r["rate"])
    rates = [r["rate"] for r in ok]
    return {**best, "runs": [r1(x, 1) for x in rates], "spread": r1(max(rates) / min(rates) - 1.0, 3)}


def analyse_cap(cap: int, o: dict, alone_rate: float, nvml: Nvml, settle: float) -> dict:
    p, t0, t1 = Progress(o["marks"]), o["start"] + settle, o["host_end"]
    xs = share_series(p, alone_rate, t0, t1)
    grid = [t0 + i * WINDOW_S for i in range(len(xs))]
    return {"cap": cap, "share": share(p, alone_rate, t0, t1), "nvml": r1(nvml(t0, t1), 2), "window_s": r1(t1 - t0, 3),
            "share_per_100ms": [r1(x) for x in xs], "nvml_per_100ms": [r1(nvml(t, t + WINDOW_S)) for t in grid],
            "tenant": tenant_record(o)}


def analyse_usage(ps: Sequence[Progress], alone_rate: float, nvml: Nvml, snaps: Sequence[Snapshot],
                  ids: Sequence[str | None], t0: float, t1: float) -> list[dict]:
    out = []
    for i, alloc in enumerate(ids):
        got = usage_between(snaps, alloc, t0, t1) if alloc else None
        if got is None:
            out.append({"alloc": alloc, "error": "no two profiler samples of this allocation in the window"})
            continue
        measured, ta, tb = got
        shares = [share(p, alone_rate, ta, tb) for p in ps]
        device = nvml(ta, tb)
        truth = usage_truth(device, shares)[i]
        mean = next((s.means.get(alloc) for s in reversed(snaps) if s.t <= tb and alloc in s.means), None)
        out.append({"alloc": alloc, "measured": r1(measured, 2), "truth": r1(truth, 2), "device_nvml": r1(device, 2),
                    "span_s": [r1(ta - t0, 3), r1(tb - t0, 3)], "annotation_gpu_util_mean": mean})
    return out


def analyse_together(caps: Sequence[int], outs: Sequence[dict], alone_rate: float, nvml: Nvml,
                     snaps: Sequence[Snapshot], ids: Sequence[str | None], settle: float) -> dict:
    ps = [Progress(o["marks"]) for o in outs]
    t0, t1 = window(outs, settle)
    shares = [share(p, alone_rate, t0, t1) for p in ps]
    sc = scaled_caps(caps, shares)
    starts = [o["start"] for o in outs]
    res: dict[str, Any] = {
        "caps": list(caps), "shares": [r1(s, 2) for s in shares], "f": r1(sc.f, 4),
        "targets": [r1(t, 2) for t in sc.targets], "scaled_ok": sc.ok, "nvml": r1(nvml(t0, t1), 2),
        "window_s": r1(t1 - t0, 3), "start_skew_s": r1(max(starts) - min(starts), 4),
        "share_per_100ms": [[r1(x) for x in share_series(p, alone_rate, t0, t1)] for p in ps],
        "tenants": [tenant_record(o) for o in outs]}
    if len(caps) == 2:
        res["ratio"] = r1(shares[0] / shares[1], 4) if shares[1] > 0 else None
    res["usage"] = analyse_usage(ps, alone_rate, nvml, snaps, ids, t0, t1)
    res["profiler_samples"] = [[r1(s.t - t0, 3), r1(s.sampled_s, 3), {k: r1(v, 1) for k, v in s.integrals.items()}]
                               for s in snaps]
    return res


@dataclass(frozen=True)
class ElasticPlan:
    settle: float  # the lender alone, before its figure
    lone: float  # the lender's figure alone
    horizon: float  # from the newcomer's first mark: how long its and the lender's windows must hold
    tail: float = 0.0  # the newcomer alone after the lender ends: its own pace alone

    @property
    def lender_run(self) -> float:  # from its release: alone, then beside the newcomer, and a margin
        return self.settle + self.lone + self.horizon + 1.0

    @property
    def newcomer_run(self) -> float:  # from its release (settle + lone after the lender's): to the lender's end, then
        return self.lender_run - self.settle - self.lone + self.tail  # alone for the tail

    @property
    def wall(self) -> float:
        return self.settle + self.lone + self.newcomer_run


def analyse_elastic(lender: dict, newcomer: dict, alone_rate: float, nvml: Nvml, plan: ElasticPlan,
                    caps: tuple[int, int] = ELASTIC) -> dict:
    lp, np_ = Progress(lender["marks"]), Progress(newcomer["marks"])
    lone0, lone1 = lender["start"] + plan.settle, newcomer["start"]
    first = np_.first_after(newcomer["start"])
    res: dict[str, Any] = {"caps": list(caps), "lone": share(lp, alone_rate, lone0, lone1),
                           "lone_nvml": r1(nvml(lone0, lone1)), "lone_window_s": r1(lone1 - lone0, 3),
                           "tenants": [tenant_record(lender), tenant_record(newcomer)]}
    if first is None:
        return {**res, "arrival_failed": "the newcomer completed no work"}  # a figure (starved), not an error
    end = min(first + plan.horizon, lender["host_end"], newcomer["host_end"])
    want, lend_max = ARRIVE_FRAC * caps[1], caps[0] + CAP_TOL
    # Each tenant's own pace alone, in its own process: the lender's lone phase, the newcomer's after the lender.
    own_lender = lp.rate(lone0, lone1) if lone1 > lone0 else 0.0
    tail0 = lender["host_end"] + TAIL_SETTLE_S
    own_newcomer = np_.rate(tail0, newcomer["host_end"]) if newcomer["host_end"] - tail0 >= TAIL_MIN_S else 0.0

    def times(n_rate: float, l_rate: float) -> tuple[float | None, float | None]:
        ns = share_series(np_, n_rate, first, end, WINDOW_S, SLIDE_S)
        ls = share_series(lp, l_rate, first, end, WINDOW_S, SLIDE_S)
        return held_from(ns, lambda x: x >= want, SLIDE_S), held_from(ls, lambda x: x <= lend_max, SLIDE_S)

    ref_n, ref_l = times(alone_rate, alone_rate)
    own = own_lender > 0 and own_newcomer > 0
    own_n, own_l = times(own_newcomer, own_lender) if own else (ref_n, ref_l)
    return {**res, "first_mark_s": r1(first - newcomer["start"], 4), "horizon_s": r1(end - first, 3),
            "judged_on": "own pace" if own else "alone reference",
            "newcomer_s": own_n, "lender_s": own_l, "newcomer_s_reference": ref_n, "lender_s_reference": ref_l,
            "own_pace_vs_reference": [r1(100.0 * own_lender / alone_rate), r1(100.0 * own_newcomer / alone_rate)],
            "newcomer_per_100ms": [r1(x) for x in share_series(np_, alone_rate, first, end)],
            "lender_per_100ms": [r1(x) for x in share_series(lp, alone_rate, first, end)],
            "lender_per_100ms_alone": [r1(x) for x in share_series(lp, alone_rate, lender["start"], lone1)],
            "nvml_after_first": r1(nvml(first, end))}


# -- the table -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    shape: str
    scenario: str
    figure: str
    goal: str
    ok: bool | None  # None: a reference, no goal

    @property
    def verdict(self) -> str:
        return "-" if self.ok is None else ("pass" if self.ok else "FAIL")


def fmt(xs: Iterable[float | None], nd: int = 1) -> str:
    return " / ".join("-" if x is None else f"{x:.{nd}f}" for x in xs)


def within(x: float | None, want: float, tol: float = CAP_TOL) -> bool:
    return x is not None and not math.isnan(x) and abs(x - want) <= tol


def alone_rows(shape: str, r: dict) -> list[Row]:
    runs = r.get("runs", [r["rate"]])
    spread = r.get("spread") or 0.0
    figure = f"{r['rate']:.1f} {r['unit']}/s, NVML {fmt([r['nvml']])} %"
    if len(runs) > 1:
        figure += f" (fastest of {fmt(runs)}{'; UNSTABLE' if spread > REF_SPREAD else ''})"
    return [Row(shape, "alone, no shim", figure, "(the 100 % of a share)", None)]


def cap_rows(shape: str, r: dict) -> list[Row]:
    cap = r["cap"]
    return [Row(shape, f"cap {cap}: share", f"{r['share']:.1f} %", f"{cap} +-{CAP_TOL:g}", within(r["share"], cap)),
            Row(shape, f"cap {cap}: NVML", f"{fmt([r['nvml']])} %", f"{cap} +-{CAP_TOL:g}", within(r["nvml"], cap))]


def together_rows(shape: str, name: str, r: dict) -> list[Row]:
    rows = []
    if "ratio" in r:
        want = r["caps"][0] / r["caps"][1]
        ratio = r["ratio"]
        figure = "-" if ratio is None else f"{ratio:.3f} ({100 * (ratio / want - 1):+.1f} %)"
        rows.append(Row(shape, f"{name}: ratio", figure, f"{want:.3f} +-{100 * RATIO_TOL:g} %",
                        ratio is not None and ratio_ok(ratio, want)))
    rows.append(Row(shape, f"{name}: shares", f"{fmt(r['shares'])} % (f {r['f']:.3f})",
                    f"{fmt(r['targets'])} +-{CAP_TOL:g}, f >= {MIN_F:g}", r["scaled_ok"]))
    return rows


def usage_rows(shape: str, name: str, r: dict) -> list[Row]:
    u = r["usage"]
    if any("error" in x for x in u):
        return [Row(shape, f"usage ({name})", next(x["error"] for x in u if "error" in x), "each +-3 of truth", False)]
    ok = all(within(x["measured"], x["truth"]) for x in u)
    means = fmt([x["annotation_gpu_util_mean"] for x in u])
    return [Row(shape, f"usage ({name})", f"{fmt([x['measured'] for x in u])} (annotation mean {means})",
                f"{fmt([x['truth'] for x in u])} +-{CAP_TOL:g}", ok)]


def elastic_rows(shape: str, r: dict) -> list[Row]:
    lender, newcomer = r["caps"]
    rows = [Row(shape, f"elastic: {lender} % alone", f"{r['lone']:.1f} %", f">= {LONE_MIN:g}", r["lone"] >= LONE_MIN)]
    if "arrival_failed" in r:
        return rows + [Row(shape, "elastic: arrival", r["arrival_failed"], f"<= {ARRIVE_S * 1e3:.0f} ms", False)]
    s = lambda v: "never" if v is None else f"{v * 1e3:.0f} ms"  # noqa: E731
    ok = lambda v: v is not None and v <= ARRIVE_S + 1e-9  # noqa: E731
    on = r.get("judged_on", "alone reference")
    ref = (lambda k: f"; {s(r[k + '_reference'])} on the alone reference") if on == "own pace" else (lambda k: "")
    rows.append(Row(shape, f"elastic: {newcomer} % arrives",
                    f"at >= {ARRIVE_FRAC * newcomer:g} % of {on} after {s(r['newcomer_s'])}{ref('newcomer_s')}",
                    f"<= {ARRIVE_S * 1e3:.0f} ms", ok(r["newcomer_s"])))
    rows.append(Row(shape, "elastic: lender back",
                    f"at <= {lender + CAP_TOL:g} % of {on} after {s(r['lender_s'])}{ref('lender_s')}",
                    f"<= {ARRIVE_S * 1e3:.0f} ms", ok(r["lender_s"])))
    return rows


def error_row(shape: str, scenario: str, error: str) -> Row:
    """The error's last line (a tenant's own last line of stderr, where a tenant failed); the JSON has the rest."""
    lines = [ln.strip() for ln in error.splitlines() if ln.strip()]
    return Row(shape, scenario, "error: " + lines[-1][:100] if lines else "error", "-", False)


def table(rows: Sequence[Row]) -> str:
    head = ("shape", "scenario", "figure", "goal", "result")
    cells = [head] + [(r.shape, r.scenario, r.figure, r.goal, r.verdict) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cell, widths, strict=False)).rstrip() for cell in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    npass, nfail = sum(r.ok is True for r in rows), sum(r.ok is False for r in rows)
    return "\n".join(lines + [f"{npass} passed, {nfail} failed"])


# -- the plan --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    """One node's run: caps: tenants of these shapes at one cap, one after another; else one shape's tenants."""

    scenario: str  # caps, pair, three, elastic
    shapes: tuple[str, ...]
    cap: int = 0

    @property
    def key(self) -> str:
        return f"caps {self.cap}: " + ",".join(self.shapes) if self.scenario == "caps" else \
            f"{self.scenario}: {self.shapes[0]}"


def plan(shapes: Sequence[str], only: set[str], caps: Sequence[int] = CAPS, pack: bool = True) -> list[Step]:
    """The shared scenarios first, then caps; caps of one value packed onto a node while they fit in 100 %."""
    steps: list[Step] = []
    for scenario in ("pair", "three"):
        if scenario in only or "usage" in only:
            steps += [Step(scenario, (s,)) for s in shapes]
    if "elastic" in only:
        steps += [Step("elastic", (s,)) for s in shapes]
    if "caps" in only:
        for cap in caps:
            per = max(1, 100 // cap) if pack else 1
            steps += [Step("caps", tuple(shapes[i:i + per]), cap) for i in range(0, len(shapes), per)]
    return steps


@dataclass(frozen=True)
class Windows:
    """Every window, scaled by --seconds."""

    seconds: float = 3.0

    @property
    def settle(self) -> float:
        return self.seconds / 3

    @property
    def run_s(self) -> float:  # a tenant's loop in caps, pair, three and alone: settle + window + a margin
        return self.settle + self.seconds + 0.2

    @property
    def elastic(self) -> ElasticPlan:
        return ElasticPlan(self.settle, 2 * self.seconds / 3, self.seconds, self.seconds / 2)


def estimate_s(steps: Sequence[Step], w: Windows, alone_shapes: int) -> float:
    """Wall time of a run: each node's start-ups once (overlapped by the barrier), its loops one after another."""
    e = w.elastic
    total = STARTUP_S + alone_shapes * (w.run_s + EXIT_S) if alone_shapes else 0.0
    for s in steps:
        if s.scenario == "caps":
            total += STARTUP_S + len(s.shapes) * (w.run_s + EXIT_S)
        elif s.scenario == "elastic":
            total += STARTUP_S + e.wall
        else:
            total += STARTUP_S + w.run_s
    return total


# -- running it on the GPU -------------------------------------------------------------------------------------------
T0 = time.time()


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.time() - T0:5.0f} s] {msg}", flush=True)


@dataclass
class Tenant:
    name: str
    shape: Shape
    env: dict[str, str]
    seconds: float
    folder: Path
    task: asyncio.Task | None = None
    released: bool = False

    @property
    def alloc(self) -> str | None:
        return self.env.get(ENV_ALLOCATION_ID)

    def path(self, what: str) -> Path:
        return self.folder / f"{self.name}.{what}"


class Tenants:
    """One scenario's tenant processes: each sets up, says so (a file) and waits at its own barrier. On exit the
    ones never released are told to abort, and any still running after their loops' time are killed by their pid."""

    def __init__(self, cpus: CpuPlan | None = None, trace_dir: Path | None = None) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="aln-bench-", dir="/tmp"))
        self.all: list[Tenant] = []
        self.cpus = cpus
        self.trace_dir = trace_dir
        if cpus is not None:
            cpus.reset()

    async def __aenter__(self) -> "Tenants":
        return self

    def start(self, name: str, shape: str, env: dict[str, str], seconds: float) -> Tenant:
        env = self.cpus.env(env) if self.cpus is not None else env
        if self.trace_dir is not None:
            env = {**env, "ALNAIR_TRACE_FILE": str(self.trace_dir / f"{name}.trace")}
        t = Tenant(name, SHAPES[shape], env, seconds, self.folder)
        argv = (f"{seconds:.3f}", str(t.path("go")), str(t.path("ready")))
        t.task = asyncio.create_task(run_py(t.shape.code, env, *argv), name=f"tenant-{name}")
        self.all.append(t)
        return t

    async def settle_ready(self, timeout: float = READY_TIMEOUT_S) -> dict[str, str]:
        """Wait until every tenant is set up or has exited; those that exited, with why."""
        deadline = time.monotonic() + timeout
        while True:
            dead = {t.name: "exited before it was released" if t.task.cancelled() or t.task.exception() is None
                    else f"{type(t.task.exception()).__name__}: {t.task.exception()}" for t in self.all
                    if t.task.done()}
            if all(t.path("ready").exists() or t.name in dead for t in self.all):
                return dead
            if time.monotonic() > deadline:
                raise TimeoutError(f"tenants not set up after {timeout:.0f} s: "
                                   + ", ".join(t.name for t in self.all if not t.path("ready").exists()))
            await asyncio.sleep(0.02)

    async def ready(self) -> None:
        dead = await self.settle_ready()
        if dead:
            raise RuntimeError("; ".join(f"{k}: {v}" for k, v in dead.items()))

    def _signal(self, t: Tenant, word: str) -> None:
        tmp = t.path("go.tmp")
        tmp.write_text(word)
        os.replace(tmp, t.path("go"))  # whole or not at all: the tenant reads it once it exists

    def release(self, *ts: Tenant) -> float:
        for t in ts:
            self._signal(t, "go")
            t.released = True
        return time.time()

    async def __aexit__(self, *exc: object) -> None:
        for t in self.all:
            if not t.released:
                self._signal(t, "abort")
        tasks = [t.task for t in self.all if t.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=max(t.seconds for t in self.all) + 30)
        for t in self.all:
            if t.task is not None and not t.task.done():
                try:
                    os.kill(int(t.path("ready.pid").read_text()), signal.SIGKILL)
                    say(f"killed tenant {t.name} (still running after its loop's time)")
                except (OSError, ValueError):
                    pass
        if tasks:
            await asyncio.wait(tasks, timeout=15)
            for task in tasks:
                if not task.done():
                    task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        shutil.rmtree(self.folder, ignore_errors=True)


class UsageProbe:
    """The profiler's running figures per allocation, read after each of its samples (polled every 20 ms in the
    agent's own event loop, so a tick's figures are read whole)."""

    def __init__(self, agent: Any, ids: Sequence[str | None]) -> None:
        self.agent, self.ids = agent, [i for i in ids if i]
        self.snapshots: list[Snapshot] = []
        self.error: str | None = None

    async def _run(self) -> None:
        try:
            p, seen = self.agent.profiler, None
            while True:
                if p.samples != seen:
                    seen = p.samples
                    at = time.time() - (time.monotonic() - p.sample_at)  # the sample's own time, on the wall clock
                    us = {i: p.usage[i] for i in self.ids if i in p.usage}
                    self.snapshots.append(Snapshot(at, p.sampled_s, {i: u.gpu_util_integral for i, u in us.items()},
                                                   {i: u.entry()["gpu_util_mean"] for i, u in us.items()}))
                await asyncio.sleep(0.02)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a profiler of another shape: usage says so, the rest goes on
            self.error = repr(e)

    async def __aenter__(self) -> "UsageProbe":
        self.task = asyncio.create_task(self._run(), name="usage-probe")
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


class TurnsLog:
    """--trace-dir: the dispatcher's view after each of its ticks (wall s; who is active, who is lent the GPU, each
    container's window as a part of the period), polled in the agent's own event loop."""

    def __init__(self, agent: Any, names: dict[str | None, str]) -> None:
        self.agent, self.names = agent, {k: v for k, v in names.items() if k}
        self.rows: list[dict] = []

    async def _run(self) -> None:
        d, seen = self.agent.dispatcher, -1
        while d is not None:
            if d.ticks != seen:
                seen = d.ticks
                active = set().union(*(g.active for g in d.gpus.values())) if d.gpus else set()
                self.rows.append({"t": time.time(), "tick": d.ticks,
                                  "active": sorted(self.names.get(k, k) for k in active),
                                  "lent": sorted(self.names.get(k, k) for k in d.lent),
                                  "turns": {self.names.get(k, k): round(v, 3) for k, v in d.turns.items()}})
            await asyncio.sleep(0.005)

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name="turns-log")

    async def stop(self, path: Path) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        path.write_text(json.dumps(self.rows))


@dataclass
class Bench:
    shim: Path
    windows: Windows
    dispatcher: str = "on"
    settings: dict[str, Any] = field(default_factory=dict)
    gpu: int = 0
    memory_gib: int = 12
    alone_repeat: int = 2
    cpus: CpuPlan | None = None  # --pin: a CPU of its own for each tenant, the benchmark on the first core
    alone: dict[str, dict] = field(default_factory=dict)
    trace_dir: Path | None = None  # --trace-dir: each tenant's shim trace (a trace build) and the turns, tick by tick

    def node(self, policy: str) -> Node:
        return Node(self.shim, policy, self.dispatcher, **self.settings)

    def sampler(self, env: dict[str, str]) -> NvmlUtilization:
        return NvmlUtilization(int(env["CUDA_VISIBLE_DEVICES"]), 0.1)

    def rate(self, shape: str) -> float:
        if shape not in self.alone or "rate" not in self.alone[shape]:
            raise RuntimeError(f"no alone reference for {shape}")
        return self.alone[shape]["rate"]

    async def measure_alone(self, shapes: Sequence[str]) -> dict[str, dict]:
        """Each program alone on the whole GPU, no shim, `alone_repeat` times (processes of their own): set up
        together, run one after another, shape by shape in turn."""
        env, w = plain_env(self.gpu), self.windows
        runs: dict[str, list[dict]] = {s: [] for s in shapes}
        async with Tenants(self.cpus) as ts:
            tenants = [ts.start(f"{s}#{i}", s, env, w.run_s) for i in range(self.alone_repeat) for s in shapes]
            dead = await ts.settle_ready()
            with self.sampler(env) as nv:
                for t in tenants:
                    shape = t.name.split("#")[0]
                    try:
                        if t.name in dead:
                            raise RuntimeError(dead[t.name])
                        ts.release(t)
                        runs[shape].append(analyse_alone(await t.task, nv.mean, w.settle))
                        say(f"alone {t.name}: {runs[shape][-1]['rate']:.1f} {runs[shape][-1]['unit']}/s, NVML "
                            f"{fmt([runs[shape][-1]['nvml']])} %")
                    except Exception:  # noqa: BLE001 - this shape's scenarios fail; the others go on
                        runs[shape].append({"error": traceback.format_exc(limit=3)[-3000:]})
                        say(f"alone {t.name}: FAILED {runs[shape][-1]['error'].strip().splitlines()[-1]}")
        out = {s: reference(rs) for s, rs in runs.items()}
        self.alone.update(out)
        return out

    async def caps(self, step: Step) -> dict[str, dict]:
        w = self.windows
        out = {s: {"error": f"no alone reference for {s}"} for s in step.shapes if "rate" not in self.alone.get(s, {})}
        shapes = [s for s in step.shapes if s not in out]
        if not shapes:
            return out
        async with self.node("strict") as node, Tenants(self.cpus, self.trace_dir) as ts:
            envs = [await node.admit(step.cap, self.memory_gib) for _ in shapes]
            tenants = [ts.start(s, s, e, w.run_s) for s, e in zip(shapes, envs, strict=False)]
            dead = await ts.settle_ready()
            with self.sampler(envs[0]) as nv:
                for t in tenants:  # one at a time: each alone on the GPU, the others idle at their barriers
                    try:
                        if t.name in dead:
                            raise RuntimeError(dead[t.name])
                        ts.release(t)
                        out[t.name] = analyse_cap(step.cap, await t.task, self.rate(t.name), nv.mean, w.settle)
                    except Exception:  # noqa: BLE001
                        out[t.name] = {"error": traceback.format_exc(limit=3)[-3000:]}
        return out

    async def together(self, step: Step, caps: Sequence[int]) -> dict:
        shape, w = step.shapes[0], self.windows
        rate = self.rate(shape)
        async with self.node("strict") as node, Tenants(self.cpus, self.trace_dir) as ts:
            envs = [await node.admit(c, self.memory_gib) for c in caps]
            tenants = [ts.start(f"{shape}-{c}", shape, e, w.run_s) for c, e in zip(caps, envs, strict=False)]
            await ts.ready()
            ids = [t.alloc for t in tenants]
            async with UsageProbe(node.agent, ids) as probe:
                with self.sampler(envs[0]) as nv:
                    ts.release(*tenants)
                    outs = await asyncio.gather(*(t.task for t in tenants))
        res = analyse_together(caps, outs, rate, nv.mean, probe.snapshots, ids, w.settle)
        if probe.error:
            res["usage"] = [{"alloc": i, "error": f"profiler not readable: {probe.error}"} for i in ids]
        return res

    async def elastic(self, step: Step) -> dict:
        shape, e = step.shapes[0], self.windows.elastic
        rate = self.rate(shape)
        async with self.node("elastic") as node, Tenants(self.cpus, self.trace_dir) as ts:
            lender_env, newcomer_env = await node.admit(ELASTIC[0], self.memory_gib), \
                await node.admit(ELASTIC[1], self.memory_gib)
            lender = ts.start(f"{shape}-lender", shape, lender_env, e.lender_run)
            newcomer = ts.start(f"{shape}-newcomer", shape, newcomer_env, e.newcomer_run)
            await ts.ready()  # both set up: the newcomer idles at its barrier while the lender runs alone
            ticks = TurnsLog(node.agent, {lender.alloc: "lender", newcomer.alloc: "newcomer"}) \
                if self.trace_dir is not None else None
            with self.sampler(lender_env) as nv:
                if ticks is not None:
                    ticks.start()
                ts.release(lender)
                await asyncio.sleep(e.settle + e.lone)
                ts.release(newcomer)
                lo, no = await asyncio.gather(lender.task, newcomer.task)
            if ticks is not None:
                await ticks.stop(self.trace_dir / f"{shape}-elastic.turns.json")
        return analyse_elastic(lo, no, rate, nv.mean, e)

    async def step(self, step: Step) -> dict:
        if step.scenario == "caps":
            return await self.caps(step)
        if step.scenario == "elastic":
            return await self.elastic(step)
        return await self.together(step, PAIR if step.scenario == "pair" else THREE)


def rows_of(shapes: Sequence[str], alone: dict[str, dict], results: dict[str, dict], only: set[str],
            caps: Sequence[int] = CAPS) -> list[Row]:
    """The table, shape by shape in the scenarios' order, from the results by step key."""
    by: dict[tuple[str, str], dict] = {}  # (shape, "caps 30" | "pair" | ...) -> result or {"error"}
    for key, r in results.items():
        scenario, names = key.split(": ", 1)
        if scenario.startswith("caps"):
            for s in names.split(","):
                by[(s, scenario)] = r if "error" in r else r.get(s, {"error": "not measured"})
        else:
            by[(names, scenario)] = r
    rows: list[Row] = []

    def add(s: str, scenario: str, make: Callable[[dict], list[Row]], label: str | None = None) -> None:
        """The scenario's rows, or one error row (`label` None: its error is another row's already)."""
        r = by.get((s, scenario))
        if r is not None and "error" in r:
            rows.extend([error_row(s, label or scenario, r["error"])] if label != "" else [])
        elif r is not None:
            rows.extend(make(r))

    for s in shapes:
        a = alone.get(s)
        if a is not None:
            rows.extend(alone_rows(s, a) if "error" not in a else [error_row(s, "alone, no shim", a["error"])])
        if "caps" in only:
            for cap in caps:
                add(s, f"caps {cap}", functools.partial(cap_rows, s))
        if "pair" in only:
            add(s, "pair", functools.partial(together_rows, s, "pair 30+70"))
        if "three" in only:
            add(s, "three", functools.partial(together_rows, s, "three 20+30+50"))
        if "usage" in only:
            add(s, "pair", functools.partial(usage_rows, s, "pair"), "" if "pair" in only else "usage (pair)")
            add(s, "three", functools.partial(usage_rows, s, "three"), "" if "three" in only else "usage (three)")
        if "elastic" in only:
            add(s, "elastic", functools.partial(elastic_rows, s))
    return rows


def gpu_record(index: int) -> dict:
    import pynvml

    h = pynvml.nvmlDeviceGetHandleByIndex(index)
    name = pynvml.nvmlDeviceGetName(h)
    driver = pynvml.nvmlSystemGetDriverVersion()
    dec = lambda v: v.decode() if isinstance(v, bytes) else v  # noqa: E731 - older bindings return bytes
    return {"index": index, "name": dec(name), "driver": dec(driver)}


def save(path: Path | None, record: dict) -> None:
    """The JSON, rewritten whole after every scenario (via a temporary file: a run killed while it writes keeps the
    previous one)."""
    if path is None:
        return
    tmp = path.with_name(path.name + ".tmp")
    write_json(tmp, record)
    os.replace(tmp, path)


async def run(bench: Bench, shapes: Sequence[str], steps: Sequence[Step], only: set[str], record: dict,
              json_path: Path | None = None, caps: Sequence[int] = CAPS) -> list[Row]:
    """The alone references for these shapes, then each step; every result (or its error) kept in `record` (filled
    as it goes: a run cut short keeps what it measured) by step key; the table's rows."""
    import pynvml

    with_sigterm_cancelling(asyncio.current_task())
    pynvml.nvmlInit()  # held for the whole run: no sampler's or agent's shutdown tears NVML down under another
    try:
        config = {"shim": str(bench.shim), "seconds": bench.windows.seconds, "dispatcher": bench.dispatcher,
                  "settings": bench.settings, "shapes": list(shapes), "only": sorted(only), "caps": list(caps),
                  "steps": [s.key for s in steps],
                  "cpus": bench.cpus.describe() if bench.cpus is not None else None}
        record.update({"config": config, "gpu": gpu_record(bench.gpu), "alone": {}, "scenarios": {}})
        record["estimate_s"] = round(estimate_s(steps, bench.windows, len(shapes) * bench.alone_repeat))
        say(f"{len(steps)} scenario runs on {len(shapes)} shapes; estimated {record['estimate_s'] / 60:.1f} min")
        try:
            record["alone"] = await bench.measure_alone(shapes)
        except Exception:  # noqa: BLE001 - every scenario then says why it has no reference
            record["alone"] = {s: {"error": traceback.format_exc(limit=4)[-3000:]} for s in shapes}
        save(json_path, record)
        for step in steps:
            say(f"{step.key} ...")
            try:
                r = await bench.step(step)
            except Exception:  # noqa: BLE001 - recorded; the next scenario runs
                r = {"error": traceback.format_exc(limit=4)[-3000:]}
            except asyncio.CancelledError:  # SIGTERM (a time limit): keep what was measured, print it
                record["cut_short_at"] = step.key
                save(json_path, record)
                say(f"stopped during {step.key}")
                break
            record["scenarios"][step.key] = r
            record["elapsed_s"] = round(time.time() - T0, 1)
            record["table"] = [asdict(x) for x in rows_of(shapes, record["alone"], record["scenarios"], only, caps)]
            save(json_path, record)
            for row in rows_of(step.shapes, {}, {step.key: r}, only, caps):
                say(f"  {row.shape:<8} {row.scenario:<24} {row.figure}  [{row.goal}: {row.verdict}]")
        return rows_of(shapes, record["alone"], record["scenarios"], only, caps)
    finally:
        pynvml.nvmlShutdown()


def with_sigterm_cancelling(task: asyncio.Task | None) -> None:
    """SIGTERM (`timeout`'s) cancels the run: the scenario under way cleans up (its tenants told to abort or killed,
    its node stopped) and the table of what was measured is still printed."""
    if task is not None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)


def parse_setting(text: str) -> tuple[str, Any]:
    """name=value, the value as JSON where it parses (numbers, true/false), else as text."""
    name, _, value = text.partition("=")
    if not name or not _:
        raise argparse.ArgumentTypeError(f"expected name=value, got {text!r}")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shim", type=Path, default=Path("/tmp/shim/libalnair.so"))
    ap.add_argument("--json", type=Path, help="where the results go (rewritten after every scenario)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--only", default=",".join(SCENARIOS), help=f"comma-separated, of {', '.join(SCENARIOS)}")
    ap.add_argument("--caps", default=",".join(map(str, CAPS)), help="caps: the caps measured alone")
    ap.add_argument("--seconds", type=float, default=3.0, help="the measured window; every other window scales with it")
    ap.add_argument("--caps-one-per-node", action="store_true",
                    help="caps: a node of its own for every tenant (no idle neighbours; slower)")
    ap.add_argument("--dispatcher", choices=("on", "off"), default="on", help="the agent's dispatcher setting")
    ap.add_argument("--setting", type=parse_setting, action="append", default=[], metavar="NAME=VALUE",
                    help="a further agent Settings field (repeatable), e.g. profile_interval_s=0.5")
    ap.add_argument("--gpu", type=int, default=0, help="the GPU index the alone references run on (the node's GPU)")
    ap.add_argument("--pin", action="store_true",
                    help="a logical CPU of its own for each tenant, the benchmark (agent, sampler) on the first core")
    ap.add_argument("--trace-dir", type=Path,
                    help="each tenant's shim trace there (run a trace build: make -C shim CFLAGS='-O2 -DALNAIR_TRACE'),"
                    " and the elastic scenario's turns tick by tick")
    ap.add_argument("--alone-repeat", type=int, default=2,
                    help="alone runs of each program (processes of their own); the fastest is its reference")
    a = ap.parse_args(argv)
    shapes = [s for s in a.shapes.split(",") if s]
    only = {s for s in a.only.split(",") if s}
    caps = [int(c) for c in a.caps.split(",") if c]
    bad = [s for s in shapes if s not in SHAPES] + [s for s in only if s not in SCENARIOS]
    if bad:
        ap.error(f"unknown: {', '.join(bad)}")
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if a.alone_repeat < 1:
        ap.error("--alone-repeat must be at least 1")
    cpus = CpuPlan.make() if a.pin else None
    if cpus is not None:
        cpus.pin_self()
        say(f"pinned: {cpus.describe()}")
    bench = Bench(a.shim, Windows(a.seconds), a.dispatcher, dict(a.setting), a.gpu, alone_repeat=a.alone_repeat,
                  cpus=cpus, trace_dir=a.trace_dir)
    if a.trace_dir is not None:
        a.trace_dir.mkdir(parents=True, exist_ok=True)
    steps = plan(shapes, only, caps, pack=not a.caps_one_per_node)
    record: dict[str, Any] = {}
    stopped = False
    try:
        asyncio.run(run(bench, shapes, steps, only, record, a.json, caps))
    except (asyncio.CancelledError, KeyboardInterrupt):
        stopped = True
        say("stopped")
    print("\n" + table(rows_of(shapes, record.get("alone", {}), record.get("scenarios", {}), only, caps)), flush=True)
    say(f"done in {time.time() - T0:.0f} s (estimated {record.get('estimate_s', '?')} s)")
    if a.json:
        print(f"wrote {a.json}")
    broken = unmeasured(record)
    if broken:
        say("not measured (errors): " + ", ".join(broken))
    return 1 if stopped or broken or "cut_short_at" in record else 0


def unmeasured(record: dict) -> list[str]:
    """What raised instead of giving figures: alone references and scenarios (a caps step, per shape)."""
    out = [f"alone {k}" for k, v in record.get("alone", {}).items() if "error" in v]
    for key, r in record.get("scenarios", {}).items():
        if "error" in r:
            out.append(key)
        elif key.startswith("caps"):
            out += [f"{key.split(':')[0]} {k}" for k, v in r.items() if isinstance(v, dict) and "error" in v]
    return out


if __name__ == "__main__":
    sys.exit(main())
