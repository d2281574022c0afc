"""Re-registration after a kubelet crash loop: how long the agent takes to register both resources once kubelet stays
up (goal: within 1 s, every time).

The real agent (simulated GPUs, no API server) and the kubelet emulator share this process and talk real gRPC over
unix sockets. Each episode (tests/crashloop.py, one seed each) kills the registered kubelet, crash-loops it for a
random 1-4 s (new kubelets that die as they start, or start and refuse every Register before they die), then starts
one that stays, and times kubelet serving -> both resources registered with their device lists. `--same-inode`
gives every kubelet.sock one inode number, as a filesystem that reuses a freed inode at once does. Prints a table,
writes JSON.

    python bench/reregister.py [--runs 40] [--same-inode] [--out bench/out/reregister.json]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from dataclasses import asdict

from benchstats import machine, pct, write_json

from alnair_agent import logs
from alnair_agent.kubelet import deviceplugin
from alnair_standins.crashloop import Episode, Outcome, run_episode
from alnair_standins.kubelet import KubeletEmulator
from alnair_standins.node import (
    node_settings,
    registered,
    remove_tree,
    running_agent,
    short_tmp,
)

GOAL_S = 1.0


async def run(runs: int, first_seed: int) -> list[Outcome]:
    root = short_tmp()
    settings = node_settings(root)
    try:
        async with KubeletEmulator(settings.device_plugin_dir, settings.pod_resources_socket) as kubelet:
            async with running_agent(settings):
                await registered(kubelet)
                outcomes = []
                for seed in range(first_seed, first_seed + runs):
                    outcome = await run_episode(kubelet, Episode.draw(seed))
                    print(f"  seed {seed:3d}: down {outcome.down_s:4.2f} s over {outcome.turns:2d} turns -> "
                          f"registered {outcome.reregister_s:5.3f} s after kubelet was back", flush=True)
                    outcomes.append(outcome)
    finally:
        remove_tree(root)
    return outcomes


def summary(outcomes: list[Outcome]) -> dict:
    times = [o.reregister_s for o in outcomes]
    return {"runs": len(times), "min_s": min(times), "p50_s": statistics.median(times), "p90_s": pct(times, 0.9),
            "max_s": max(times), "over_goal": sum(t > GOAL_S for t in times), "goal_s": GOAL_S}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--same-inode", action="store_true",
                        help="every kubelet.sock reports one inode number (a filesystem reusing inodes at once)")
    parser.add_argument("--out", default="bench/out/reregister.json")
    args = parser.parse_args()
    logs.configure("json", "error")
    if args.same_inode:
        # the same stand-in as tests/test_deviceplugin.py's inode-reused case (the module's file identity)
        deviceplugin._identity = lambda path: (1, 1) if path.exists() else None  # type: ignore[assignment]
    m = machine()
    print(f"Re-registration after a kubelet crash loop, {args.runs} episodes ({m['cpus']} CPUs, {m['cpu']}, "
          f"Python {m['python']}{', one inode for every kubelet.sock' if args.same_inode else ''})")
    outcomes = asyncio.run(run(args.runs, args.first_seed))
    s = summary(outcomes)
    print(f"{'runs':>5} {'min s':>7} {'p50 s':>7} {'p90 s':>7} {'max s':>7} {'> 1 s':>6}")
    print(f"{s['runs']:>5} {s['min_s']:>7.3f} {s['p50_s']:>7.3f} {s['p90_s']:>7.3f} {s['max_s']:>7.3f} "
          f"{s['over_goal']:>6}")
    print(f"goal: registered within {GOAL_S:g} s every time: {'met' if s['over_goal'] == 0 else 'MISSED'}")
    write_json(args.out, {"same_inode": args.same_inode, "summary": s, "episodes": [asdict(o) for o in outcomes]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
