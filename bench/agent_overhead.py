"""The agent's own cost with the profiler on: CPU (% of one core) and RSS with 32 simulated containers at the
default intervals (profile 1 s, annotate 30 s, resync 5 s, health 1 s) over 60 s. Goal: <= 3 % of one core and
<= 80 MB RSS.

The agent runs as its own process (`python -m alnair_agent.main`, simulated GPUs reading the simulated driver's
shared timelines, pods from the API server stand-in through a kubeconfig, /metrics on). This process runs the API
server stand-in and the kubelet emulator, admits 32 one-container pods, and starts one real process per container
under the real shim against the simulated driver (Allocate's env; a 10 ms kernel every 0.5 s: 2 % duty), so every
profiler tick places 32 processes through /proc and writes their figures; /metrics is scraped every 15 s. The
agent's CPU comes from /proc/<pid>/stat (utime + stime) over the window, its RSS from /proc/<pid>/status (VmRSS)
sampled every second.

    python bench/agent_overhead.py [--containers 32] [--seconds 60] [--out bench/out/agent_overhead.json]
                                   [--agent-tree PATH]   (another checkout's agent, e.g. before the profiler,
                                                          given only the variables it knows: for comparison)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from benchstats import machine

from alnair_agent import logs
from alnair_agent.constants import RESOURCE_COMPUTE, RESOURCE_MEMORY
from alnair_standins.apiserver import FakeApiServer, make_pod
from alnair_standins.kubelet import KubeletEmulator
from alnair_standins.node import NODE, remove_tree, short_tmp
from alnair_standins.simbuild import build_shim_and_driver

ROOT = Path(__file__).resolve().parents[1]

TICKS = os.sysconf("SC_CLK_TCK")




def cpu_seconds(pid: int) -> float:
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run(containers: int, seconds: float, agent_tree: Path | None = None, compute: int = 0,
              profile_agent: Path | None = None, agent_env: dict[str, str] | None = None) -> dict:
    root = short_tmp()
    procs: list[asyncio.subprocess.Process] = []
    agent = None
    try:
        built = build_shim_and_driver(root / "build")
        shim, sim = built.shim, built.sim
        timelines = root / "timelines"
        port = free_port()
        async with FakeApiServer() as api:
            api.add_node(NODE)
            kubeconfig = root / "kubeconfig"
            kubeconfig.write_text(
                "apiVersion: v1\nkind: Config\n"
                f"clusters: [{{name: s, cluster: {{server: \"{api.host}\"}}}}]\n"
                "users: [{name: a, user: {token: t}}]\n"
                "contexts: [{name: c, context: {cluster: s, user: a}}]\ncurrent-context: c\n")
            env = {k: v for k, v in os.environ.items() if not k.startswith("ALNAIR_")}
            env.update({
                "KUBECONFIG": str(kubeconfig), "ALNAIR_NODE_NAME": NODE, "ALNAIR_KUBERNETES": "auto",
                "ALNAIR_DEVICE_PLUGIN_DIR": str(root / "dp"), "ALNAIR_POD_RESOURCES_SOCKET": str(root / "pr/k.sock"),
                "ALNAIR_WORKSPACE": str(root / "ws"), "ALNAIR_SHIM_DIR": str(shim.parent),
                "ALNAIR_GPU_BACKEND": "simulated", "ALNAIR_SIM_GPUS": "2x80GiB",
                "ALNAIR_SIM_TIMELINE_DIR": str(timelines), "ALNAIR_METRICS_PORT": str(port),
                "ALNAIR_LOG_LEVEL": "warning",
                # the pods come without alnair-scheduler's decision: the agent places them itself, as it did
                # before it refused unscheduled pods
                "ALNAIR_PLACE_UNSCHEDULED": "true",
            })
            env.update(agent_env or {})
            if agent_tree is not None:
                env["PYTHONPATH"] = str(agent_tree)
                env.pop("ALNAIR_SIM_TIMELINE_DIR")
                env.pop("ALNAIR_PLACE_UNSCHEDULED")
            async with KubeletEmulator(root / "dp", root / "pr/k.sock") as kubelet:
                log = open(root / "agent.log", "wb")
                profiling = ["-m", "cProfile", "-o", str(profile_agent)] if profile_agent else []
                agent = subprocess.Popen([sys.executable, *profiling, "-m", "alnair_agent.main"], env=env, stdout=log,
                                         stderr=subprocess.STDOUT, cwd=agent_tree or ROOT)
                await kubelet.wait_for(lambda k: len(k.plugins) == 2 and all(v.devices for v in k.plugins.values()),
                                       60)
                for n in range(containers):
                    api.add_pod(make_pod(f"job-{n:02d}", node=NODE, containers=[
                        {"name": "main", "memory": 1, **({"compute": compute} if compute else {})}]))
                await asyncio.sleep(1.0)  # the agent's pod watch takes them in
                for n in range(containers):
                    answers = await kubelet.admit("default", f"job-{n:02d}", "main",
                                                  {RESOURCE_MEMORY: 1, **({RESOURCE_COMPUTE: compute} if compute else {})})
                    a = answers[RESOURCE_MEMORY]
                    run_dir = next(m.host_path for m in a.mounts if m.container_path == "/run/alnair")
                    penv = {k: v for k, v in os.environ.items() if not k.startswith(("ALNAIR_", "LD_"))}
                    penv.update(dict(a.envs))  # then the host's view of the container's paths:
                    penv.update({"LD_LIBRARY_PATH": str(sim), "LD_PRELOAD": str(shim),
                                 "ALNAIR_REGION": f"{run_dir}/region", "ALNAIR_CONTEXT_BYTES": "0",
                                 "SIMCUDA_TIMELINE_DIR": str(timelines)})
                    cycles = int((seconds + 15) / 0.5)
                    ops = ["init", "ctx", "alloc:1048576"] + ["burst:1:10000000", "sleep:490"] * cycles
                    procs.append(await asyncio.create_subprocess_exec(
                        str(sim / "simapp"), *ops, env=penv, stdout=asyncio.subprocess.DEVNULL,
                        stderr=asyncio.subprocess.DEVNULL))
                await asyncio.sleep(5.0)  # warm: every container has processes on the timeline
                scrapes = 0
                rss: list[int] = []
                cpu0, t0 = cpu_seconds(agent.pid), time.monotonic()
                async with aiohttp.ClientSession() as http:
                    next_scrape = t0
                    while time.monotonic() - t0 < seconds:
                        if time.monotonic() >= next_scrape:
                            async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
                                metrics = await resp.text()
                            scrapes += 1
                            next_scrape += 15.0
                        rss.append(rss_bytes(agent.pid))
                        await asyncio.sleep(1.0)
                cpu1, t1 = cpu_seconds(agent.pid), time.monotonic()
                usage = json.loads(api.pod_annotations("default", "job-00").get("ai.centaurus.io/usage", "{}"))
                patches = sum(1 for p in api.patches if p.kind == "pod")
                series = sum(1 for ln in metrics.splitlines() if ln.startswith("alnair_container_gpu_utilization"))
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()
        if agent is not None:
            agent.terminate()
            agent.wait(10)
        remove_tree(root)
    wall = t1 - t0
    return {
        "containers": containers,
        "compute_percent": compute,
        "agent_env": agent_env or {},
        "agent_tree": str(agent_tree or ROOT),
        "seconds": round(wall, 1),
        "intervals": {"profile_s": 1.0, "annotate_s": 30.0, "resync_s": 5.0, "health_s": 1.0},
        "agent_cpu_percent_of_one_core": round(100 * (cpu1 - cpu0) / wall, 2),
        "agent_rss_max_mb": round(max(rss) / 1e6, 1),
        "agent_rss_mean_mb": round(sum(rss) / len(rss) / 1e6, 1),
        "pod_patches_total": patches,
        "metrics_scrapes": scrapes,
        "container_series_in_last_scrape": series,
        "job-00_usage": usage.get("main"),
        "machine": machine(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--containers", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--out", default="bench/out/agent_overhead.json")
    parser.add_argument("--agent-tree", type=Path, default=None)
    parser.add_argument("--compute", type=int, default=0,
                        help="each container's compute cap (%%; 0: none): capped containers make the dispatcher steer "
                             "them and the profiler sample every ALNAIR_DISPATCH_PROFILE_INTERVAL_S")
    parser.add_argument("--profile-agent", type=Path, default=None,
                        help="run the agent under cProfile, its stats written here at exit (a diagnostic)")
    parser.add_argument("--agent-env", action="append", default=[], metavar="ALNAIR_X=V",
                        help="a setting for the agent (repeatable), e.g. ALNAIR_DISPATCHER=off")
    args = parser.parse_args()
    logs.configure("json", "error")
    agent_env = dict(kv.split("=", 1) for kv in args.agent_env)
    r = asyncio.run(run(args.containers, args.seconds, args.agent_tree, args.compute, args.profile_agent, agent_env))
    capped = f"capped at {r['compute_percent']} %" if r["compute_percent"] else "uncapped"
    print(f"Agent overhead ({r['agent_tree']}), {r['containers']} simulated containers ({capped}), default intervals, {r['seconds']} s "
          f"({r['machine']['cpus']} CPUs, {r['machine']['cpu']}, Python {r['machine']['python']})")
    print(f"{'figure':34} {'value':>10} {'goal':>10}")
    print(f"{'agent CPU, % of one core':34} {r['agent_cpu_percent_of_one_core']:>10.2f} {'<= 3':>10}")
    print(f"{'agent RSS max, MB':34} {r['agent_rss_max_mb']:>10.1f} {'<= 80':>10}")
    print(f"{'agent RSS mean, MB':34} {r['agent_rss_mean_mb']:>10.1f} {'':>10}")
    print(f"{'pod patches (all pods)':34} {r['pod_patches_total']:>10} {'':>10}")
    print(f"{'container series per scrape':34} {r['container_series_in_last_scrape']:>10} {'':>10}")
    ok = r["agent_cpu_percent_of_one_core"] <= 3 and r["agent_rss_max_mb"] <= 80
    print(f"goal: {'met' if ok else 'MISSED'}; job-00 usage: {json.dumps(r['job-00_usage'])}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
