"""The usage of a host-bound container beside a GPU-bound one, end to end without a GPU: the real agent, two capped
containers on one simulated GPU, the shim shipped and built -DIDLE_SAMPLE=1 (a diagnostic build:
shim/launch_internal.h says why it is not the default).

A capped container's usage is the GPU time its shim counted, scaled down with the others' on its GPU when together
they claim more than NVML's device utilization leaves (profiler/service.py). A host-bound program's samples hold
the launch call's host time on an idle GPU, so its shim counts more than it used, and the one factor that scales the
claims down then moves its excess onto the GPU-bound neighbour's figure. The simulated driver has the H200 VM's host
costs (a 4 us launch call, 3.4 us per event call). The diagnostic build takes an idle GPU's host time off a sample;
what it still cannot tell is a kernel shorter than the end event's record call (the `small` row: 2 us kernels stay
counted about 3.4 us each)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from service_util import wait_until
from simapp_util import container_env, run_app

from alnair_agent.constants import ENV_VISIBLE_DEVICES, RESOURCE_COMPUTE, USAGE_ANNOTATION
from alnair_standins.apiserver import FakeApiServer, make_pod
from alnair_standins.kubelet import KubeletEmulator
from alnair_standins.node import NODE, kubernetes_for, node_settings, registered, running_agent
from alnair_standins.simbuild import Build, build_shim_and_driver

pytestmark = pytest.mark.timeout(90)

HOST = {"SIMCUDA_LAUNCH_HOLD_NS": "4000", "SIMCUDA_EVENT_NS": "3400"}
SHAPES = {
    "train": "hsteps:3000:79:20000:25000",  # 79 distinct 20 us kernels a step, 25 us of host before each, a sync
    "small": "loop:3000:2000:0:5000",  # 2 us kernels, 5 us of host before each, never a sync
}
NEIGHBOUR = "run:3000:100000"  # 100 us kernels back to back: GPU-bound


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Build]:
    return {"shipped": build_shim_and_driver(tmp_path_factory.mktemp("usage-shipped")),
            "idle": build_shim_and_driver(tmp_path_factory.mktemp("usage-idle1"), "-O2 -DIDLE_SAMPLE=1")}


def usage(api: FakeApiServer, pod: str) -> dict:
    return json.loads(api.pod_annotations("default", pod).get(USAGE_ANNOTATION, "{}")).get("main", {})


async def errors(root: Path, api: FakeApiServer, build: Build, op: str, tag: str) -> tuple[float, float]:
    """The host-bound container (cap 30) and the GPU-bound one (cap 70) run together, pods host-TAG and gpu-TAG;
    each one's usage annotation less what it really ran (points of the GPU)."""
    root.mkdir()
    timelines = root / "timelines"
    timelines.mkdir()
    host, gpu = f"host-{tag}", f"gpu-{tag}"
    settings = node_settings(root, sim_timeline_dir=timelines, profile_interval_s=0.1, annotate_interval_s=0.5)
    for name, cap in ((host, 30), (gpu, 70)):
        api.add_pod(make_pod(name, node=NODE, restart_policy="Never", containers=[{"name": "main", "compute": cap}]))
    async with api.api_client() as client, running_agent(settings, kubernetes_for(client)), \
            KubeletEmulator(settings.device_plugin_dir, settings.pod_resources_socket) as kubelet:
        await registered(kubelet)
        env_h = container_env(build, await kubelet.admit("default", host, "main", {RESOURCE_COMPUTE: 30}), timelines)
        env_g = container_env(build, await kubelet.admit("default", gpu, "main", {RESOURCE_COMPUTE: 70}), timelines)
        assert env_h[ENV_VISIBLE_DEVICES] == env_g[ENV_VISIBLE_DEVICES]  # binpack: one GPU
        truth_h, truth_g = await asyncio.gather(run_app(build, ["init", "ctx", op], {**env_h, **HOST}),
                                                run_app(build, ["init", "ctx", NEIGHBOUR], {**env_g, **HOST}))
        await wait_until(lambda: min(usage(api, p).get("observed_seconds", 0) for p in (host, gpu)) > 2.5, 10)
    got_h, got_g = usage(api, host)["gpu_util_mean"], usage(api, gpu)["gpu_util_mean"]
    print(f"truth {truth_h:.1f} / {truth_g:.1f}, annotations {got_h:.1f} / {got_g:.1f}")
    return got_h - truth_h, got_g - truth_g


@pytest.mark.parametrize("shape", sorted(SHAPES))
async def test_a_host_bound_containers_usage_beside_a_gpu_bound_one(root, api, builds, shape):
    shipped = await errors(root / "shipped", api, builds["shipped"], SHAPES[shape], "shipped")
    idle = await errors(root / "idle", api, builds["idle"], SHAPES[shape], "idle")
    print(shape, "error in points, host-bound / GPU-bound: shipped", [round(e, 1) for e in shipped],
          "IDLE_SAMPLE=1", [round(e, 1) for e in idle])
    assert max(map(abs, idle)) <= max(map(abs, shipped)) + 1.0
    # a training step's kernels outlast the end event's record call: its usage and its neighbour's hold (+2.8 / -3.7
    # points shipped); 2 us kernels are still counted ~3.4 us each, and their neighbour pays part of it (+3.7 / -4.5,
    # against +12.9 / -14.4 shipped, on the dev box)
    assert max(map(abs, idle)) <= (3.0 if shape == "train" else 8.0), idle  # 5.6 under a busy CPU
