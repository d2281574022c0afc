"""The demo's device plugin run: the real agent on simulated GPUs against the kubelet emulator (real gRPC over unix
sockets in a temporary folder) admits four containers as kubelet would. Three of them then run a CUDA workload
(`simapp`) through the real shim (`libalnair.so`, preloaded as the container runtime would, with the env and mounts
Allocate returned) against the simulated driver, whose per-GPU timelines are what the agent's profiler samples, as
it samples NVML on a real node. A table refreshes every second (container, GPU, cap, measured utilization, memory
used/limit, time throttled), then a summary.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from pathlib import Path
from typing import TextIO

from alnair_agent.app import Agent
from alnair_agent.config import Settings, parse_sim_gpus
from alnair_agent.constants import (
    ENV_COMPUTE_LIMIT,
    ENV_MEMORY_LIMIT,
    ENV_VISIBLE_DEVICES,
    RESOURCE_COMPUTE,
    RESOURCE_MEMORY,
)
from alnair_agent.demo.common import (
    DEMO_WORKLOADS,
    DemoResult,
    DemoUnavailable,
    Row,
    answers_env,
    container_env,
    failure,
    gib,
    start_workload,
    watch_workloads,
)
from alnair_agent.kube.wiring import pod_resources_lister
from alnair_agent.shim_install import install_shim
from alnair_standins.gpu import SimulatedBackend
from alnair_standins.kubelet import AdmissionError, KubeletEmulator
from alnair_standins.simdriver import simulated_driver


async def demo(root: Path, seconds: float = 15.0, out: TextIO = sys.stdout) -> DemoResult:
    sim = simulated_driver(root / "sim")
    timelines = root / "timelines"
    settings = Settings(
        node_name="demo-node",
        device_plugin_dir=root / "device-plugins",
        pod_resources_socket=root / "pod-resources" / "kubelet.sock",
        workspace=root / "workspace",
        shim_dir=root / "lib",
        gpu_backend="simulated",
        sim_gpus=parse_sim_gpus("2x16GiB"),
        kubernetes="off",
        metrics_port=0,
        profile_interval_s=0.5,
        sim_timeline_dir=timelines,
    )
    settings.shim_dir.mkdir(parents=True)
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):  # its line is for the init container's log
        if install_shim(settings.shim_dir) != 0:  # what the DaemonSet's init container does
            raise DemoUnavailable("the package was built without libalnair.so")
    rows = [Row(w) for w in DEMO_WORKLOADS]
    stop = asyncio.Event()
    async with (KubeletEmulator(settings.device_plugin_dir, settings.pod_resources_socket) as kubelet,
                pod_resources_lister(settings) as list_held):
        agent = Agent(settings, SimulatedBackend.from_settings(settings), list_held=list_held)
        task = asyncio.create_task(agent.run(stop), name="agent")
        try:
            await kubelet.wait_for(lambda k: all(k.healthy_devices(r) for r in (RESOURCE_MEMORY, RESOURCE_COMPUTE)), 10)
            gpus = {g.uuid: g.index for g in agent.gpus}
            out.write(f"Alnair demo: the agent on 2 simulated 16 GiB GPUs, the shim in every container, "
                      f"{seconds:g} s of work.\n")
            out.write(f"Registered with kubelet: {', '.join(sorted(kubelet.plugins))}\n\nAdmitting containers:\n")
            procs: list[tuple[Row, asyncio.subprocess.Process]] = []
            for r in rows:
                w = r.workload
                try:
                    answers = await kubelet.admit("default", w.pod, "main",
                                                  {RESOURCE_MEMORY: w.memory, RESOURCE_COMPUTE: w.compute})
                except AdmissionError as e:
                    r.refused = e.details
                    out.write(f"  {w.pod + '/main':16} {w.memory:>3} GiB {w.compute:>3} %  refused: {e.details}\n")
                    continue
                env = container_env(answers, sim, timelines)
                r.gpu = env[ENV_VISIBLE_DEVICES]
                r.memory_limit, r.compute_limit = int(env[ENV_MEMORY_LIMIT]), int(env.get(ENV_COMPUTE_LIMIT) or 0)
                r.allocation = Path(env["ALNAIR_REGION"]).parent.parent.name
                out.write(f"  {w.pod + '/main':16} {w.memory:>3} GiB {w.compute:>3} %  GPU{gpus[r.gpu]} "
                          f"({r.gpu}), LD_PRELOAD={answers_env(answers, 'LD_PRELOAD')}\n")
                if w.ops:
                    procs.append((r, await start_workload(w, sim, env, seconds)))
            out.write("\n")
            await watch_workloads(agent, rows, gpus, procs, seconds, out, settings.profile_interval_s * 2)
        finally:
            stop.set()
            await task
    summary(rows, out)
    return DemoResult(rows, seconds)




def summary(rows: list[Row], out: TextIO) -> None:
    out.write("Summary\n")
    for r in rows:
        w = r.workload
        name = f"{w.pod}/main"
        if r.refused:
            out.write(f"  {name}: refused at admission: no GPU has {w.memory} GiB left (on a cluster, alnair-scheduler "
                      "would place it on no node and it would stay Pending).\n")
            continue
        within = "within" if r.util_mean <= r.compute_limit + 2 else "ABOVE"
        out.write(f"  {name}: {w.what}. Cap {r.compute_limit} %: used {r.util_mean:.1f} % on average "
                  f"({within} its cap), waited {r.throttled_s:.1f} s for its turn; memory at most "
                  f"{gib(r.memory_max)} of {gib(r.memory_limit)} GiB.\n")
        out.write(failure(r))
        refused = [ln for ln in r.output if ln.startswith("alloc ") and "rc=2 " in ln]
        for ln in refused:
            size = int(ln.split()[1])
            out.write(f"    an allocation of {gib(size)} GiB past its limit got CUDA_ERROR_OUT_OF_MEMORY from "
                      "the shim.\n")
    out.write("Caps are ceilings: the shim holds each container to its cap and its memory limit. A container may get "
              "less than its cap while another shares its GPU.\n")
