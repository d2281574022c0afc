"""A container of two GPUs, end to end without a GPU: one real process under the real shim runs kernels on both
devices of the simulated driver (each device on its own GPU's timeline), the real agent admits it through the kubelet
emulator (`alnair/vgpu-count: 2`), and what it did on each GPU comes back apart: in the pod's
`ai.centaurus.io/usage` annotation (its entry combined over its GPUs, plus `gpus` with each GPU's own figures) and
in `/metrics` as a Prometheus scraper reads it over HTTP (one series per container and GPU)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from service_util import wait_until
from test_metrics import free_port
from test_profiler import build, timelines  # noqa: F401 - the fixtures

from alnair_agent.constants import (
    ENV_COMPUTE_LIMIT,
    ENV_MEMORY_LIMIT,
    ENV_REGIONS,
    ENV_VISIBLE_DEVICES,
    RESOURCE_COMPUTE,
    RESOURCE_MEMORY,
    USAGE_ANNOTATION,
)
from alnair_agent.profiler.usage import FIELD_NAMES, GPUS_FIELD
from alnair_standins.apiserver import FakeApiServer, make_pod
from alnair_standins.gpu import sim_uuid
from alnair_standins.kubelet import KubeletEmulator
from alnair_standins.node import NODE, kubernetes_for, node_settings, registered, running_agent
from alnair_standins.simbuild import Build

pytestmark = pytest.mark.timeout(90)

GiB, MiB = 1 << 30, 1 << 20


def usage(api: FakeApiServer, pod: str) -> dict:
    return json.loads(api.pod_annotations("default", pod).get(USAGE_ANNOTATION, "{}"))


def two_gpu_env(build: Build, answers: dict, timelines: Path) -> dict[str, str]:  # noqa: F811
    """The container's environment as Allocate made it, its regions at their host paths (what the mounts show the
    container), on the simulated driver with two devices."""
    env = {k: v for answer in answers.values() for k, v in answer.envs.items()}
    hosts = {m.container_path: m.host_path for answer in answers.values() for m in answer.mounts}
    regions = [f"{hosts[os.path.dirname(p)]}/{os.path.basename(p)}" for p in env[ENV_REGIONS].split(",")]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ALNAIR_", "SIMCUDA_", "LD_", "CUDA_"))}
    return {**base, "LD_LIBRARY_PATH": str(build.sim), "LD_PRELOAD": str(build.shim),
            ENV_REGIONS: ",".join(regions), "ALNAIR_REGION": regions[0],
            ENV_MEMORY_LIMIT: env[ENV_MEMORY_LIMIT], ENV_COMPUTE_LIMIT: env[ENV_COMPUTE_LIMIT],
            ENV_VISIBLE_DEVICES: env[ENV_VISIBLE_DEVICES], "ALNAIR_CONTEXT_BYTES": "0", "SIMCUDA_DEVICES": "2",
            "SIMCUDA_TIMELINE_DIR": str(timelines)}


async def run_on_both(build: Build, env: dict[str, str], busy_ms: tuple[int, int], idle_ms: int,  # noqa: F811
                      cycles: int) -> tuple[float, float]:
    """One process: 64 MiB on device 0 and 192 MiB on device 1, then `cycles` times busy_ms[0] of 1 ms kernels on
    device 0, busy_ms[1] on device 1 and idle_ms asleep. Each device's busy share of the process's life (%), from
    its own output."""
    ops = ["init", "setdev:0", f"alloc:{64 * MiB}", "setdev:1", f"alloc:{192 * MiB}"]
    ops += ["setdev:0", f"burst:{busy_ms[0]}:1000000", "setdev:1", f"burst:{busy_ms[1]}:1000000",
            f"sleep:{idle_ms}"] * cycles
    t0 = asyncio.get_running_loop().time()
    p = await asyncio.create_subprocess_exec(str(build.app), *ops, env=env, stdout=asyncio.subprocess.PIPE,
                                             stderr=asyncio.subprocess.PIPE)
    out, err = await p.communicate()
    wall = asyncio.get_running_loop().time() - t0
    assert p.returncode == 0, err.decode()
    bursts = [int(w.split("=")[1]) for ln in out.decode().splitlines() if ln.startswith("burst")
              for w in ln.split() if w.startswith("gpu_ns=")]
    assert len(bursts) == 2 * cycles
    return 100.0 * sum(bursts[0::2]) / 1e9 / wall, 100.0 * sum(bursts[1::2]) / 1e9 / wall


def series(text: str, family: str) -> dict[tuple[str, str, str], float]:
    """(gpu, UUID, container) -> value of a family's samples in a scrape."""
    out = {}
    for f in text_string_to_metric_families(text):
        if f.name == family:
            for s in f.samples:
                if s.name in (family, family + "_total"):
                    out[(s.labels["gpu"], s.labels["UUID"], s.labels["container"])] = s.value
    return out


async def test_a_two_gpu_containers_figures_are_kept_per_gpu_in_the_annotation_and_metrics(
        root, api, build, timelines):  # noqa: F811
    settings = node_settings(root, sim_timeline_dir=timelines, profile_interval_s=0.1, annotate_interval_s=0.3,
                             metrics_port=free_port())
    api.add_pod(make_pod("wide", node=NODE, restart_policy="Never",
                         containers=[{"name": "main", "memory": 2, "compute": 60, "gpus": 2}]))
    g0, g1 = sim_uuid(0, NODE), sim_uuid(1, NODE)
    async with api.api_client() as client, running_agent(settings, kubernetes_for(client)) as running, \
            KubeletEmulator(settings.device_plugin_dir, settings.pod_resources_socket) as kubelet, \
            aiohttp.ClientSession() as http:
        await registered(kubelet)
        answers = await kubelet.admit("default", "wide", "main", {RESOURCE_MEMORY: 2, RESOURCE_COMPUTE: 60})
        env = two_gpu_env(build, answers, timelines)
        assert env[ENV_VISIBLE_DEVICES] == f"{g0},{g1}"
        await wait_until(lambda: "main" in usage(api, "wide"), 5)
        truth0, truth1 = await run_on_both(build, env, (20, 6), 74, 30)  # ~20 % and ~6 %, under the 30 % caps
        await wait_until(lambda: all(g["observed_seconds"] > 2.0
                                     for g in usage(api, "wide")["main"].get(GPUS_FIELD.name, [{}, {}])), 10)
        entry = usage(api, "wide")["main"]
        figures = running.agent.profiler.usage.values()
        before = {u.gpu: u.gpu_seconds for u in figures}  # counters only grow: a tick may land during the scrape
        async with http.get(f"http://127.0.0.1:{settings.metrics_port}/metrics") as resp:
            assert resp.status == 200
            text = await resp.text()
        after = {u.gpu: u.gpu_seconds for u in figures}
    print("truth", round(truth0, 2), round(truth1, 2), "annotation", entry)

    # each GPU's own figures, in the order the container sees its GPUs
    first, second = entry[GPUS_FIELD.name]
    assert [first["gpu"], second["gpu"]] == [g0, g1] and first["allocation"] != second["allocation"]
    for e in (first, second):
        assert set(e) == set(FIELD_NAMES)
        assert (e["memory_limit_bytes"], e["compute_limit_percent"]) == (GiB, 30)
    assert first["memory_max_bytes"] == 64 * MiB and second["memory_max_bytes"] == 192 * MiB
    assert abs(first["gpu_util_mean"] - truth0) <= 4 and abs(second["gpu_util_mean"] - truth1) <= 4, entry
    assert first["gpu_seconds"] > 2 * second["gpu_seconds"] > 0
    # the container's entry: its GPUs combined by each field's rule
    assert entry["gpu"] == f"{g0},{g1}" and entry["allocation"] == f"{first['allocation']},{second['allocation']}"
    assert (entry["memory_limit_bytes"], entry["compute_limit_percent"]) == (2 * GiB, 60)
    assert entry["memory_max_bytes"] == 256 * MiB
    assert entry["gpu_seconds"] == pytest.approx(first["gpu_seconds"] + second["gpu_seconds"], abs=0.002)
    assert entry["observed_seconds"] == max(first["observed_seconds"], second["observed_seconds"])
    assert entry["state"] == "running" and entry["first_seen"] == first["first_seen"]

    # /metrics: one series per (container, GPU), each with that GPU's own figures
    limit = series(text, "alnair_container_memory_limit_bytes")
    assert limit == {("0", g0, "main"): GiB, ("1", g1, "main"): GiB}
    gpu_s = series(text, "alnair_container_gpu_seconds")
    assert set(gpu_s) == {("0", g0, "main"), ("1", g1, "main")}
    for index, gpu in (("0", g0), ("1", g1)):
        assert before[gpu] <= gpu_s[(index, gpu, "main")] <= after[gpu]
    assert gpu_s[("0", g0, "main")] > 2 * gpu_s[("1", g1, "main")] > 0
    assert set(series(text, "alnair_container_compute_limit_ratio").values()) == {0.3}
