"""Why a host-bound PyTorch loop runs at one of two paces from one process to the next (H200 VM diagnostic).

Each run is a fresh process running one shape of bench/shares_gpu.py alone (no shim) for --seconds: per step the
host time and, from CUDA events around every step, the GPU time; at the end its transparent-huge-page backing
(AnonHugePages of /proc/self/smaps_rollup) and the CPUs it ran on. Two modes of the host time with one GPU time say
the host is the cause; two GPU times say the GPU's side is.

    python3 bench/pace_modes.py --shapes infer,small --runs 6 --json $OUT/pace.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from benchstats import machine, write_json
from shares_gpu import SHAPES

from alnair_standins.workloads import plain_env, run_py

HEAD = """
import os, sys, time, json
seconds = float(sys.argv[1])
import torch
torch.manual_seed(0)
"""
TAIL = """
for _ in range(20):
    step()
torch.cuda.synchronize()
host, evs = [], []
end = time.monotonic() + seconds
while time.monotonic() < end:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = time.perf_counter_ns()
    a.record()
    step()
    b.record()
    host.append(time.perf_counter_ns() - t)
    evs.append((a, b))
torch.cuda.synchronize()
gpu = sorted(a.elapsed_time(b) * 1000 for a, b in evs)
host.sort()
def thp():
    try:
        for line in open("/proc/self/smaps_rollup"):
            if line.startswith("AnonHugePages"):
                return int(line.split()[1])
    except OSError:
        return None
cpus = sorted(os.sched_getaffinity(0))
stat = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
print(json.dumps({"steps": len(host), "host_us_p50": host[len(host) // 2] / 1e3, "host_us_p10": host[len(host) // 10] / 1e3,
                  "gpu_us_p50": gpu[len(gpu) // 2], "gpu_us_p10": gpu[len(gpu) // 10], "anon_huge_kb": thp(),
                  "last_cpu": int(stat[36]), "rate": len(host) / seconds}), flush=True)
"""


async def run(a: argparse.Namespace) -> dict:
    out = {"machine": machine(), "runs": {}}
    for path in ("/sys/kernel/mm/transparent_hugepage/enabled", "/sys/kernel/mm/transparent_hugepage/defrag"):
        try:
            out[path] = Path(path).read_text().strip()
        except OSError as e:
            out[path] = repr(e)
    print({k: v for k, v in out.items() if k.startswith("/")}, flush=True)
    for shape in a.shapes.split(","):
        code = HEAD + SHAPES[shape].body + TAIL
        rs = []
        for i in range(a.runs):
            r = await run_py(code, plain_env(0), f"{a.seconds}")
            rs.append(r)
            print(f"{shape} #{i}: {json.dumps(r)}", flush=True)
        out["runs"][shape] = rs
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="infer,small")
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    res = asyncio.run(run(a))
    if a.json:
        write_json(a.json, res)


if __name__ == "__main__":
    main()
