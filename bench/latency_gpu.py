"""The latency class on one really shared GPU (H200): issue 26's "Must hold on the H200".

An open-loop request stream in one tenant process: Poisson arrivals at each of --rates (requests/s; the schedule
drawn up front from --seed, the same in every run), each request a batch-1 inference of shares_gpu's `infer` model
with one layer, not six (STREAM_LAYERS; nn.TransformerEncoder, d 1024, 16 heads, ff 4096, 128 tokens, bf16, no_grad, the result `.float().cpu()`),
timed from its scheduled arrival to its result on the host: a request that arrives while the server is busy queues,
and its latency holds that wait, as an open-loop client sees it. Each rate is a phase of the same process: a gap
(GAP_S), a settle (--settle, not measured: the neighbour's first kernels, the dispatcher's first ticks), then
--seconds measured (requests that ARRIVE in it). A phase that falls more than --drain seconds behind its schedule
stops there: the requests it never served count as unbounded latencies (p99 "unbounded" when over 1 % of them).
Beside the stream, a neighbour tenant (--neighbours): shares_gpu's `mm` (bf16 4096x4096 matmuls back to back, CUDA
events every 4) or `train` (4-layer MLP 4096 wide, batch 512, AdamW, loss.item() every step), run for the whole
stream; its throughput is its units/s over each phase's measured window.

Every tenant is a PyTorch process started from the agent's own Allocate answers (alnair_standins.workloads.Node:
the agent in-process, NVML backend, kubelet emulator), or with plain_env (no shim) where a scenario says so. Each
sets up (model, 20 warm-up steps), waits at a start barrier (a file), runs, prints its figures at the end.

Scenarios (--only, comma-separated; default all), for each neighbour and each rate, in one run:
  (alone)          the stream alone without the shim, BEFORE and AFTER everything else (p99 spread > 10 %: that
                   rate's reference is UNSTABLE and its row fails); each neighbour alone without the shim, before
                   and after (its pace alone: the fastest). Run whenever a scenario below needs them.
  no-alnair        stream and neighbour with plain_env (the driver's time-slicing);        reference figures
  turns            node strict: stream 30 strict, neighbour 70 strict (today's turns);     reference figures
  latency          node strict: stream 30 policy latency, neighbour 70 strict;             judged
  latency-elastic  node elastic: stream 30 policy latency, neighbour 70 elastic;           judged
  flood            node strict: a latency container at 30 serving requests back to back (closed loop, batches of
                   --flood-batch, so that it asks for more than its cap) beside mm at 70 strict: its GPU time over
                   each 1 s must be <= 30 + 3. Measured as NVML per-process utilization where the driver gives
                   per-process shares (two pids in one sampling period); on a driver that gives each period to one
                   process (the H200's, RESULTS.md) that is a draw, so the figure is the proxy: its forwards per 1 s
                   / its forwards/s alone (no shim) x its NVML device utilization alone. The row says which. A flood
                   that alone uses no more than cap + 3 tests nothing: its row is a figure, not a verdict.
  idle             mm at 70 strict on a node alone, then on a node beside a latency container at 30 that sets up
                   and then does nothing (the neighbour released IDLE_QUIET_S after that container's last GPU work,
                   more than the dispatcher's LATENCY_IDLE_S): the neighbour's pace beside it >= 98 % of alone.
Goals of the judged scenarios (issue 26): p99 <= 1.25 x alone p99 and <= alone p99 + 1 ms; p50 <= 1.1 x alone p50
(alone: the lower of before/after); the neighbour >= 90 % of its pace alone x min(its cap, 100 - the latency
container's share) / 100 (elastic neighbours: (100 - share) / 100). The latency container's share: its NVML
per-process figure where the driver gives per-process shares, else the stream's NVML device utilization alone at
that rate (its own GPU time, measured without a neighbour); the row says which.
NVML device utilization is sampled every 100 ms (NvmlUtilization), per-process samples every 100 ms (pynvml
nvmlDeviceGetProcessUtilization; None where unsupported).
Under an MPS server (CUDA_MPS_PIPE_DIRECTORY exported before the run: every tenant, alone or not, is then its
client; bench/gpu_mps.sh) --neighbour-env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=70 gives the neighbour beside a stream
at most 70 % of the SMs, the rest held for the stream's kernels. Through the agent's own answers instead:
--setting mps_pipe_dir=<the daemon's pipe folder> --setting mps_shm_dir=/dev/shm (processes here share the host's).

  python3 bench/latency_gpu.py --shim /tmp/shim/libalnair.so --json $OUT/latency.json
Prints an estimate, each scenario's rows as it goes, then one table (figure, goal, pass/fail) and writes
everything to --json (rewritten after every scenario). A scenario that raises is recorded with its error and the
next one runs; SIGTERM stops the scenario under way (its tenants cleaned up) and prints what was measured. Exit
status 1 when something could not be measured or the run was stopped; goals missed are figures: 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import shares_gpu as sg
from benchstats import pct
from cpus import CpuPlan

from alnair_agent.constants import ENV_ALLOCATION_ID
from alnair_standins.workloads import Node, NvmlUtilization, plain_env, run_py  # light: heavy imports when used

# -- goals (issue 26) ----------------------------------------------------------------------------------------------
P99_FACTOR, P99_PLUS_MS = 1.25, 1.0  # p99 <= min(1.25 x alone, alone + 1 ms)
P50_FACTOR = 1.1
NEIGHBOUR_FRAC = 0.9  # the neighbour >= 90 % of what its cap and the latency container's use leave it
CAP_TOL = 3.0  # the flood: GPU time over any 1 s <= cap + 3 points
IDLE_MIN = 0.98  # beside an idle latency container, the neighbour keeps >= 98 % of its pace
REF_SPREAD = 0.10  # alone before / after further apart than this (p99): the reference is UNSTABLE

LAT_CAP, NB_CAP = 30, 70
RATES = (200.0, 500.0)
NEIGHBOURS = ("mm", "train")
FLOOD_BATCH = 32  # batch-1 back to back is host-bound (~24 % of the H200 alone): it would never ask for more than 30

# -- timing --------------------------------------------------------------------------------------------------------
GAP_S = 0.3  # before each phase of the stream (the previous phase's queue is served by then)
FLOOD_WINDOW_S = 1.0
MIN_WINDOW_S = 1.0  # a neighbour that ran beside a phase for less than this has no figure for it
IDLE_QUIET_S = 3.0  # > alnair_agent.dispatcher.control.LATENCY_IDLE_S (2 s): the idle container's last launch is past
STARTUP_S = 9.0  # a node and its tenants' Python + torch + CUDA + model set-up (overlapped), and their exits
EXIT_S = 0.6
PROC_LOOKBACK_US = 5_000_000  # per-process NVML: ask for samples this far back of the newest seen (deduplicated)

SCENARIOS = ("no-alnair", "turns", "latency", "latency-elastic", "flood", "idle")


@dataclass(frozen=True)
class Spec:
    """A stream-beside-neighbour scenario: the node's policy (None: no node, plain_env) and each tenant's."""

    label: str
    node: str | None
    stream_policy: str | None
    nb_policy: str | None
    judged: bool

    @property
    def elastic(self) -> bool:
        return self.nb_policy == "elastic"


SPECS: dict[str, Spec] = {
    "no-alnair": Spec("no Alnair (time-slicing)", None, None, None, False),
    "turns": Spec(f"turns: strict {LAT_CAP} + strict {NB_CAP}", "strict", "strict", "strict", False),
    "latency": Spec(f"latency {LAT_CAP} + strict {NB_CAP}", "strict", "latency", "strict", True),
    "latency-elastic": Spec(f"latency {LAT_CAP} + elastic {NB_CAP}", "elastic", "latency", "elastic", True),
}
PAIRS = tuple(SPECS)


@dataclass(frozen=True)
class Timing:
    seconds: float = 4.0  # a phase's measured window
    settle: float = 0.5
    drain: float = 1.0  # a phase this far behind its schedule stops
    gap: float = GAP_S

    @property
    def phase_s(self) -> float:
        return self.gap + self.settle + self.seconds

    def stream_s(self, n_rates: int) -> float:
        """A stream's loop, nominal: its phases one after another."""
        return n_rates * self.phase_s

    def neighbour_s(self, n_rates: int) -> float:
        """A neighbour beside a stream: its whole loop, and a margin of one phase's drain."""
        return self.stream_s(n_rates) + self.drain

    @property
    def alone_s(self) -> float:
        """A neighbour alone, a flood: settle + window + a margin."""
        return self.settle + self.seconds + 0.2


# -- the tenants ---------------------------------------------------------------------------------------------------
# shares_gpu's head (argv: seconds, barrier, ready; the pid file; torch) and its `infer` model, then argv[4]: a plan
# (JSON). Modes: open (phases of a Poisson schedule), flood (batches back to back), idle (sets up, then sleeps).
STREAM_TAIL = """
with open(sys.argv[4]) as f:
    plan = json.load(f)
mode = plan["mode"]
if mode == "flood":
    xb = torch.randn(plan["batch"], 128, 1024, device="cuda", dtype=torch.bfloat16)
    def serve():
        with torch.no_grad():
            m(xb)[:, -1].float().cpu()
else:
    serve = step
for _ in range(20):  # warm-up: not measured
    serve()
torch.cuda.synchronize()
""" + sg.BARRIER + """out = {"mode": mode, "born": born, "set_up": set_up, "torch": torch.__version__,
       "device": torch.cuda.get_device_name()}
if mode == "idle":
    start = time.time()
    time.sleep(seconds)
    out.update(start=start, host_end=time.time())
elif mode == "flood":
    start = time.time()
    done, end = [], start + seconds
    while time.time() < end:
        serve()
        done.append(time.time())
    out.update(start=start, host_end=time.time(), done=done, batch=plan["batch"])
else:
    phases, t_next, drain = [], time.time(), plan["drain_s"]
    for ph in plan["phases"]:
        start = t_next + plan["gap"]
        done, stopped = [], None
        for i, off in enumerate(ph["offsets"]):
            at = start + off
            while True:  # until its arrival: sleep to 1 ms before, then spin
                d = at - time.time()
                if d <= 0:
                    break
                if d > 0.002:
                    time.sleep(d - 0.001)
            if time.time() - at > drain:  # this far behind: the rest of the phase is never served
                stopped = i
                break
            serve()
            done.append(time.time())
        phases.append({"rate": ph["rate"], "start": start, "done": done, "stopped_at": stopped})
        t_next = time.time()
    out.update(start=phases[0]["start"] if phases else time.time(), host_end=time.time(), phases=phases)
print(json.dumps(out), flush=True)
"""
# The service: a small transformer, 0.2-0.3 ms of GPU work a request. shares_gpu's `infer` model with one
# layer, not six: its six (1.7 ms a request, ~460-740 requests/s at most alone on the H200 VM) cannot serve 500/s
# even alone, and a neighbour held back for whole requests of that length gives up a third of its time at 200/s.
STREAM_LAYERS = 1
_INFER_SIX = "TransformerEncoder(layer, 6)"
assert _INFER_SIX in sg.SHAPES["infer"].body, "shares_gpu's infer model changed: update STREAM_MODEL"
STREAM_MODEL = sg.SHAPES["infer"].body.replace(_INFER_SIX, f"TransformerEncoder(layer, {STREAM_LAYERS})")
STREAM_CODE = sg.TENANT_HEAD + STREAM_MODEL + STREAM_TAIL
STREAM_SHAPE = sg.Shape("stream", "request", "")  # the Tenant record's; its process runs STREAM_CODE


# -- analysis: pure functions (no torch, no GPU; tests/test_bench_latency.py) -------------------------------------
def poisson_offsets(rate: float, duration: float, seed: int) -> list[float]:
    """Arrival times (s from the phase's start) of a Poisson stream of `rate`/s over [0, duration): exponential
    gaps from a generator seeded by (seed, rate), so every run of a rate has the same schedule."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    rng = random.Random(f"alnair-latency:{seed}:{rate:g}")
    out: list[float] = []
    t = rng.expovariate(rate)
    while t < duration:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def phase_latencies(offsets: Sequence[float], start: float, done: Sequence[float],
                    settle: float) -> tuple[list[float], int]:
    """Each measured request's latency (ms, its arrival offset >= settle) from its scheduled arrival to its result
    on the host; and how many measured requests were never served (the phase stopped behind its schedule).
    Requests are served in order, so done[i] is request i's."""
    lat: list[float] = []
    unserved = 0
    for i, off in enumerate(offsets):
        if off < settle:
            continue
        if i < len(done):
            lat.append((done[i] - (start + off)) * 1e3)
        else:
            unserved += 1
    return lat, unserved


def quantile(xs: Sequence[float], q: float) -> float | None:
    """benchstats.pct; None for an unbounded figure (an unserved request ranks there) or no sample."""
    if not xs:
        return None
    v = pct(list(xs), q)
    return None if math.isinf(v) else v


def latency_stats(lat: Sequence[float], unserved: int = 0) -> dict[str, Any]:
    """p50/p90/p99/max (ms) of the measured requests, the unserved ones ranked above every served one; None where
    an unserved request falls (unbounded)."""
    xs = list(lat) + [math.inf] * unserved
    if not xs:
        raise ValueError("no request arrived in the measured window")
    return {"requests": len(xs), "completed": len(lat), "unserved": unserved,
            "p50": quantile(xs, 0.5), "p90": quantile(xs, 0.9), "p99": quantile(xs, 0.99),
            "max": None if unserved else max(xs), "mean": sum(lat) / len(lat) if lat and not unserved else None}


def spread(xs: Sequence[float | None]) -> float | None:
    """max / min - 1 of two or more figures; None with fewer, or an unbounded one among them."""
    vs = [x for x in xs if x is not None]
    if len(vs) < 2 or len(vs) < len(xs) or min(vs) <= 0:
        return None
    return max(vs) / min(vs) - 1.0


Sample = tuple[float, int, float]  # per-process NVML: (wall s, pid, sm %)
Nvml = Callable[[float, float], float]  # mean device utilization over wall [t0, t1] (NvmlUtilization.mean)


def attribution(samples: Sequence[Sample]) -> str:
    """How the driver attributes its per-process samples (as alnair_agent/gpu/nvml.py's Attribution tells it):
    'shares' when some sampling period reported two processes; 'draw' when several periods reported different
    processes but never two at once (each period given whole to one process: the H200's, driver 580); else
    'unknown' (one process, or too few periods)."""
    by: dict[float, set[int]] = {}
    for t, pid, _ in samples:
        by.setdefault(t, set()).add(pid)
    if any(len(p) > 1 for p in by.values()):
        return "shares"
    if len(by) >= 6 and len(set().union(*by.values())) >= 2:
        return "draw"
    return "unknown"


def process_share(samples: Sequence[Sample], pid: int | None, t0: float, t1: float) -> float | None:
    """The process's mean sm % over the sampling periods in [t0, t1] that reported anyone (a period without it
    counts 0); None without such periods or pid."""
    if pid is None:
        return None
    inside = [s for s in samples if t0 <= s[0] <= t1]
    periods = {t for t, _, _ in inside}
    if not periods:
        return None
    return sum(sm for _, p, sm in inside if p == pid) / len(periods)


def clock_offset(fetches: Sequence[tuple[float, int]]) -> float:
    """Seconds to add to a per-process sample's timestamp (us) for wall time: 0 when they are wall-clock us (the
    newest within 60 s of its ask), else the tightest ask time - newest timestamp (a sample is never later than
    the ask that returned it)."""
    diffs = [w - ts / 1e6 for w, ts in fetches]
    if not diffs:
        return 0.0
    d = min(diffs)
    return 0.0 if abs(d) < 60 else d


def r1(x: float | None, nd: int = 2) -> float | None:
    return sg.r1(x, nd)


def analyse_stream(out: dict, plan: dict, t: Timing, nvml: Nvml, proc: Sequence[Sample] = (),
                   pid: int | None = None) -> dict[str, dict]:
    """The stream's figures per rate (key: the rate as text), from its output and the plan it ran."""
    res: dict[str, dict] = {}
    for planned, ph in zip(plan["phases"], out.get("phases", []), strict=False):
        lat, unserved = phase_latencies(planned["offsets"], ph["start"], ph["done"], t.settle)
        w0, w1 = ph["start"] + t.settle, ph["start"] + t.settle + t.seconds
        st = latency_stats(lat, unserved)
        inside = [s for s in proc if w0 <= s[0] <= w1]
        st.update({k: r1(v, 4) for k, v in st.items() if k in ("p50", "p90", "p99", "max", "mean")})
        st.update({"window": [w0, w1], "device_nvml": r1(nvml(w0, w1), 1), "stopped_at": ph.get("stopped_at"),
                   "process_nvml": r1(process_share(inside, pid, w0, w1), 1),
                   "attribution": attribution(inside) if inside else None,
                   "p99_per_s": per_second_p99(planned["offsets"], ph["start"], ph["done"], t)})
        res[f"{planned['rate']:g}"] = st
    return res


def per_second_p99(offsets: Sequence[float], start: float, done: Sequence[float], t: Timing) -> list[float | None]:
    """p99 (ms) of the requests arriving in each whole second of the measured window (None: unbounded/empty)."""
    out: list[float | None] = []
    for k in range(int(t.seconds)):
        a, b = t.settle + k, t.settle + k + 1
        xs = [(done[i] - start - off) * 1e3 if i < len(done) else math.inf
              for i, off in enumerate(offsets) if a <= off < b]
        out.append(r1(quantile(xs, 0.99), 3))
    return out


def neighbour_rate(nb: dict, w0: float, w1: float) -> tuple[float | None, float]:
    """The neighbour's units/s over [w0, w1] clipped to its loop; None when that overlap is under MIN_WINDOW_S."""
    a, b = max(w0, nb["start"]), min(w1, nb["host_end"])
    if b - a < MIN_WINDOW_S:
        return None, max(b - a, 0.0)
    return sg.Progress(nb["marks"]).rate(a, b), b - a


def analyse_pair(stream: dict, plan: dict, nb: dict, t: Timing, nvml: Nvml, proc: Sequence[Sample] = (),
                 pid: int | None = None) -> dict:
    phases = analyse_stream(stream, plan, t, nvml, proc, pid)
    for st in phases.values():
        rate, w = neighbour_rate(nb, *st["window"])
        st["neighbour"] = {"rate": r1(rate, 1), "unit": nb["unit"], "window_s": r1(w, 3)}
    return {"phases": phases, "tenants": {"stream": tenant_record(stream), "neighbour": sg.tenant_record(nb)}}


def tenant_record(o: dict) -> dict:
    return {"mode": o.get("mode"), "setup_s": r1(o["set_up"] - o["born"], 2), "loop_s": r1(o["host_end"] - o["start"], 3),
            "torch": o.get("torch"), "device": o.get("device")}


def analyse_neighbour_alone(o: dict, t: Timing, nvml: Nvml) -> dict:
    a, b = o["start"] + t.settle, o["host_end"]
    rate = sg.Progress(o["marks"]).rate(a, b)
    if rate <= 0:
        raise ValueError("the neighbour did no work alone")
    return {"rate": rate, "unit": o["unit"], "nvml": r1(nvml(a, b), 1), "window_s": r1(b - a, 3),
            "tenant": sg.tenant_record(o)}


def count_between(times: Sequence[float], t0: float, t1: float) -> int:
    return sum(1 for x in times if t0 < x <= t1)


def analyse_flood_alone(o: dict, t: Timing, nvml: Nvml) -> dict:
    a, b = o["start"] + t.settle, o["host_end"]
    if b - a < MIN_WINDOW_S:
        raise ValueError(f"the flood ran {b - a:.2f} s after the settle: too short")
    rate = count_between(o["done"], a, b) / (b - a)
    if rate <= 0:
        raise ValueError("the flood did no work alone")
    return {"rate": rate, "batch": o["batch"], "nvml": r1(nvml(a, b), 1), "window_s": r1(b - a, 3),
            "tenant": tenant_record(o)}


def analyse_flood(o: dict, nb: dict | None, t: Timing, nvml: Nvml, proc: Sequence[Sample] = (),
                  pid: int | None = None) -> dict:
    """The flood beside a neighbour: its forwards/s and NVML per-process figure over each whole FLOOD_WINDOW_S
    after the settle (the judgement, with its alone reference, is flood_series's)."""
    t0, t1 = o["start"] + t.settle, o["host_end"]
    n = int(math.floor((t1 - t0) / FLOOD_WINDOW_S + 1e-9))
    if n < 1:
        raise ValueError(f"the flood ran {t1 - t0:.2f} s after the settle: no whole {FLOOD_WINDOW_S:g} s window")
    wins = [(t0 + i * FLOOD_WINDOW_S, t0 + (i + 1) * FLOOD_WINDOW_S) for i in range(n)]
    inside = [s for s in proc if t0 <= s[0] <= wins[-1][1]]
    res: dict[str, Any] = {
        "cap": LAT_CAP, "batch": o["batch"],
        "rate_per_s": [r1(count_between(o["done"], a, b) / FLOOD_WINDOW_S, 1) for a, b in wins],
        "process_nvml_per_s": [r1(process_share(inside, pid, a, b), 1) for a, b in wins],
        "attribution": attribution(inside) if inside else None,
        "device_nvml_per_s": [r1(nvml(a, b), 1) for a, b in wins], "tenants": {"flood": tenant_record(o)}}
    if nb is not None:
        rate, w = neighbour_rate(nb, t0, wins[-1][1])
        res["neighbour"] = {"rate": r1(rate, 1), "unit": nb["unit"], "window_s": r1(w, 3)}
        res["tenants"]["neighbour"] = sg.tenant_record(nb)
    return res


def flood_series(r: dict, ref: dict | None) -> tuple[list[float | None], str]:
    """The flood's GPU time (%) per window, and what it is: NVML per process where the driver gives per-process
    shares, else forwards / forwards alone x its NVML device utilization alone (a proxy); none without either."""
    proc = r.get("process_nvml_per_s") or []
    if r.get("attribution") == "shares" and proc and all(x is not None for x in proc):
        return list(proc), "NVML per process"
    if ref is not None and ref.get("rate") and ref.get("nvml") is not None:
        return [None if x is None else x / ref["rate"] * ref["nvml"] for x in r["rate_per_s"]], \
            "proxy: forwards / forwards alone x NVML alone"
    return [], "none (no alone reference, no per-process shares)"


def analyse_idle(without: dict, with_: dict, idle: dict | None, t: Timing) -> dict:
    """The neighbour's pace beside nothing and beside an idle latency container, each over its loop after the
    settle; how long the idle one had been quiet (since its set-up) when the neighbour's window began."""
    def rate(o: dict) -> tuple[float, float, float]:
        a, b = o["start"] + t.settle, o["host_end"]
        return sg.Progress(o["marks"]).rate(a, b), a, b

    r0, _, _ = rate(without)
    r1_, a, _ = rate(with_)
    return {"without": r1(r0, 1), "with": r1(r1_, 1), "unit": with_["unit"],
            "ratio": r1(r1_ / r0, 4) if r0 > 0 else None,
            "quiet_s": r1(a - idle["set_up"], 2) if idle is not None else None,
            "tenants": {"without": sg.tenant_record(without), "with": sg.tenant_record(with_),
                        **({"idle": tenant_record(idle)} if idle is not None else {})}}


# -- references and judgements -------------------------------------------------------------------------------------
def stream_reference(runs: Sequence[dict | None]) -> dict:
    """A rate's alone reference from the before/after runs: the lower p50 and p99 (a goal against it never
    understates what sharing cost), every run's figures, the p99 spread; unstable when over REF_SPREAD, when a run
    is missing (not checked) or unbounded."""
    ok = [r for r in runs if r is not None and "p99" in r]
    if not ok:
        return {"error": next((r["error"] for r in runs if r is not None and "error" in r), "no alone run")}
    p50s, p99s = [r["p50"] for r in ok], [r["p99"] for r in ok]
    finite50, finite99 = [x for x in p50s if x is not None], [x for x in p99s if x is not None]
    if not finite99 or not finite50:
        return {"error": "the stream alone left requests unserved (the rate is over what it serves alone)"}
    sp = spread(p99s)
    nv = [r["device_nvml"] for r in ok if r.get("device_nvml") is not None]
    return {"p50": min(finite50), "p99": min(finite99), "runs_p50": p50s, "runs_p99": p99s,
            "runs_max": [r.get("max") for r in ok], "spread": r1(sp, 4), "runs": len(ok),
            "unstable": sp is None or len(ok) < 2 or sp > REF_SPREAD,
            "device_nvml": sum(nv) / len(nv) if nv else None}


def neighbour_reference(runs: Sequence[dict | None]) -> dict:
    """A neighbour's pace alone: the fastest of before/after, their rates and spread."""
    ok = [r for r in runs if r is not None and "rate" in r]
    if not ok:
        return {"error": next((r["error"] for r in runs if r is not None and "error" in r), "no alone run")}
    best = max(ok, key=lambda r: r["rate"])
    rates = [r["rate"] for r in ok]
    return {**best, "runs": rates, "spread": r1(spread(rates), 4)}


def references(alone: dict) -> dict:
    """{'stream': {rate: ref}, 'neighbours': {shape: ref}, 'flood': ref | None} from record['alone']'s before
    and after."""
    before, after = alone.get("before") or {}, alone.get("after") or {}

    def part(run: dict, what: str) -> dict:
        """That part's figures by key; {"*": error} when the part, or the whole group, raised."""
        v = run if "error" in run else run.get(what)
        if v is None:
            return {}
        return {"*": v} if "error" in v else v

    sb, sa = part(before, "stream"), part(after, "stream")
    nb, na = part(before, "neighbours"), part(after, "neighbours")
    rates = [k for k in dict.fromkeys([*sb, *sa]) if k != "*"]
    shapes = [k for k in dict.fromkeys([*nb, *na]) if k != "*"]
    out: dict[str, Any] = {
        "stream": {k: stream_reference([sb.get(k, sb.get("*")), sa.get(k, sa.get("*"))]) for k in rates},
        "neighbours": {k: neighbour_reference([nb.get(k, nb.get("*")), na.get(k, na.get("*"))]) for k in shapes},
        "flood": before.get("flood") if "error" not in before else before}
    if "*" in sb and not rates:
        out["stream"]["*"] = sb["*"]
    if "*" in nb and not shapes:
        out["neighbours"]["*"] = nb["*"]
    return out


@dataclass(frozen=True)
class Judged:
    figure: float | None
    limit: float | None
    ok: bool


def p99_goal(p99: float | None, ref: float) -> Judged:
    limit = min(P99_FACTOR * ref, ref + P99_PLUS_MS)
    return Judged(p99, limit, p99 is not None and p99 <= limit)


def p50_goal(p50: float | None, ref: float) -> Judged:
    limit = P50_FACTOR * ref
    return Judged(p50, limit, p50 is not None and p50 <= limit)


def neighbour_target(pace: float, cap: float, share: float, elastic: bool) -> float:
    """90 % of its pace alone x what its cap and the latency container's use leave it (elastic: only the latter)."""
    left = max(0.0, 100.0 - share)
    return NEIGHBOUR_FRAC * pace * (left if elastic else min(cap, left)) / 100.0


def neighbour_goal(rate: float | None, pace: float, cap: float, share: float | None, elastic: bool) -> Judged:
    if share is None:
        return Judged(rate, None, False)
    target = neighbour_target(pace, cap, share, elastic)
    return Judged(rate, target, rate is not None and rate >= target)


def latency_share(phase: dict, ref: dict | None) -> tuple[float | None, str]:
    """The latency container's GPU share in a phase: NVML per process where the driver gives per-process shares,
    else the stream's NVML device utilization alone at that rate (its own GPU time)."""
    if phase.get("attribution") == "shares" and phase.get("process_nvml") is not None:
        return phase["process_nvml"], "NVML per process"
    if ref is not None and ref.get("device_nvml") is not None:
        return ref["device_nvml"], "its NVML alone"
    return None, "no share measured"


def flood_ok(series: Sequence[float | None], cap: float = LAT_CAP) -> bool:
    return bool(series) and all(x is not None and x <= cap + CAP_TOL for x in series)


def idle_ok(ratio: float | None) -> bool:
    return ratio is not None and ratio >= IDLE_MIN


# -- the table -----------------------------------------------------------------------------------------------------
Row = sg.Row


def ms(x: float | None) -> str:
    return "unbounded" if x is None else f"{x:.2f} ms"


def stream_alone_row(rate: str, ref: dict) -> Row:
    name = f"alone, no shim @{rate}/s"
    if "error" in ref:
        return sg.error_row("stream", name, ref["error"])
    b = lambda xs: " / ".join("unbounded" if x is None else f"{x:.2f}" for x in xs)  # noqa: E731
    sp = ref["spread"]
    note = "" if not ref["unstable"] else ("; UNSTABLE" if sp is not None else "; after: not measured")
    fig = (f"p50 {b(ref['runs_p50'])} ms, p99 {b(ref['runs_p99'])} ms"
           f"{'' if sp is None else f' (spread {100 * sp:.0f} %)'}, max {b(ref['runs_max'])} ms, "
           f"NVML {sg.fmt([ref['device_nvml']])} %{note}")
    return Row("stream", name, fig, f"(before / after; p99 spread <= {100 * REF_SPREAD:g} %)",
               False if ref["unstable"] else None)


def neighbour_alone_row(shape: str, ref: dict) -> Row:
    if "error" in ref:
        return sg.error_row(shape, "alone, no shim", ref["error"])
    sp = ref.get("spread")
    fig = f"{ref['rate']:.1f} {ref['unit']}/s, NVML {sg.fmt([ref.get('nvml')])} % (fastest of {sg.fmt(ref['runs'])}"
    fig += ")" if sp is None else f"; spread {100 * sp:.0f} %{'; UNSTABLE' if sp > REF_SPREAD else ''})"
    return Row(shape, "alone, no shim", fig, "(the neighbour's pace alone)", None)


def pair_rows(shape: str, scenario: str, r: dict, refs: dict) -> list[Row]:
    spec = SPECS[scenario]
    rows: list[Row] = []
    nref = refs.get("neighbours", {}).get(shape, {})
    pace = nref.get("rate")
    for rate, ph in r["phases"].items():
        name = f"{spec.label} @{rate}/s"
        sref = refs.get("stream", {}).get(rate, {})
        nb = ph.get("neighbour", {})
        unserved = f" ({ph['unserved']} of {ph['requests']} unserved)" if ph.get("unserved") else ""
        vs = lambda x, ref: "" if x is None or not ref else f" ({x / ref:.2f}x alone)"  # noqa: E731
        of_alone = "" if nb.get("rate") is None or not pace else f" ({100 * nb['rate'] / pace:.1f} % of alone)"
        nb_rate = "-" if nb.get("rate") is None else f"{nb['rate']:.1f}"
        nb_fig = f"{nb_rate} {nb.get('unit', '')}/s{of_alone}"
        if not spec.judged:
            rows.append(Row(shape, name, f"p50 {ms(ph['p50'])}, p99 {ms(ph['p99'])}{vs(ph['p99'], sref.get('p99'))}, "
                                         f"max {ms(ph['max'])}{unserved}; neighbour {nb_fig}", "(reference)", None))
            continue
        if "p99" not in sref:
            rows.append(Row(shape, name, f"p50 {ms(ph['p50'])}, p99 {ms(ph['p99'])}{unserved}",
                            f"no alone reference: {sref.get('error', 'not measured')}"[:90], False))
        else:
            g99, g50 = p99_goal(ph["p99"], sref["p99"]), p50_goal(ph["p50"], sref["p50"])
            rows.append(Row(shape, f"{name}: p99", f"{ms(ph['p99'])}{vs(ph['p99'], sref['p99'])}, "
                                                   f"max {ms(ph['max'])}{unserved}",
                            f"<= {g99.limit:.2f} ms (alone {sref['p99']:.2f})", g99.ok))
            rows.append(Row(shape, f"{name}: p50", f"{ms(ph['p50'])}{vs(ph['p50'], sref['p50'])}",
                            f"<= {g50.limit:.2f} ms (alone {sref['p50']:.2f})", g50.ok))
        share, source = latency_share(ph, sref if "p99" in sref else None)
        if pace is None:
            rows.append(Row(shape, f"{name}: neighbour", nb_fig,
                            f"no alone reference: {nref.get('error', 'not measured')}"[:90], False))
            continue
        g = neighbour_goal(nb.get("rate"), pace, NB_CAP, share, spec.elastic)
        frac = "100 - share" if spec.elastic else f"min({NB_CAP}, 100 - share)"
        share_txt = "no share" if share is None else f"{share:.1f} % ({source})"
        rows.append(Row(shape, f"{name}: neighbour", f"{nb_fig}; latency share {share_txt}",
                        "-" if g.limit is None else f">= {g.limit:.1f} (0.9 x alone x {frac})", g.ok))
    return rows


def flood_rows(shape: str, r: dict, ref: dict | None) -> list[Row]:
    series, source = flood_series(r, ref)
    cap = r.get("cap", LAT_CAP)
    name = f"flood: latency {cap} GPU time per {FLOOD_WINDOW_S:g} s"
    if not series:
        return [Row(shape, name, source, f"<= {cap + CAP_TOL:g}", False)]
    alone = None if ref is None else ref.get("nvml")
    asks = alone is not None and alone > cap + CAP_TOL
    top = max((x for x in series if x is not None), default=None)
    fig = f"max {sg.fmt([top])} % ({sg.fmt(series)}) [{source}]; alone {sg.fmt([alone])} %"
    goal = f"<= {cap + CAP_TOL:g}" + ("" if asks else " (alone it asks for no more: not a test)")
    return [Row(shape, name, fig, goal, flood_ok(series, cap) if asks else None)]


def idle_rows(shape: str, r: dict) -> list[Row]:
    ratio = r.get("ratio")
    fig = (f"{sg.fmt([r['with']])} vs {sg.fmt([r['without']])} {r['unit']}/s alone on the node "
           f"({'-' if ratio is None else f'{100 * ratio:.1f} %'}; idle {sg.fmt([r.get('quiet_s')])} s before)")
    return [Row(shape, f"idle latency {LAT_CAP} beside strict {NB_CAP}", fig, f">= {100 * IDLE_MIN:g} %",
                idle_ok(ratio))]


def step_rows(key: str, r: dict, refs: dict) -> list[Row]:
    """One scenario's rows (its error's, where it raised), judged against these references."""
    kind, shape = key.split(": ", 1)
    if "error" in r:
        return [sg.error_row(shape, SPECS[kind].label if kind in SPECS else kind, r["error"])]
    if kind in SPECS:
        return pair_rows(shape, kind, r, refs)
    if kind == "flood":
        return flood_rows(shape, r, refs.get("flood"))
    if kind == "idle":
        return idle_rows(shape, r)
    return []


def rows_of(rates: Sequence[str], neighbours: Sequence[str], only: set[str], record: dict) -> list[Row]:
    """The table: the alone references, then each neighbour's scenarios rate by rate, the flood, the idle one."""
    refs = references(record.get("alone", {}))
    scen = record.get("scenarios", {})
    rows: list[Row] = []
    pairs = [s for s in PAIRS if s in only]
    if pairs and record.get("alone"):
        srefs = refs["stream"]
        rows += [stream_alone_row(k, srefs.get(k, srefs.get("*", {"error": "not measured"}))) for k in rates]
        nrefs = refs["neighbours"]
        rows += [neighbour_alone_row(n, nrefs.get(n, nrefs.get("*", {"error": "not measured"}))) for n in neighbours]
    for key in plan_steps(neighbours, only):
        if key in scen:
            rows += step_rows(key, scen[key], refs)
    return rows


# -- the plan ------------------------------------------------------------------------------------------------------
def plan_steps(neighbours: Sequence[str], only: set[str]) -> list[str]:
    """Step keys in run order: the alone references before, every stream-beside-neighbour scenario, the flood, the
    idle one, the alone references after."""
    pairs = [s for s in PAIRS if s in only]
    steps = ["alone: before"] if pairs or "flood" in only else []
    steps += [f"{s}: {n}" for n in neighbours for s in pairs]
    steps += [f"{s}: mm" for s in ("flood", "idle") if s in only]
    steps += ["alone: after"] if pairs else []
    return steps


def estimate_s(steps: Sequence[str], n_rates: int, n_neighbours: int, t: Timing) -> float:
    """Wall time: each group's start-ups once (overlapped by the barriers), its loops one after another."""
    pairs = any(s.split(":")[0] in PAIRS for s in steps)
    total = 0.0
    for s in steps:
        kind = s.split(":")[0]
        if s == "alone: before":
            total += STARTUP_S + (t.stream_s(n_rates) + n_neighbours * (t.alone_s + EXIT_S) if pairs else 0.0) + \
                ((t.alone_s + EXIT_S) if "flood: mm" in steps else 0.0)
        elif s == "alone: after":
            total += STARTUP_S + t.stream_s(n_rates) + n_neighbours * (t.alone_s + EXIT_S)
        elif kind in PAIRS:
            total += STARTUP_S + t.neighbour_s(n_rates) + EXIT_S
        elif kind == "flood":
            total += STARTUP_S + t.alone_s + 0.5 + EXIT_S
        elif kind == "idle":
            total += 2 * (STARTUP_S + t.alone_s + EXIT_S) + IDLE_QUIET_S
    return total


# -- running it on the GPU -------------------------------------------------------------------------------------------
say = sg.say


class ProcessUtilization:
    """NVML's per-process utilization samples (nvmlDeviceGetProcessUtilization), asked every `interval_s` by a
    thread of this process: (wall s, pid, sm %), each (pid, timestamp) once. `error`: why there are none (e.g. not
    supported)."""

    def __init__(self, index: int, interval_s: float = 0.1) -> None:
        import pynvml

        self.nvml = pynvml
        pynvml.nvmlInit()
        self.h = pynvml.nvmlDeviceGetHandleByIndex(index)
        self.interval_s = interval_s
        self.raw: list[tuple[int, int, float]] = []  # (timestamp us, pid, sm %)
        self.fetches: list[tuple[float, int]] = []  # (wall s of an ask, newest timestamp in its answer)
        self.error: str | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="nvml-process-utilization", daemon=True)

    def _run(self) -> None:
        seen: set[tuple[int, int]] = set()
        newest = 0
        while not self.stop.wait(self.interval_s):
            try:
                got = self.nvml.nvmlDeviceGetProcessUtilization(self.h, max(newest - PROC_LOOKBACK_US, 0))
            except self.nvml.NVMLError as e:
                if getattr(e, "value", None) == self.nvml.NVML_ERROR_NOT_FOUND:  # nothing new
                    continue
                self.error = str(e)
                return
            now = time.time()
            for s in got:
                key = (int(s.pid), int(s.timeStamp))
                if key[0] and key not in seen:
                    seen.add(key)
                    self.raw.append((key[1], key[0], float(s.smUtil)))
            if got:
                newest = max(newest, max(int(s.timeStamp) for s in got))
                self.fetches.append((now, newest))

    @property
    def samples(self) -> list[Sample]:
        off = clock_offset(self.fetches)
        return [(ts / 1e6 + off, pid, sm) for ts, pid, sm in self.raw]

    def __enter__(self) -> "ProcessUtilization":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.nvml.nvmlShutdown()


class Group(sg.Tenants):
    """shares_gpu's Tenants (set up, barriers, clean-up by pid) with this benchmark's stream programs beside its
    shapes (start)."""

    def start_stream(self, name: str, env: dict[str, str], plan: dict, seconds: float) -> sg.Tenant:
        env = self.cpus.env(env) if self.cpus is not None else env
        path = self.folder / f"{name}.plan.json"
        path.write_text(json.dumps(plan))
        t = sg.Tenant(name, STREAM_SHAPE, env, seconds, self.folder)
        argv = (f"{seconds:.3f}", str(t.path("go")), str(t.path("ready")), str(path))
        t.task = asyncio.create_task(run_py(STREAM_CODE, env, *argv), name=f"tenant-{name}")
        self.all.append(t)
        return t

    async def __aenter__(self) -> "Group":
        return self

    @staticmethod
    def done(t: sg.Tenant) -> asyncio.Task:
        """Its process's task (every Tenant started here has one)."""
        if t.task is None:
            raise RuntimeError(f"tenant {t.name} was never started")
        return t.task

    @staticmethod
    def pid(t: sg.Tenant) -> int | None:
        try:
            return int(t.path("ready.pid").read_text())
        except (OSError, ValueError):
            return None


def held_back(node: Node, envs: dict[str, dict[str, str]]) -> dict[str, dict[str, float]]:
    """What /metrics shows as alnair_container_held_back(_seconds)_total, per tenant: how long and how often its
    launches were held back for a latency container (the dispatcher's counters, read from the agent in process)."""
    agent = getattr(node, "agent", None)
    dispatcher = getattr(agent, "dispatcher", None)  # a stand-in node may have none
    profiler = getattr(agent, "profiler", None)
    out: dict[str, dict[str, float]] = {}
    for name, env in envs.items():
        alloc = env.get(ENV_ALLOCATION_ID, "")
        c = dispatcher.state.get(alloc) if dispatcher is not None else None
        if c is not None:
            out[name] = {"held_s": round(c.held_s, 4), "held_count": c.held_count}
        u = profiler.usage.get(alloc) if profiler is not None else None
        if u is not None:  # its own launches' waits (its turn, or a latency container's cap over the horizon)
            out.setdefault(name, {})["waited_s"] = round(u.throttled_s, 4)
    return out


def same_gpu(*envs: dict[str, str]) -> int:
    gpus = {e["CUDA_VISIBLE_DEVICES"] for e in envs}
    if len(gpus) != 1:
        raise RuntimeError(f"the agent placed the tenants on different GPUs ({sorted(gpus)}): this needs one")
    return int(gpus.pop())


@dataclass
class Samplers:
    device: NvmlUtilization
    process: ProcessUtilization | None
    process_error: str | None = None

    @property
    def samples(self) -> list[Sample]:
        return self.process.samples if self.process is not None else []


@contextlib.contextmanager
def samplers(index: int) -> Iterator[Samplers]:
    """The device's utilization and the per-process samples, every 100 ms (per process: None where it cannot)."""
    with NvmlUtilization(index, 0.1) as nv:
        try:
            pu: ProcessUtilization | None = ProcessUtilization(index, 0.1)
            err = None
        except Exception as e:  # noqa: BLE001 - per-process figures are recorded as None
            pu, err = None, repr(e)
        if pu is None:
            yield Samplers(nv, None, err)
            return
        with pu:
            yield Samplers(nv, pu)


@dataclass
class Bench:
    shim: Path
    timing: Timing
    rates: tuple[float, ...] = RATES
    neighbours: tuple[str, ...] = NEIGHBOURS
    only: frozenset[str] = frozenset(SCENARIOS)
    gpu: int = 0
    seed: int = 1
    flood_batch: int = FLOOD_BATCH
    settings: dict[str, Any] = field(default_factory=dict)
    memory_gib: int = 12
    cpus: CpuPlan | None = None
    neighbour_env: dict[str, str] = field(default_factory=dict)  # over the neighbour's own, beside a stream only

    def node(self, policy: str) -> Node:
        return Node(self.shim, policy, "on", **self.settings)

    @property
    def pairs(self) -> list[str]:
        return [s for s in PAIRS if s in self.only]

    def open_plan(self) -> dict:
        t = self.timing
        return {"mode": "open", "gap": t.gap, "drain_s": t.drain,
                "phases": [{"rate": r, "offsets": poisson_offsets(r, t.settle + t.seconds, self.seed)}
                           for r in self.rates]}

    def stream_run_s(self) -> float:  # the stream's loop at most: every phase behind by its drain
        return self.timing.stream_s(len(self.rates)) + len(self.rates) * self.timing.drain

    async def alone(self, flood: bool) -> dict:
        """Without the shim, on the whole GPU: the stream, each neighbour, the flood (`flood`), set up together,
        run one after another. Each part's error is its own."""
        env, t = plain_env(self.gpu), self.timing
        out: dict[str, Any] = {}
        async with Group(self.cpus) as ts:
            plan = self.open_plan()
            stream = ts.start_stream("stream", env, plan, self.stream_run_s()) if self.pairs else None
            nbs = [ts.start(f"{n}-alone", n, env, t.alone_s) for n in self.neighbours] if self.pairs else []
            fl = ts.start_stream("flood", env, {"mode": "flood", "batch": self.flood_batch}, t.alone_s) \
                if flood else None
            dead = await ts.settle_ready()
            with samplers(self.gpu) as sm:
                async def one(tn: sg.Tenant, analyse: Callable[[dict], dict]) -> dict:
                    try:
                        if tn.name in dead:
                            raise RuntimeError(dead[tn.name])
                        ts.release(tn)
                        return analyse(await ts.done(tn))
                    except Exception:  # noqa: BLE001 - this part fails; the others go on
                        err = traceback.format_exc(limit=3)[-3000:]
                        say(f"  {tn.name} alone: FAILED {err.strip().splitlines()[-1]}")
                        return {"error": err}

                if stream is not None:
                    pid = ts.pid(stream)
                    r = await one(stream, lambda o: analyse_stream(o, plan, t, sm.device.mean, sm.samples, pid))
                    out["stream"] = r
                    for k, st in ({} if "error" in r else r).items():
                        say(f"  stream alone @{k}/s: p50 {ms(st['p50'])}, p99 {ms(st['p99'])}, max {ms(st['max'])}, "
                            f"NVML {sg.fmt([st['device_nvml']])} %")
                if nbs:
                    out["neighbours"] = {}
                for n, tn in zip(self.neighbours, nbs, strict=False):
                    r = await one(tn, lambda o: analyse_neighbour_alone(o, t, sm.device.mean))
                    out["neighbours"][n] = r
                    if "rate" in r:
                        say(f"  {n} alone: {r['rate']:.1f} {r['unit']}/s, NVML {sg.fmt([r['nvml']])} %")
                if fl is not None:
                    out["flood"] = await one(fl, lambda o: analyse_flood_alone(o, t, sm.device.mean))
                    if "rate" in out["flood"]:
                        say(f"  flood alone: {out['flood']['rate']:.1f} forwards/s (batch {self.flood_batch}), "
                            f"NVML {sg.fmt([out['flood']['nvml']])} %")
                out["process_nvml_error"] = sm.process_error or (sm.process.error if sm.process else None)
        return out

    async def pair(self, scenario: str, shape: str) -> dict:
        spec, t = SPECS[scenario], self.timing
        async with contextlib.AsyncExitStack() as stack:
            if spec.node is None:
                s_env = n_env = plain_env(self.gpu)
            else:
                node = await stack.enter_async_context(self.node(spec.node))
                s_env = await node.admit(LAT_CAP, self.memory_gib, spec.stream_policy)
                n_env = await node.admit(NB_CAP, self.memory_gib, spec.nb_policy)
            index = same_gpu(s_env, n_env)
            n_env = {**n_env, **self.neighbour_env}
            ts = await stack.enter_async_context(Group(self.cpus))  # left before the node stops
            plan = self.open_plan()
            stream = ts.start_stream("stream", s_env, plan, self.stream_run_s())
            nb = ts.start(shape, shape, n_env, t.neighbour_s(len(self.rates)))
            await ts.ready()
            pid = ts.pid(stream)
            with samplers(index) as sm:
                ts.release(stream, nb)
                so, no = await asyncio.gather(ts.done(stream), ts.done(nb))
            res = analyse_pair(so, plan, no, t, sm.device.mean, sm.samples, pid)
            res["process_nvml_error"] = sm.process_error or (sm.process.error if sm.process else None)
            if spec.node is not None:
                res["held_back"] = held_back(node, {"stream": s_env, "neighbour": n_env})
                say(f"  held back: {res['held_back']}")
            return res

    async def flood(self) -> dict:
        t = self.timing
        async with self.node("strict") as node, Group(self.cpus) as ts:
            f_env = await node.admit(LAT_CAP, self.memory_gib, "latency")
            n_env = await node.admit(NB_CAP, self.memory_gib, "strict")
            index = same_gpu(f_env, n_env)
            fl = ts.start_stream("flood", f_env, {"mode": "flood", "batch": self.flood_batch}, t.alone_s)
            nb = ts.start("mm", "mm", n_env, t.alone_s + 0.5)
            await ts.ready()
            pid = ts.pid(fl)
            with samplers(index) as sm:
                ts.release(fl, nb)
                fo, no = await asyncio.gather(ts.done(fl), ts.done(nb))
            res = analyse_flood(fo, no, t, sm.device.mean, sm.samples, pid)
            res["process_nvml_error"] = sm.process_error or (sm.process.error if sm.process else None)
            return res

    async def idle(self) -> dict:
        t = self.timing
        runs: dict[bool, tuple[dict, dict | None]] = {}
        for with_idle in (False, True):
            async with self.node("strict") as node, Group(self.cpus) as ts:
                n_env = await node.admit(NB_CAP, self.memory_gib, "strict")
                idle = None
                if with_idle:
                    i_env = await node.admit(LAT_CAP, self.memory_gib, "latency")
                    same_gpu(n_env, i_env)
                    idle = ts.start_stream("idle", i_env, {"mode": "idle"}, t.alone_s + 1.0)
                nb = ts.start("mm", "mm", n_env, t.alone_s)
                await ts.ready()
                if idle is not None:  # its last GPU work (the warm-up) long enough ago to count as idle
                    quiet_from = idle.path("ready").stat().st_mtime + IDLE_QUIET_S
                    await asyncio.sleep(max(0.0, quiet_from - time.time()))
                ts.release(*[x for x in (nb, idle) if x is not None])
                no = await ts.done(nb)
                io = await ts.done(idle) if idle is not None else None
                runs[with_idle] = (no, io)
        return analyse_idle(runs[False][0], runs[True][0], runs[True][1], t)

    async def step(self, key: str) -> dict:
        kind, shape = key.split(": ", 1)
        if kind == "alone":
            return await self.alone(flood=shape == "before" and "flood" in self.only)
        if kind == "flood":
            return await self.flood()
        if kind == "idle":
            return await self.idle()
        return await self.pair(kind, shape)


def gpu_record(index: int) -> dict:
    return sg.gpu_record(index)


async def run(bench: Bench, steps: Sequence[str], record: dict, json_path: Path | None = None) -> list[Row]:
    """Every step in order, each result (or its error) kept in `record` as it goes (a run cut short keeps what it
    measured); the table's rows."""
    import pynvml

    sg.with_sigterm_cancelling(asyncio.current_task())
    pynvml.nvmlInit()  # held for the whole run: no sampler's or agent's shutdown tears NVML down under another
    t = bench.timing
    rates = [f"{r:g}" for r in bench.rates]
    only = set(bench.only)
    try:
        record.update({
            "config": {"shim": str(bench.shim), "rates": list(bench.rates), "neighbours": list(bench.neighbours),
                       "only": sorted(only), "seconds": t.seconds, "settle": t.settle, "drain": t.drain,
                       "gap": t.gap, "seed": bench.seed, "flood_batch": bench.flood_batch, "settings": bench.settings,
                       "neighbour_env": bench.neighbour_env,
                       "mps_pipe": os.environ.get("CUDA_MPS_PIPE_DIRECTORY"),
                       "caps": {"latency": LAT_CAP, "neighbour": NB_CAP}, "steps": list(steps),
                       "cpus": bench.cpus.describe() if bench.cpus is not None else None},
            "gpu": gpu_record(bench.gpu), "alone": {}, "scenarios": {}})
        record["estimate_s"] = round(estimate_s(steps, len(bench.rates), len(bench.neighbours), t))
        say(f"{len(steps)} steps, {len(bench.rates)} rates, neighbours {', '.join(bench.neighbours)}; "
            f"estimated {record['estimate_s'] / 60:.1f} min")
        for key in steps:
            say(f"{key} ...")
            try:
                r = await bench.step(key)
            except Exception:  # noqa: BLE001 - recorded; the next step runs
                r = {"error": traceback.format_exc(limit=4)[-3000:]}
            except asyncio.CancelledError:  # SIGTERM (a time limit): keep what was measured, print it
                record["cut_short_at"] = key
                sg.save(json_path, record)
                say(f"stopped during {key}")
                break
            if key.startswith("alone: "):
                record["alone"][key.split(": ")[1]] = r
            else:
                record["scenarios"][key] = r
            record["elapsed_s"] = round(time.time() - sg.T0, 1)
            record["references"] = references(record["alone"])
            record["table"] = [asdict(x) for x in rows_of(rates, bench.neighbours, only, record)]
            sg.save(json_path, record)
            if key.startswith("alone: ") and "error" in r:
                say(f"  FAILED: {r['error'].strip().splitlines()[-1]}")
            for row in [] if key.startswith("alone: ") else step_rows(key, r, record["references"]):
                say(f"  {row.shape:<6} {row.scenario:<46} {row.figure}  [{row.goal}: {row.verdict}]")
        return rows_of(rates, bench.neighbours, only, record)
    finally:
        pynvml.nvmlShutdown()


def unmeasured(record: dict) -> list[str]:
    """What raised instead of giving figures: alone parts and scenarios."""
    out: list[str] = []
    for when, r in record.get("alone", {}).items():
        if "error" in r:
            out.append(f"alone {when}")
            continue
        for part in ("stream", "flood"):
            if isinstance(r.get(part), dict) and "error" in r[part]:
                out.append(f"alone {when}: {part}")
        out += [f"alone {when}: {n}" for n, v in (r.get("neighbours") or {}).items() if "error" in v]
    out += [k for k, r in record.get("scenarios", {}).items() if "error" in r]
    return out


def floats(text: str) -> tuple[float, ...]:
    try:
        xs = tuple(float(x) for x in text.split(",") if x)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not xs or any(x <= 0 for x in xs):
        raise argparse.ArgumentTypeError(f"expected positive numbers, comma-separated: {text!r}")
    return xs


def env_pair(text: str) -> tuple[str, str]:
    name, eq, value = text.partition("=")
    if not name or not eq or not name.replace("_", "").isalnum():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE with NAME of letters, digits and _, got {text!r}")
    return name, value


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shim", type=Path, default=Path("/tmp/shim/libalnair.so"))
    ap.add_argument("--json", type=Path, help="where the results go (rewritten after every step)")
    ap.add_argument("--rates", type=floats, default=RATES, help="requests/s of the open-loop stream, comma-separated")
    ap.add_argument("--neighbours", default=",".join(NEIGHBOURS),
                    help=f"comma-separated shares_gpu shapes beside the stream (default {','.join(NEIGHBOURS)})")
    ap.add_argument("--only", default=",".join(SCENARIOS), help=f"comma-separated, of {', '.join(SCENARIOS)}")
    ap.add_argument("--seconds", type=float, default=4.0, help="each rate's measured window (after --settle)")
    ap.add_argument("--settle", type=float, default=0.5, help="each rate's first seconds, not measured")
    ap.add_argument("--drain", type=float, default=1.0,
                    help="a phase this many seconds behind its schedule stops (its unserved requests: unbounded)")
    ap.add_argument("--seed", type=int, default=1, help="the arrival schedules' seed")
    ap.add_argument("--flood-batch", type=int, default=FLOOD_BATCH, help="flood: requests per forward")
    ap.add_argument("--setting", type=sg.parse_setting, action="append", default=[], metavar="NAME=VALUE",
                    help="a further agent Settings field (repeatable)")
    ap.add_argument("--neighbour-env", type=env_pair, action="append", default=[], metavar="NAME=VALUE",
                    help="a variable set for the neighbour beside a stream (not alone), over what its Allocate "
                         "answers give it (repeatable); say CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=70 under an MPS server")
    ap.add_argument("--gpu", type=int, default=0, help="the GPU index the alone references run on (the node's GPU)")
    ap.add_argument("--pin", action="store_true",
                    help="a logical CPU of its own for each tenant, the benchmark (agent, samplers) on the first core")
    a = ap.parse_args(argv)
    neighbours = tuple(s for s in a.neighbours.split(",") if s)
    only = frozenset(s for s in a.only.split(",") if s)
    bad = [s for s in neighbours if s not in sg.SHAPES or s == "infer"] + [s for s in only if s not in SCENARIOS]
    if bad:
        ap.error(f"unknown: {', '.join(bad)}")
    if a.seconds < 1 or a.settle < 0 or a.drain <= 0 or a.flood_batch < 1:
        ap.error("--seconds >= 1, --settle >= 0, --drain > 0, --flood-batch >= 1")
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    cpus = CpuPlan.make() if a.pin else None
    if cpus is not None:
        cpus.pin_self()
        say(f"pinned: {cpus.describe()}")
    bench = Bench(a.shim, Timing(a.seconds, a.settle, a.drain), tuple(a.rates), neighbours, only, a.gpu, a.seed,
                  a.flood_batch, dict(a.setting), cpus=cpus, neighbour_env=dict(a.neighbour_env))
    steps = plan_steps(neighbours, set(only))
    record: dict[str, Any] = {}
    stopped = False
    try:
        asyncio.run(run(bench, steps, record, a.json))
    except (asyncio.CancelledError, KeyboardInterrupt):
        stopped = True
        say("stopped")
    rates = [f"{r:g}" for r in bench.rates]
    print("\n" + sg.table(rows_of(rates, neighbours, set(only), record)), flush=True)
    say(f"done in {time.time() - sg.T0:.0f} s (estimated {record.get('estimate_s', '?')} s)")
    if a.json:
        print(f"wrote {a.json}")
    broken = unmeasured(record)
    if broken:
        say("not measured (errors): " + ", ".join(broken))
    return 1 if stopped or broken or "cut_short_at" in record else 0


if __name__ == "__main__":
    sys.exit(main())
