"""The demo's DRA run: the same four workloads as ResourceClaims, placed by kube-scheduler's allocator and enforced
by the same agent, shim and simulated driver.

The agent runs with ALNAIR_FRONTEND=dra against the API server stand-in (resource.k8s.io/v1 through the real
kubernetes-asyncio client) and the DRA kubelet emulator (plugin-watcher registration, NodePrepareResources over
unix-socket gRPC). Each workload is a claim for memory and compute of the DeviceClass gpu.alnair.centaurus.io; the
allocator stand-in allocates it from the agent's ResourceSlice as kube-scheduler does (consumable capacity), kubelet
prepares it, and the container is started with what its CDI spec says. The stand-ins are alnair_standins', shipped
in the package, so the installed `alnair-agent demo` runs this from any folder.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TextIO

from alnair_agent.app import Agent, Kubernetes
from alnair_agent.config import Settings, parse_sim_gpus
from alnair_agent.constants import (
    DRA_DEVICE_CLASS,
    DRA_DRIVER,
    ENV_COMPUTE_LIMIT,
    ENV_LD_PRELOAD,
    ENV_MEMORY_LIMIT,
    ENV_VISIBLE_DEVICES,
)
from alnair_agent.demo.common import (
    DEMO_WORKLOADS,
    DemoResult,
    DemoUnavailable,
    Row,
    container_env,
    failure,
    start_workload,
    watch_workloads,
)
from alnair_agent.dra.capacity import device_class_json
from alnair_agent.kube.annotations import AnnotationWriter
from alnair_agent.kube.podwatch import PodWatch
from alnair_agent.kube.resourceapi import ResourceApi
from alnair_agent.kube.wiring import pod_resources_client
from alnair_agent.shim_install import install_shim
from alnair_standins.apiserver import FakeApiServer
from alnair_standins.dra_allocator import AllocationFailed, Allocator
from alnair_standins.gpu import SimulatedBackend
from alnair_standins.kubelet_dra import Claim, DraKubeletEmulator

NODE = "demo-node"


def _claim(name: str, memory_gib: int, compute: int) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default", "uid": str(uuid.uuid4())},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": DRA_DEVICE_CLASS,
                "capacity": {"requests": {"memory": f"{memory_gib}Gi", "compute": str(compute)}}}}]}}}


def _pod(name: str, claim: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "uid": str(uuid.uuid4()), "annotations": {}},
            "spec": {"nodeName": NODE, "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
                     "containers": [{"name": "main", "image": "demo", "resources": {"claims": [{"name": "gpu"}]}}]},
            "status": {"phase": "Pending"}}


async def demo_dra(root: Path, sim: Path, seconds: float = 15.0, out: TextIO = sys.stdout) -> DemoResult:
    """The DRA run in `root` with the simulated driver in `sim` (alnair_standins.simdriver)."""
    timelines = root / "timelines"
    settings = Settings(
        node_name=NODE, device_plugin_dir=root / "device-plugins", pod_resources_socket=root / "pr" / "kubelet.sock",
        workspace=root / "workspace", shim_dir=root / "lib", gpu_backend="simulated",
        sim_gpus=parse_sim_gpus("2x16GiB"), metrics_port=0, profile_interval_s=0.5, sim_timeline_dir=timelines,
        frontend="dra", dra_plugin_dir=root / "dra-plugin", plugins_registry_dir=root / "reg",
        cdi_dir=root / "cdi", resync_interval_s=1.0)
    settings.shim_dir.mkdir(parents=True)
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        if install_shim(settings.shim_dir) != 0:
            raise DemoUnavailable("the package was built without libalnair.so")
    rows = [Row(w) for w in DEMO_WORKLOADS]
    stop = asyncio.Event()
    async with FakeApiServer() as api:
        api.validate_dra = False  # schema checks are the tests' job; the demo keeps its time for the workloads
        api.add_device_class(device_class_json())
        client = api.api_client()
        watch = PodWatch(client, NODE)
        writer = AnnotationWriter(client, NODE)
        kubernetes = Kubernetes(pods=watch, annotations=writer, resources=ResourceApi(client),
                                services=[("pod-watch", watch.run), ("annotations", writer.run)])
        try:
            async with (DraKubeletEmulator(settings.plugins_registry_dir, settings.cdi_dir,
                                           settings.pod_resources_socket) as kubelet,
                        pod_resources_client(settings) as pod_resources):
                agent = Agent(settings, SimulatedBackend.from_settings(settings), kubernetes,
                              list_held=pod_resources.list, list_claims=pod_resources.list_claims)
                task = asyncio.create_task(agent.run(stop), name="agent")
                try:
                    await _run(agent, api, kubelet, rows, sim, timelines, seconds, out)
                finally:
                    stop.set()
                    await task
        finally:
            await client.close()
    return DemoResult(rows, seconds)


async def _run(agent: Agent, api: FakeApiServer, kubelet: DraKubeletEmulator, rows: list[Row], sim: Path,
               timelines: Path, seconds: float, out: TextIO) -> None:
    await kubelet.wait_registered(DRA_DRIVER, timeout=10)
    assert agent.dra is not None
    await asyncio.wait_for(agent.dra.slices.synced.wait(), 10)
    gpus = {g.uuid: g.index for g in agent.gpus}
    [published] = api.resource_slices()
    out.write(f"\nThe same workloads through DRA: the agent publishes ResourceSlice {published['metadata']['name']} "
              f"({len(published['spec']['devices'])} GPUs, consumable memory and compute); kube-scheduler's allocator "
              f"books each claim's share; kubelet prepares it over {kubelet.registrations[-1][1]}.\n\n"
              "Claims allocated and prepared:\n")
    scheduler = Allocator({DRA_DEVICE_CLASS: device_class_json()})
    procs = []
    for r in rows:
        w = r.workload
        claim = api.add_claim(_claim(f"{w.pod}-gpu", w.memory, w.compute))
        pod = api.add_pod(_pod(w.pod, claim["metadata"]["name"]))
        try:
            allocation = scheduler.allocate(claim, NODE, api.resource_slices())
        except AllocationFailed as e:  # no GPU has room: the pod stays Pending, as it would on a cluster
            r.refused = f"kube-scheduler: {e}"
            out.write(f"  {w.pod + '/main':16} {w.memory:>3} GiB {w.compute:>3} %  stays Pending: no GPU has "
                      f"{w.memory} GiB left\n")
            continue
        api.set_claim_status("default", claim["metadata"]["name"], {
            "allocation": allocation,
            "reservedFor": [{"resource": "pods", "name": w.pod, "uid": pod["metadata"]["uid"]}]})
        ref = Claim("default", claim["metadata"]["uid"], claim["metadata"]["name"])
        await kubelet.prepare(DRA_DRIVER, [ref])
        view = kubelet.start_container("default", w.pod, "main", [(ref, None)])
        answers = {"cdi": SimpleNamespace(envs=view.envs, mounts=[
            SimpleNamespace(container_path=c, host_path=h) for c, (h, _) in view.mounts.items()])}
        env = container_env(answers, sim, timelines)
        r.gpu = env[ENV_VISIBLE_DEVICES]
        r.memory_limit, r.compute_limit = int(env[ENV_MEMORY_LIMIT]), int(env.get(ENV_COMPUTE_LIMIT) or 0)
        r.allocation = Path(env["ALNAIR_REGION"]).parent.parent.name
        [result] = allocation["devices"]["results"]
        out.write(f"  {w.pod + '/main':16} {w.memory:>3} GiB {w.compute:>3} %  {result['device']} = GPU{gpus[r.gpu]}, "
                  f"consumed {result['consumedCapacity']}, CDI {view.cdi_ids[0]}, "
                  f"LD_PRELOAD={view.envs[ENV_LD_PRELOAD]}\n")
        if w.ops:
            procs.append((r, await start_workload(w, sim, env, seconds)))
    out.write("\n")
    await watch_workloads(agent, rows, gpus, procs, seconds, out, agent.settings.profile_interval_s * 2)
    for r in rows:  # the pods end: kubelet unprepares their claims, the agent retires the slices
        if not r.refused:
            claim = api.claim("default", f"{r.workload.pod}-gpu")
            kubelet.stop_pod("default", r.workload.pod)
            await kubelet.unprepare(DRA_DRIVER, [Claim("default", claim["metadata"]["uid"], claim["metadata"]["name"])])
    left = sum(a.claim is not None for a in agent.ledger.allocations.values()) if agent.ledger else 0
    out.write(f"Claims unprepared: {left} DRA slices left on the node, "
              f"{len(list(Path(agent.settings.cdi_dir).glob('*.json')))} CDI specs.\n")
    summary_dra(rows, out)


def summary_dra(rows: list[Row], out: TextIO) -> None:
    out.write("Summary (DRA)\n")
    for r in rows:
        name = f"{r.workload.pod}/main"
        if r.refused:
            out.write(f"  {name}: kube-scheduler found no GPU with {r.workload.memory} GiB left: the pod stays "
                      "Pending.\n")
            continue
        within = "within" if r.util_mean <= r.compute_limit + 2 else "ABOVE"
        oom = sum(ln.startswith("alloc ") and "rc=2 " in ln for ln in r.output)
        out.write(f"  {name}: cap {r.compute_limit} %: used {r.util_mean:.1f} % on average ({within} its cap); memory "
                  f"at most {r.memory_max / (1 << 30):.1f} of {r.memory_limit / (1 << 30):.1f} GiB"
                  + (f"; {oom} allocation past its limit refused (CUDA_ERROR_OUT_OF_MEMORY)" if oom else "") + ".\n")
        out.write(failure(r))
    out.write("The same limits, the same enforcement: only who placed the slice changed (kube-scheduler, from the "
              "claims).\n")
