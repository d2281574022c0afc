"""Running simapp as an admitted container would run: its environment from the agent's Allocate answers, its run
to the end (the profiler's and the usage tests' helpers)."""

from __future__ import annotations

import asyncio
import os
import time

from alnair_agent.constants import ENV_COMPUTE_LIMIT, ENV_MEMORY_LIMIT, ENV_VISIBLE_DEVICES
from alnair_standins.simbuild import Build


def container_env(build: Build, answers: dict, timelines: os.PathLike[str]) -> dict[str, str]:
    """The container's environment as Allocate made it (the region's host path for its mount)."""
    env = {k: v for answer in answers.values() for k, v in answer.envs.items()}
    run_dir = next(m.host_path for answer in answers.values() for m in answer.mounts
                   if m.container_path == "/run/alnair")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ALNAIR_", "SIMCUDA_", "LD_"))}
    return {**base, "LD_LIBRARY_PATH": str(build.sim), "LD_PRELOAD": str(build.shim), "ALNAIR_REGION": f"{run_dir}/region",
            ENV_MEMORY_LIMIT: env.get(ENV_MEMORY_LIMIT, "0"), ENV_COMPUTE_LIMIT: env.get(ENV_COMPUTE_LIMIT, "0"),
            ENV_VISIBLE_DEVICES: env[ENV_VISIBLE_DEVICES], "ALNAIR_CONTEXT_BYTES": "0",
            "SIMCUDA_TIMELINE_DIR": str(timelines)}


async def run_app(build: Build, ops: list[str], env: dict[str, str]) -> float:
    """Run simapp to its end; the fraction of its life it kept the GPU busy, from its own output."""
    t0 = time.monotonic()
    p = await asyncio.create_subprocess_exec(str(build.sim / "simapp"), *ops, env=env,
                                             stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await p.communicate()
    wall = time.monotonic() - t0
    assert p.returncode == 0, err.decode()
    gpu_ns = sum(int(w.split("=")[1]) for ln in out.decode().splitlines() if ln.startswith(("burst", "run "))
                 for w in ln.split() if w.startswith("gpu_ns="))
    return 100.0 * gpu_ns / 1e9 / wall
