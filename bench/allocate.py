"""Allocate latency through the kubelet emulator with 100 pods on the node (goal: p99 <= 10 ms).

The real agent (simulated GPUs, pods from the API server stand-in) and the kubelet emulator run in this process
over real unix-socket gRPC. Each of 100 pods is admitted the way kubelet does it (GetPreferredAllocation then
Allocate, per resource); we time each Allocate call as kubelet sees it. Prints a table, writes JSON.

    python bench/allocate.py [--pods 100] [--out bench/out/allocate.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

from benchstats import machine, pct

from alnair_agent import logs
from alnair_agent.config import parse_sim_gpus
from alnair_agent.constants import RESOURCE_COMPUTE, RESOURCE_MEMORY
from alnair_standins.apiserver import FakeApiServer, make_pod
from alnair_standins.kubelet import KubeletEmulator
from alnair_standins.node import (
    NODE,
    kubernetes_for,
    node_settings,
    registered,
    remove_tree,
    running_agent,
    short_tmp,
)


async def run(pods: int) -> dict:
    root = short_tmp()
    # 8 GPUs of 80 GiB: room for 100 pods of 4 GiB + 6 % each.
    settings = node_settings(root, sim_gpus=parse_sim_gpus("8x80GiB"), resync_interval_s=1.0)
    timings: dict[str, list[float]] = {"Allocate": [], "GetPreferredAllocation": [], "admit": [],
                                       "reconcile pass": []}
    try:
        async with FakeApiServer() as api, KubeletEmulator(settings.device_plugin_dir,
                                                           settings.pod_resources_socket) as kubelet:
            client = api.api_client()
            kubernetes = kubernetes_for(client)
            async with running_agent(settings, kubernetes) as running:
                await registered(kubelet)
                for n in range(pods):
                    name = f"pod-{n:03d}"
                    api.add_pod(make_pod(name, node=NODE, containers=[{"name": "main", "memory": 4, "compute": 6}]))
                # The pods were bound over time in a real cluster: let the watch take them in before timing.
                while len(kubernetes.pods.pods()) < pods:
                    await asyncio.sleep(0.05)
                for n in range(pods):
                    start = time.perf_counter()
                    await kubelet.admit("default", f"pod-{n:03d}", "main", {RESOURCE_MEMORY: 4, RESOURCE_COMPUTE: 6})
                    timings["admit"].append((time.perf_counter() - start) * 1e3)
                for rpc, _resource, seconds in kubelet.call_times:
                    timings[rpc].append(seconds * 1e3)
                for _ in range(20):  # one reconciliation pass over all 100 allocations (it shares the loop)
                    t0 = time.perf_counter()
                    await running.agent.reconciler.once()
                    timings["reconcile pass"].append((time.perf_counter() - t0) * 1e3)
            await client.close()
    finally:
        remove_tree(root)
    return {
        "pods": pods,
        "machine": machine(),
        "results": {
            name: {"n": len(v), "p50_ms": statistics.median(v), "p99_ms": pct(v, 0.99), "max_ms": max(v)}
            for name, v in timings.items()
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=100)
    parser.add_argument("--out", default="bench/out/allocate.json")
    args = parser.parse_args()
    logs.configure("json", "error")
    report = asyncio.run(run(args.pods))
    print(f"Allocate latency, {args.pods} pods on the node ({report['machine']['cpus']} CPUs, "
          f"Python {report['machine']['python']})")
    print(f"{'call':24} {'n':>5} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for name, r in report["results"].items():
        print(f"{name:24} {r['n']:>5} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} {r['max_ms']:>8.2f}")
    goal = report["results"]["Allocate"]["p99_ms"] <= 10.0
    print(f"goal p99 Allocate <= 10 ms: {'met' if goal else 'MISSED'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
