"""The profiler end to end, without a GPU: real processes under the real shim run kernels on the simulated
driver's shared GPU timeline; the real agent (simulated backend reading that timeline) admits them through the
kubelet emulator and writes what each did on its pod through the API server stand-in."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from service_util import wait_until
from simapp_util import container_env, run_app

from alnair_agent.constants import (
    ENV_VISIBLE_DEVICES,
    RESOURCE_COMPUTE,
    RESOURCE_MEMORY,
    USAGE_ANNOTATION,
)
from alnair_agent.metrics import AgentCollector
from alnair_agent.profiler.usage import FIELD_NAMES, markdown_table
from alnair_standins.apiserver import FakeApiServer, make_pod
from alnair_standins.kubelet import KubeletEmulator
from alnair_standins.node import (
    NODE,
    kubernetes_for,
    node_settings,
    registered,
    running_agent,
)
from alnair_standins.simbuild import Build, build_shim_and_driver

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
LONG = "c" * 60  # a container name of 54+ characters: today's per-container key would be refused
MiB = 1 << 20


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Build:
    return build_shim_and_driver(tmp_path_factory.mktemp("profbuild"))


@pytest.fixture
def timelines(root: Path) -> Path:
    path = root / "timelines"
    path.mkdir()
    return path


def usage(api: FakeApiServer, pod: str) -> dict:
    return json.loads(api.pod_annotations("default", pod).get(USAGE_ANNOTATION, "{}"))


def duty(busy_ms: int, idle_ms: int, cycles: int, alloc: int = 64 * MiB) -> list[str]:
    """simapp ops: busy_ms of 1 ms kernels, then idle_ms asleep, `cycles` times."""
    return ["init", "ctx", f"alloc:{alloc}"] + [f"burst:{busy_ms}:1000000", f"sleep:{idle_ms}"] * cycles


async def test_known_duty_cycles_come_back_on_the_pod_and_stay_after_it_completes(root, api, build, timelines):
    settings = node_settings(root, sim_timeline_dir=timelines, profile_interval_s=0.1, annotate_interval_s=0.5)
    pod = make_pod("duty", node=NODE, restart_policy="Never",
                   containers=[{"name": "a", "memory": 1}, {"name": LONG, "memory": 1}])  # compute uncapped
    pod["metadata"]["annotations"] = {"example.com/keep": "yes",
                                      USAGE_ANNOTATION: json.dumps({"earlier": {"gpu_util_mean": 12.5}})}
    api.add_pod(pod)
    api.add_pod(make_pod("capped", node=NODE, restart_policy="Never", containers=[{"name": "main", "compute": 30}]))
    async with api.api_client() as client, running_agent(settings, kubernetes_for(client)) as running, \
            KubeletEmulator(settings.device_plugin_dir, settings.pod_resources_socket) as kubelet:
        await registered(kubelet)
        a = await kubelet.admit("default", "duty", "a", {RESOURCE_MEMORY: 1})
        b = await kubelet.admit("default", "duty", LONG, {RESOURCE_MEMORY: 1})
        c = await kubelet.admit("default", "capped", "main", {RESOURCE_COMPUTE: 30})
        env_a, env_b = container_env(build, a, timelines), container_env(build, b, timelines)
        env_c = container_env(build, c, timelines)
        assert env_a[ENV_VISIBLE_DEVICES] == env_b[ENV_VISIBLE_DEVICES]  # binpack: both share one GPU
        # every admitted container has its entry from admission on: zeros until a process shows up
        await wait_until(lambda: {"a", LONG} <= set(usage(api, "duty")), 5)
        assert usage(api, "duty")["a"]["gpu_util_mean"] == 0 and usage(api, "duty")["a"]["last_seen"] is None
        # a process of no container on the same GPU: on the timeline, counted as unattributed, never guessed
        stranger = {**env_a, "ALNAIR_REGION": str(root / "nowhere"), "LD_PRELOAD": ""}
        unattributed: list[int] = []

        async def watch_unattributed() -> None:
            while True:
                unattributed.append(sum(running.agent.profiler.unattributed.values()))
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch_unattributed())
        truth_a, truth_b, truth_s, truth_c = await asyncio.gather(
            run_app(build, duty(40, 60, 30), env_a), run_app(build, duty(20, 80, 30), env_b),
            run_app(build, duty(10, 90, 25), stranger),
            run_app(build, ["init", "ctx", "run:2500:100000"], env_c))  # flat out, under a 30 % cap
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        assert max(unattributed) == 1  # the stranger: seen on the GPU, placed on no container
        await wait_until(lambda: usage(api, "capped").get("main", {}).get("observed_seconds", 0) > 2.0, 5)
        capped = usage(api, "capped")["main"]
        print("capped truth", round(truth_c, 2), "annotation", capped)
        assert abs(capped["gpu_util_mean"] - truth_c) <= 3
        assert capped["throttled_seconds"] > 0.5 and capped["compute_limit_percent"] == 30
        await wait_until(lambda: usage(api, "duty")["a"]["observed_seconds"] > 2.0, 5)
        registry = CollectorRegistry()
        registry.register(AgentCollector(running.agent))
        families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
        gpu_s = {s.labels["container"]: s.value for s in families["alnair_container_gpu_seconds"].samples
                 if s.name.endswith("_total")}
        profiler = running.agent.profiler
        by_name = {running.agent.ledger.allocations[i].container: u.gpu_seconds for i, u in profiler.usage.items()}
        assert gpu_s["a"] == pytest.approx(by_name["a"]) and gpu_s["a"] > 0.8
        assert {s.labels["gpu"] for s in families["alnair_gpu_utilization_ratio"].samples} == {"0", "1"}
        api.set_container_terminated("default", "duty", "a")
        api.set_container_terminated("default", "duty", LONG)
        api.set_container_terminated("default", "capped", "main")
        for name in ("duty", "capped"):  # every container ended for good: kubelet lists the pods no more
            kubelet.remove_pod("default", name)
        await wait_until(lambda: not running.agent.ledger.allocations, 10)  # retired after the final write
        written = usage(api, "duty")
        api.set_phase("default", "duty", "Succeeded")
        await asyncio.sleep(0.5)
    got = usage(api, "duty")
    assert got == written  # nothing rewrote or dropped them after the pod completed
    assert set(got) == {"a", LONG, "earlier"}  # an entry the agent does not own is kept as it was
    assert got["earlier"] == {"gpu_util_mean": 12.5}
    assert api.pod_annotations("default", "duty")["example.com/keep"] == "yes"
    for name, truth in (("a", truth_a), (LONG, truth_b)):
        e = got[name]
        assert set(e) == set(FIELD_NAMES) and e["state"] == "ended"
        print(name[:8], "truth", round(truth, 2), "annotation", e)
        assert abs(e["gpu_util_mean"] - truth) <= 3, (name, e, truth)
        assert e["gpu_util_max"] >= e["gpu_util_mean"]
        assert e["memory_max_bytes"] == 64 * MiB
        assert abs(e["gpu_seconds"] - truth / 100 * e["observed_seconds"]) < 0.3
        assert e["first_seen"] <= e["last_seen"]
    assert 30 <= truth_a <= 42 and 15 <= truth_b <= 22 and truth_s > 5  # the workload did what it should


async def test_rate_limit_and_the_final_write(root, api, build, timelines):
    settings = node_settings(root, sim_timeline_dir=timelines, profile_interval_s=0.05)  # default 30 s interval
    assert settings.annotate_interval_s == 30.0
    api.add_pod(make_pod("job", node=NODE, restart_policy="Never", containers=[{"name": "main", "memory": 1}]))
    async with api.api_client() as client, running_agent(settings, kubernetes_for(client)) as running, \
            KubeletEmulator(settings.device_plugin_dir, settings.pod_resources_socket) as kubelet:
        await registered(kubelet)
        answers = await kubelet.admit("default", "job", "main", {RESOURCE_MEMORY: 1})
        await wait_until(lambda: "main" in usage(api, "job"), 5)
        await run_app(build, duty(30, 20, 30), container_env(build, answers, timelines))  # 1.5 s of work
        writes = [p for p in api.patches if p.name == "job" and USAGE_ANNOTATION in p.body["metadata"]["annotations"]]
        assert len(writes) == 1  # the admission entry; every later change waits for the 30 s interval
        assert usage(api, "job")["main"]["observed_seconds"] == 0
        t0 = time.monotonic()
        api.set_container_terminated("default", "job", "main")
        await wait_until(lambda: usage(api, "job")["main"]["state"] == "ended", 5)
        assert time.monotonic() - t0 < 3  # the final write does not wait for the interval
        final = usage(api, "job")["main"]
        assert final["observed_seconds"] > 1.0 and final["gpu_util_mean"] > 30
        kubelet.remove_pod("default", "job")  # the pod has ended: kubelet lists it no more
        await wait_until(lambda: not running.agent.ledger.allocations, 5)
    assert len([p for p in api.patches if p.name == "job" and USAGE_ANNOTATION in p.body["metadata"]["annotations"]]) == 2


def test_readme_usage_table_is_generated_from_the_schema():
    readme = (ROOT / "README.md").read_text()
    start, end = readme.index("<!-- usage-table -->\n"), readme.index("<!-- /usage-table -->")
    assert readme[start + len("<!-- usage-table -->\n"):end] == markdown_table()


async def test_figures_continue_across_an_agent_restart(root, api, build, timelines):
    settings = node_settings(root, sim_timeline_dir=timelines, profile_interval_s=0.1, annotate_interval_s=0.2)
    api.add_pod(make_pod("long", node=NODE, restart_policy="Never", containers=[{"name": "main", "memory": 1}]))
    async with KubeletEmulator(settings.device_plugin_dir, settings.pod_resources_socket) as kubelet:
        async with api.api_client() as client, running_agent(settings, kubernetes_for(client)):
            await registered(kubelet)
            answers = await kubelet.admit("default", "long", "main", {RESOURCE_MEMORY: 1})
            env = container_env(build, answers, timelines)
            await run_app(build, duty(30, 20, 20), env)
            await wait_until(lambda: usage(api, "long")["main"]["observed_seconds"] > 0.8, 5)
        before = usage(api, "long")["main"]
        async with api.api_client() as client, running_agent(settings, kubernetes_for(client)):
            await run_app(build, duty(30, 20, 20), env)
            await wait_until(lambda: usage(api, "long")["main"]["observed_seconds"] > before["observed_seconds"] + 0.8,
                             5)
            after = usage(api, "long")["main"]
    assert after["allocation"] == before["allocation"] and after["first_seen"] == before["first_seen"]
    assert after["gpu_seconds"] > before["gpu_seconds"]  # resumed from what the pod said, not from zero
    assert abs(after["gpu_util_mean"] - 60) <= 5


async def test_copy_engine_time_goes_to_the_container_that_copied(root, api, build, timelines):
    """NVML puts copy-engine time on no process: the profiler splits the GPU's memory-copy time that kernels do
    not explain by the bytes each container's copies moved (the shim counts them in the region)."""
    settings = node_settings(root, sim_timeline_dir=timelines, profile_interval_s=0.1, annotate_interval_s=0.3)
    api.add_pod(make_pod("copier", node=NODE, restart_policy="Never", containers=[{"name": "main", "memory": 1}]))
    api.add_pod(make_pod("kernels", node=NODE, restart_policy="Never", containers=[{"name": "main", "memory": 1}]))
    async with api.api_client() as client, running_agent(settings, kubernetes_for(client)), \
            KubeletEmulator(settings.device_plugin_dir, settings.pod_resources_socket) as kubelet:
        await registered(kubelet)
        copier = await kubelet.admit("default", "copier", "main", {RESOURCE_MEMORY: 1})
        kernels = await kubelet.admit("default", "kernels", "main", {RESOURCE_MEMORY: 1})
        env_c, env_k = container_env(build, copier, timelines), container_env(build, kernels, timelines)
        assert env_c[ENV_VISIBLE_DEVICES] == env_k[ENV_VISIBLE_DEVICES]  # binpack: one GPU
        await asyncio.gather(run_app(build, ["init", "ctx", "copy:2000:2097152"], env_c),
                             run_app(build, duty(30, 20, 40), env_k))
        await wait_until(lambda: usage(api, "copier").get("main", {}).get("observed_seconds", 0) > 1.5, 5)
        copied, computed = usage(api, "copier")["main"], usage(api, "kernels")["main"]
    print("copier", copied, "kernels", computed)
    assert copied["memcpy_util_mean"] > 10 and copied["gpu_util_mean"] < 3  # ~20 % here: sync copies wait
    assert computed["memcpy_util_mean"] < 3 and computed["gpu_util_mean"] > 20
