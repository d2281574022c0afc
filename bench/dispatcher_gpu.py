"""The dispatcher on a real GPU (issue 9's benchmarks): the agent in-process with the NVML backend and the kubelet
emulator; tenants are PyTorch processes started the way their containers would be (the Allocate answer's env and
region, the shim preloaded, CUDA_VISIBLE_DEVICES for NVIDIA_VISIBLE_DEVICES).

Scenarios (--only, comma-separated; default all):
  caps     20/30/50/70 % alone, one after another: share from the tenant's own matmul completions (CUDA events)
           and NVML GPU utilization (sampled every 100 ms, the goal's figure); settling = first time after which
           every 250 ms window stays within +-3 points of the cap, by share and by NVML.
  pair     30 % and 70 % together: throughput ratio (goal 3:7 = 0.4286 within +-10 %).
  three    20/30/50 % together: each one's % of the work the three did together, as the issue states it (goal +-3
           points), and each one's share.
  elastic  ALNAIR_COMPUTE_POLICY=elastic: a lone tenant at 30 % (share and NVML, goal >= 95 %), then one at 70 %
           starts: the lender's GPU time per 50 ms (matmuls x one matmul back to back) and the time until it is
           back at its cap (goal <= 200 ms).
  uncapped one, two and three tenants with no compute limit together: what time-slicing leaves of the GPU.
  packing  small-batch training and inference jobs, two and three, each sized to --job-s alone (whole process), one after
           another (no shim) vs together under Alnair with memory limits, with no compute limit and with elastic
           compute at an equal split: makespan (goal: elastic together >= 40 % shorter).
A share is matmuls completed x the time one matmul takes in the same tenant program running alone on the GPU with no
shim (measured first, 4 s) / wall time: 100 % is what the program does with the whole GPU to itself.

  python3 bench/dispatcher_gpu.py --shim /tmp/shim/libalnair.so --json $OUT/dispatcher_gpu.json
Prints one table per scenario and writes everything (per-window series included) as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from alnair_standins import workloads
from alnair_standins.workloads import CALIBRATE, NvmlUtilization, plain_env, run_py

# bf16 matmuls back to back for argv[1] s; an event every 4 matmuls gives when each batch completed on the GPU
TENANT = """
import json, sys, time, torch
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
t0 = torch.cuda.Event(enable_timing=True); t0.record(); torch.cuda.synchronize()
wall0 = time.time()
marks, n, end = [], 0, time.time() + float(sys.argv[1])
while time.time() < end:
    for _ in range(4):
        b = a @ a
    n += 4
    e = torch.cuda.Event(enable_timing=True); e.record(); marks.append((e, n))
torch.cuda.synchronize()
print(json.dumps({"matmuls": n, "wall0": wall0, "life_s": time.time() - wall0,
                  "marks": [[t0.elapsed_time(e) / 1000, k] for e, k in marks]}), flush=True)
"""

# Jobs print when they started (after the interpreter), were set up (model on the GPU), began and ended their loop.
TRAIN = """
import time; t_start = time.time()
import json, sys, torch
torch.manual_seed(0)
width, batch, steps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
m = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()) for _ in range(6)]).cuda()
opt = torch.optim.AdamW(m.parameters(), 1e-4)
x, y = torch.randn(batch, width, device="cuda"), torch.randn(batch, width, device="cuda")
torch.cuda.synchronize(); t_ready = time.time()
def step():
    with torch.autocast("cuda", torch.bfloat16):
        loss = torch.nn.functional.mse_loss(m(x), y)
    opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
for _ in range(20):  # warm-up (cuBLAS handles, autocast caches): not in the timed loop
    step()
torch.cuda.synchronize(); t = time.time()
for _ in range(steps):
    step()
torch.cuda.synchronize()
print(json.dumps({"seconds": time.time() - t, "steps": steps, "t": [t_start, t_ready, t, time.time()]}), flush=True)
"""

INFER = """
import time; t_start = time.time()
import json, sys, torch
torch.manual_seed(0)
d, batch, iters = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
layer = torch.nn.TransformerEncoderLayer(d, 16, 4 * d, batch_first=True)
m = torch.nn.TransformerEncoder(layer, 6).cuda().eval().to(torch.bfloat16)
x = torch.randn(batch, 128, d, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize(); t_ready = time.time()
with torch.no_grad():
    for _ in range(20):  # warm-up: not in the timed loop
        m(x)
    torch.cuda.synchronize(); t = time.time()
    for _ in range(iters):
        m(x)
torch.cuda.synchronize()
print(json.dumps({"seconds": time.time() - t, "iters": iters, "t": [t_start, t_ready, t, time.time()]}), flush=True)
"""

JOBS = {  # name: (script, args); the last argument, the step count, is a first guess that sized_jobs() resizes
    "train-mlp": (TRAIN, ["2048", "32", "6000"]),
    "infer-transformer": (INFER, ["1024", "4", "1500"]),
    "train-mlp-wide": (TRAIN, ["4096", "16", "3000"]),
}


class Node(workloads.Node):
    """workloads.Node, recording the dispatcher's control state every tick for the JSON (trace, boosts)."""

    async def __aenter__(self) -> "Node":
        await super().__aenter__()
        self._trace(self.agent)  # the agent's services (the dispatcher among them) exist once it runs
        return self

    def _trace(self, agent) -> None:
        self.trace: list[list] = []
        self.boosts: list[list] = []  # per tick: (t, GPU, lending together, device utilization read)
        d = agent.dispatcher
        if d is not None:  # every tick's state, for the JSON (t, key, cap, policy, window part, lent, wait fraction,
            # GPU time the shim counted in % of the GPU, launches)
            tick = d.tick

            def traced(now: float | None = None) -> None:
                tick(now)
                t = time.time()
                for c in d.state.values():
                    self.trace.append([round(t, 3), c.key[-6:], c.cap, c.policy, round(d.turns.get(c.key, 0.0), 3),
                                       c.key in d.lent, round(c.wait_frac, 3), round(c.gpu_rate / 1e7, 1), c.launches])
                for gpu, g in d.gpus.items():
                    self.boosts.append([round(t, 3), gpu[-6:], g.lending, g.device_util])
            d.tick = traced


def sampler(env: dict[str, str]) -> NvmlUtilization:
    """NVML GPU utilization of the tenant's GPU every 100 ms."""
    return NvmlUtilization(int(env["CUDA_VISIBLE_DEVICES"]), 0.1)


def series(r: dict, matmul_s: float, t0: float, t1: float, step: float) -> list[float]:
    """The tenant's share (%) per `step` s window over wall time [t0, t1], from its completion marks."""
    out = []
    marks = [(r["wall0"] + t, k) for t, k in r["marks"]]
    done = lambda t: max([k for tt, k in marks if tt <= t], default=0)  # noqa: E731
    t = t0
    while t + step <= t1 + 1e-9:
        out.append(100.0 * (done(t + step) - done(t)) * matmul_s / step)
        t += step
    return out


def share(r: dict, matmul_s: float, t0: float, t1: float) -> float:
    return series(r, matmul_s, t0, t1, t1 - t0)[0]


def settle_s(xs: list[float], cap: float, step: float, tol: float = 3.0) -> float | None:
    for i in range(len(xs)):
        if all(abs(x - cap) <= tol for x in xs[i:]):
            return i * step
    return None


async def caps(shim: Path, matmul_s: float, seconds: float) -> dict:
    out = {}
    for cap in (20, 30, 50, 70):
        async with Node(shim, "strict", ARGS.dispatcher) as node:  # a fresh node each: one GPU holds 100 %
            env = await node.admit(cap)
            with sampler(env) as nv:
                r = await run_py(TENANT, env, str(seconds))
            t0, t1 = r["wall0"], r["wall0"] + r["life_s"]
            xs = series(r, matmul_s, t0, t1, 0.25)
            nxs = [nv.mean(t0 + i * 0.25, t0 + (i + 1) * 0.25) for i in range(int((t1 - t0) / 0.25))]
            out[cap] = {"trace": node.trace, "share": share(r, matmul_s, t0 + 1, t1), "nvml": nv.mean(t0 + 1, t1),
                        "settle_s": settle_s(xs, cap, 0.25), "settle_nvml_s": settle_s(nxs, cap, 0.25),
                        "per_250ms": xs, "nvml_per_250ms": nxs, "nvml_samples": nv.samples}
    print("\ncaps alone (after the first second)   goal: NVML within +-3 points, settling <= 1 s")
    print(f"{'cap':>4} {'share %':>8} {'NVML %':>7} {'settle s (share)':>17} {'settle s (NVML)':>16}")
    dash = lambda x: "-" if x is None else x  # noqa: E731
    for cap, v in out.items():
        print(f"{cap:>4} {v['share']:>8.1f} {v['nvml']:>7.1f} {dash(v['settle_s']):>17} {dash(v['settle_nvml_s']):>16}")
    return out


async def together(shim: Path, matmul_s: float, seconds: float, cap_list: tuple[int, ...]) -> dict:
    """Tenants at these caps together (a cap of 0: no compute limit) from one node."""
    async with Node(shim, "strict", ARGS.dispatcher) as node:
        envs = [await node.admit(c) for c in cap_list]
        with sampler(envs[0]) as nv:
            rs = await asyncio.gather(*(run_py(TENANT, e, str(seconds)) for e in envs))
        trace = node.trace
    t0 = max(r["wall0"] for r in rs) + 1.0
    t1 = min(r["wall0"] + r["life_s"] for r in rs)
    shares = [share(r, matmul_s, t0, t1) for r in rs]
    return {"caps": cap_list, "shares": shares, "matmuls": [r["matmuls"] for r in rs], "nvml": nv.mean(t0, t1),
            "per_s": [series(r, matmul_s, t0, t1, 1.0) for r in rs], "trace": trace}


async def elastic(shim: Path, matmul_s: float, kernel_s: float) -> dict:
    """`matmul_s`: one matmul's time in the tenant program alone (the lone lender's share is of that program's own
    pace); `kernel_s`: one matmul back to back (once held at its cap the lender's matmuls run back to back, so its
    GPU time per 50 ms is counted in that)."""
    async with Node(shim, "elastic", ARGS.dispatcher) as node:
        lender_env, other_env = await node.admit(30), await node.admit(70)
        with sampler(lender_env) as nv:
            lender = asyncio.create_task(run_py(TENANT, lender_env, "12"))
            await asyncio.sleep(6.0)
            tb = time.time()
            other = await run_py(TENANT, other_env, "4")
            lr = await lender
        trace = node.trace
    xs = series(lr, kernel_s, tb, tb + 3.0, 0.05)
    alone = share(lr, matmul_s, lr["wall0"] + 1.0, tb)
    alone_nvml = nv.mean(lr["wall0"] + 1.0, tb)
    # the second tenant's process start includes CUDA start-up: count from its first completed matmul
    first = other["wall0"] + other["marks"][0][0] if other["marks"] else tb
    ys = series(lr, kernel_s, first, first + 2.0, 0.05)
    back = next((i * 0.05 for i in range(len(ys)) if all(y <= 33 for y in ys[i:])), None)
    print("\nelastic (policy elastic, lender capped at 30 %)   goal: alone >= 95 %, back at its cap <= 200 ms")
    print(f"lender alone {alone:.1f} % (NVML {alone_nvml:.1f} %); second tenant's first matmul {first - tb:.2f} s after its start; lender back at"
          f" <= 33 % after {back if back is not None else '-'} s; lender per 50 ms from then: "
          f"{[round(y) for y in ys[:20]]}")
    return {"trace": trace, "alone": alone, "alone_nvml": alone_nvml, "back_s": back, "lender_per_50ms_from_second_start": xs,
            "lender_per_50ms_from_second_first_matmul": ys, "second_start_delay_s": first - tb}


async def timed(code: str, env: dict[str, str], *a: str) -> dict:
    """run_py, with the job's own times framed by when its process was spawned and when it exited."""
    spawn = time.time()
    r = await run_py(code, env, *a)
    return {**r, "t": [spawn, *r["t"], time.time()]}  # spawned, started, set up, loop began, loop ended, exited


async def sized_jobs(plain: dict[str, str], names: list[str], seconds: float) -> dict[str, list[str]]:
    """Each job's arguments with its step count set so that its whole process runs `seconds` alone on this GPU:
    packing can only shorten a makespan down to its longest job, so jobs of unequal length would measure that, not
    Alnair. Whole processes, because the makespan is one: the jobs' set-up (Python, torch, CUDA, the model) differs
    by seconds (the H200: 4 to 11 s), so jobs sized by their loops alone still ran 22.7 s and 12.1 s."""
    out = {}
    for name in names:
        code, args = JOBS[name]
        probe = max(1, int(args[-1]) // 8)
        r = await timed(code, plain, *args[:-1], str(probe))
        overhead = (r["t"][-1] - r["t"][0]) - r["seconds"]
        loop_s = max(seconds - overhead, 3.0)
        out[name] = [*args[:-1], str(max(1, round(probe * loop_s / r["seconds"])))]
    return out


async def packing(shim: Path) -> dict:
    """Jobs one after another (no shim) vs together: with no compute limits (the shim for memory limits only) and
    under the elastic policy at an equal split of the GPU. Makespans are wall times of whole processes."""
    plain = plain_env()
    groups = [g for g in (("train-mlp", "infer-transformer"), ("train-mlp", "infer-transformer", "train-mlp-wide"))
              if len(g) in ARGS.packing_groups]
    names = [n for n in JOBS if any(n in g for g in groups)]
    args = await sized_jobs(plain, names, ARGS.job_s)
    alone, loop_s, alone_phases = {}, {}, {}
    for name in names:  # the median of --repeat runs: a set-up alone varies by seconds from run to run
        rs = sorted([await timed(JOBS[name][0], plain, *args[name]) for _ in range(ARGS.repeat)],
                    key=lambda r: r["t"][-1] - r["t"][0])
        r = rs[len(rs) // 2]
        loop_s[name], alone[name] = r["seconds"], r["t"][-1] - r["t"][0]
        alone_phases[name] = [round(b - a, 3) for a, b in zip(r["t"], r["t"][1:], strict=False)]
    out: dict = {"args": args, "alone_s": alone, "alone_loop_s": loop_s, "alone_phases": alone_phases}

    async def together(group: tuple[str, ...], cap: int, policy: str) -> dict:
        async with Node(shim, policy, ARGS.dispatcher) as node:
            envs = [await node.admit(cap, memory_gib=24) for _ in group]
            with sampler(envs[0]) as nv:
                t = time.time()
                rs = await asyncio.gather(*(timed(JOBS[n][0], e, *args[n]) for n, e in zip(group, envs, strict=False)))
                tog = time.time() - t
            return {"together_s": tog, "loop_s": [r["seconds"] for r in rs], "nvml": nv.mean(t, t + tog),
                    "phases": [[round(x - t, 3) for x in r["t"]] for r in rs], "trace": node.trace,
                    "boost": node.boosts}

    for group in groups:
        seq = sum(alone[n] for n in group)
        cap = 100 // len(group)
        runs: dict[str, list[dict]] = {"no_compute_limit": [], "elastic": []}
        for _ in range(ARGS.repeat):  # alternated, so a drift of the machine falls on both alike
            runs["no_compute_limit"].append(await together(group, 0, "elastic"))
            runs["elastic"].append(await together(group, cap, "elastic"))
        res = {"sequential_s": seq, "cap": cap, "bound": 1 - max(alone[n] for n in group) / seq}
        for mode, rs in runs.items():
            for r in rs:
                r["shorter"] = 1 - r["together_s"] / seq
            res[mode] = {**rs[0], "runs": [{k: v for k, v in r.items() if k not in ("trace", "boost")} for r in rs],
                         "together_s": statistics.median(r["together_s"] for r in rs),
                         "nvml": statistics.median(r["nvml"] for r in rs)}
            res[mode]["shorter"] = 1 - res[mode]["together_s"] / seq
        out["+".join(group)] = res
    print(f"\npacking (memory limit 24 GiB each; jobs sized to {ARGS.job_s:.0f} s alone, whole process)   "
          "goal: elastic together >= 40 % shorter")
    print("alone (process s / loop s): " + ", ".join(f"{n} {alone[n]:.1f}/{loop_s[n]:.1f}" for n in names))
    print(f"{'jobs':<48} {'one after another s':>20} {'no limit s':>11} {'shorter':>8} {'elastic s':>10} {'shorter':>8}"
          f" {'NVML %':>7}")
    for k, v in out.items():
        if isinstance(v, dict) and "sequential_s" in v:
            f, e = v["no_compute_limit"], v["elastic"]
            print(f"{k:<48} {v['sequential_s']:>20.1f} {f['together_s']:>11.1f} {100 * f['shorter']:>7.1f}%"
                  f" {e['together_s']:>10.1f} {100 * e['shorter']:>7.1f}% {e['nvml']:>7.1f}")
    if ARGS.repeat > 1:
        print(f"(medians of {ARGS.repeat} runs each, alternated)")
    print("\nwhere the time went, per run and job (s from the group's start): python up / set up / warm-up / loop /"
          " exit, and when it exited")
    print("alone, no shim: " + "  ".join(f"{n}: " + "/".join(f"{x:.1f}" for x in ph) for n, ph in alone_phases.items()))
    for k, v in out.items():
        if isinstance(v, dict) and "sequential_s" in v:
            for mode in ("no_compute_limit", "elastic"):
                for i, r in enumerate(v[mode]["runs"]):
                    jobs = "  ".join(f"{n}: " + "/".join(f"{b - a:.1f}" for a, b in zip(ph, ph[1:], strict=False)) + f" @{ph[-1]:.1f}"
                                     for n, ph in zip(k.split("+"), r["phases"], strict=False))
                    print(f"{k[:20]:<20} {mode:<17} #{i} {r['together_s']:>5.1f} s  {jobs}")
    return out


async def main() -> dict:
    import pynvml

    pynvml.nvmlInit()  # held for the whole run, so no agent's or sampler's shutdown ever tears NVML down under another
    results: dict = {"dispatcher": ARGS.dispatcher}
    plain = plain_env()
    calib = await run_py(CALIBRATE, plain)
    results["matmul_kernel_s"] = calib["matmul_s"]
    alone = await run_py(TENANT, plain, "4")
    ms = results["matmul_s"] = alone["marks"][-1][0] / alone["marks"][-1][1]
    print(f"one bf16 4096^3 matmul: {calib['matmul_s'] * 1e3:.3f} ms back to back; {ms * 1e3:.3f} ms per matmul in the"
          " tenant program alone (the 100 % of a share)")
    only = set(ARGS.only.split(","))
    if "caps" in only:
        results["caps"] = await caps(ARGS.shim, ms, 8.0)
    if "pair" in only:
        p = results["pair"] = await together(ARGS.shim, ms, 12.0, (30, 70))
        ratio = p["matmuls"][0] / p["matmuls"][1]
        p["ratio"] = ratio
        print(f"\npair 30/70: shares {p['shares'][0]:.1f} / {p['shares'][1]:.1f} %, throughput ratio {ratio:.3f} "
              f"(3:7 = 0.429, {100 * (ratio / (3 / 7) - 1):+.1f} %; goal within +-10 %)")
    if "three" in only:
        t = results["three"] = await together(ARGS.shim, ms, 12.0, (20, 30, 50))
        t["of_work"] = [100 * x / sum(t["shares"]) for x in t["shares"]]
        print("\nthree 20/30/50: % of the work the three did together " + " / ".join(f"{s:.1f}" for s in t["of_work"])
              + " (goal each +-3); relative to the program alone " + " / ".join(f"{s:.1f}" for s in t["shares"]))
    if "uncapped" in only:  # what time-slicing between contexts leaves of the GPU: no compute limits at all
        for n in (1, 2, 3):
            u = results[f"uncapped{n}"] = await together(ARGS.shim, ms, 8.0, (0,) * n)
            print(f"\n{n} uncapped together: shares " + " / ".join(f"{s:.1f}" for s in u["shares"])
                  + f" %, sum {sum(u['shares']):.1f} %, NVML {u['nvml']:.1f} %")
    if "elastic" in only:
        results["elastic"] = await elastic(ARGS.shim, ms, results["matmul_kernel_s"])
    if "packing" in only:
        results["packing"] = await packing(ARGS.shim)
    return results


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shim", type=Path, default=Path("/tmp/shim/libalnair.so"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--only", default="caps,pair,three,elastic,packing")
    ap.add_argument("--packing-groups", type=lambda v: {int(x) for x in v.split(",")}, default={2, 3},
                    help="packing: which groups to run, by size (2, 3)")
    ap.add_argument("--repeat", type=int, default=1, help="packing: runs of each job alone and of each group together (medians reported)")
    ap.add_argument("--job-s", type=float, default=20.0, help="packing: each job's whole process alone, seconds")
    ap.add_argument("--dispatcher", choices=("on", "off"), default="on",
                    help="off: the same runs with no turns laid out (each shim its cap's part of the default period), for "
                         "comparison")
    ap.add_argument("--log-level", choices=("debug", "info", "warning"), default="warning",
                    help="the in-process agent's log level (info: its dispatcher's lending decisions, among others)")
    ARGS = ap.parse_args()
    import logging

    import structlog
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, ARGS.log_level.upper())))
    res = asyncio.run(main())
    if ARGS.json:
        ARGS.json.write_text(json.dumps(res, indent=1, default=str))
        print(f"\nwrote {ARGS.json}")
