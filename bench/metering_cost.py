"""What the shim's compute meter costs a launch-bound PyTorch job running alone on the GPU (issue 9's packing jobs).

Each job (bench/dispatcher_gpu.py's small-batch training and inference) runs alone, in these modes, alternated over
--rounds so a drift of the machine falls on all alike:
  no shim          the plain process;
  memory only      the shim with a region that caps memory only: launches are counted, nothing more;
  metered          the region also caps compute, with a window of all but 1 us of each period, so the turn gate
                   never holds a launch back: every launch takes the metered path (the gate, an event pair on 1 launch
                   in 256, a fence every 256, the in-flight bound), so the loop's extra time is the meter's own cost;
  metered, variant the metered mode under another build of the shim (--variant), e.g. one with fewer events:
                   make -C shim BUILD=/tmp/shim-few CFLAGS="-O2 -DSAMPLE_EVERY=4096u -DFENCE_EVERY=1024u ..."
Prints each job's loop time per mode (median, min, max) and its slowdown against no shim; writes JSON.

  python3 bench/metering_cost.py --shim /tmp/shim/libalnair.so --json $OUT/metering_cost.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path

from dispatcher_gpu import INFER, TRAIN

from alnair_agent.node.region import Region, Turn, monotonic_ns
from alnair_standins.workloads import plain_env, run_py

JOBS = {"train-mlp": (TRAIN, ["2048", "32"]), "infer-transformer": (INFER, ["1024", "4"])}
MODES = ("no shim", "memory only", "metered")


def region_for(tmp: Path, mode: str, n: int) -> Path:
    path = tmp / f"region-{n}"
    r = Region.create(path, 64 << 30, 0 if mode == "memory only" else 50)
    try:
        if mode.startswith("metered"):
            r.set_turn(Turn(monotonic_ns(), 50_000_000, 0, 50_000_000 - 1_000))  # the gate never holds a launch
    finally:
        r.close()
    return path


async def main(a: argparse.Namespace) -> dict:
    plain = plain_env()
    steps = {"train-mlp": a.train_steps, "infer-transformer": a.infer_steps}
    modes = MODES + (("metered, variant",) if a.variant else ())
    jobs = {j: JOBS[j] for j in a.jobs.split(",")}
    loops: dict[str, dict[str, list[float]]] = {j: {m: [] for m in modes} for j in jobs}
    with tempfile.TemporaryDirectory() as d:
        tmp, n = Path(d), 0
        for _ in range(a.rounds):
            for job, (code, args) in jobs.items():
                for mode in modes:
                    n += 1
                    shim = a.variant if mode.endswith("variant") else a.shim
                    env = plain if mode == "no shim" else {
                        **plain, "LD_PRELOAD": str(shim), "ALNAIR_REGION": str(region_for(tmp, mode, n))}
                    r = await run_py(code, env, *args, str(steps[job]))
                    loops[job][mode].append(r["seconds"])
    out: dict = {"steps": steps, "rounds": a.rounds, "loop_s": loops, "slowdown": {}}
    print(f"{'job':<20} {'mode':<16} {'loop s median':>14} {'min':>7} {'max':>7} {'vs no shim':>11}")
    for job, by_mode in loops.items():
        base = statistics.median(by_mode["no shim"])
        for mode, xs in by_mode.items():
            med = statistics.median(xs)
            out["slowdown"].setdefault(job, {})[mode] = med / base - 1
            print(f"{job:<20} {mode:<16} {med:>14.2f} {min(xs):>7.2f} {max(xs):>7.2f} {100 * (med / base - 1):>+10.1f}%")
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shim", type=Path, default=Path("/tmp/shim/libalnair.so"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--jobs", default=",".join(JOBS), help="comma-separated: " + ", ".join(JOBS))
    ap.add_argument("--variant", type=Path, help="another build of the shim, run as 'metered, variant'")
    ap.add_argument("--train-steps", type=int, default=1600)
    ap.add_argument("--infer-steps", type=int, default=3500)
    args = ap.parse_args()
    res = asyncio.run(main(args))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
        print(f"\nwrote {args.json}")
