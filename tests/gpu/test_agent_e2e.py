"""End to end on a real GPU: the agent (NVML backend) registers with the kubelet emulator, admits a container, and
a PyTorch process started the way the container would be (the Allocate answer's env and folder, the shim preloaded)
is held to its slice while the agent reads its figures from the region.

Needs a GPU, torch, structlog and kubernetes-asyncio, and the shim (ALNAIR_SHIM, else the installed one).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

pytest.importorskip("pynvml")
pytest.importorskip("torch")
pytest.importorskip("structlog")
pytest.importorskip("kubernetes_asyncio")

from alnair_agent.config import Settings
from alnair_agent.constants import (
    ENV_COMPUTE_LIMIT,
    ENV_MEMORY_LIMIT,
    RESOURCE_COMPUTE,
    RESOURCE_MEMORY,
)
from alnair_agent.node.region import Region
from alnair_standins.workloads import gpu_agent, skip_without_gpu_or_shim, tenant_env

GIB = 1 << 30
SHIM = Path(os.environ.get("ALNAIR_SHIM") or Path(__file__).resolve().parents[2] / "alnair_agent/lib/libalnair.so")

CHILD = """
import json, sys, time, torch
free, total = torch.cuda.mem_get_info()
held = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
start, n = time.time(), 0
while time.time() - start < 2.0:
    b = a @ a
    n += 1
torch.cuda.synchronize()
print(json.dumps({"total": total, "free": free, "matmuls": n, "seconds": time.time() - start}), flush=True)
sys.stdin.readline()  # hold the memory until the test has read the region
"""


@pytest.fixture
def nvml_ok():
    skip_without_gpu_or_shim(SHIM)


async def scenario(root: Path) -> dict:
    settings = Settings(node_name="gpu-node", device_plugin_dir=root / "dp", pod_resources_socket=root / "pr" / "k.sock",
                        workspace=root / "ws", shim_dir=SHIM.parent, gpu_backend="nvml", kubernetes="off",
                        metrics_port=0, resync_interval_s=0.2)
    async with gpu_agent(settings) as (agent, kubelet):
        gpus = agent.gpus
        counts = {r: len(kubelet.plugins[r].devices) for r in (RESOURCE_MEMORY, RESOURCE_COMPUTE)}
        answers = await kubelet.admit("default", "train", "main", {RESOURCE_MEMORY: 16, RESOURCE_COMPUTE: 30})
        env = {**answers[RESOURCE_COMPUTE].envs, **answers[RESOURCE_MEMORY].envs}
        run_dir = next(m.host_path for m in answers[RESOURCE_MEMORY].mounts if m.container_path == "/run/alnair")
        child_env = tenant_env(answers, agent, SHIM)
        child = await asyncio.create_subprocess_exec(sys.executable, "-c", CHILD, env=child_env,
                                                     stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        line = await asyncio.wait_for(child.stdout.readline(), 120)
        seen = json.loads(line)
        region = Region.open(Path(run_dir) / "region")
        try:
            slots = region.slots()
            figures = {"memory_in_use": region.memory_in_use(), "launches": sum(s.launches for s in slots),
                       "gpu_ns": sum(s.gpu_ns for s in slots),
                       "wait_ns": sum(s.wait_ns for s in slots), "limits": (region.memory_limit,
                                                                              region.compute_limit),
                       "heartbeat_ns": region.heartbeat_ns}
        finally:
            region.close()
        child.stdin.write(b"\n")
        await child.stdin.drain()
        assert await asyncio.wait_for(child.wait(), 60) == 0
        return {"gpus": [(g.name, g.uuid, g.memory_bytes) for g in gpus], "counts": counts, "env": env,
                "child": seen, "region": figures}


def test_agent_admits_and_the_shim_holds_pytorch_to_the_slice(nvml_ok):
    root = Path(tempfile.mkdtemp(prefix="aln-", dir="/tmp"))
    try:
        result = asyncio.run(scenario(root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("E2E", json.dumps(result))
    out = os.environ.get("ALNAIR_GPU_RESULTS")
    if out:
        Path(out, "agent_e2e.json").write_text(json.dumps(result, indent=2))
    gpus = result["gpus"]
    assert result["counts"][RESOURCE_MEMORY] == sum(m // GIB for _, _, m in gpus)
    assert result["counts"][RESOURCE_COMPUTE] == 100 * len(gpus)
    assert result["env"][ENV_MEMORY_LIMIT] == str(16 * GIB) and result["env"][ENV_COMPUTE_LIMIT] == "30"
    assert result["child"]["total"] == 16 * GIB
    assert result["region"]["limits"] == [16 * GIB, 30] or tuple(result["region"]["limits"]) == (16 * GIB, 30)
    assert result["region"]["memory_in_use"] >= 4 * GIB
    assert result["region"]["launches"] > 0 and result["region"]["gpu_ns"] > 0
    assert result["region"]["heartbeat_ns"] > 0  # the agent's heartbeat reaches the container's region
