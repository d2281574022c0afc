"""Two containers of two GPUs each on the same two GPUs, end to end without a GPU (issue 27's "Must hold", simulated):
the real agent admits them through the kubelet emulator (`alnair/vgpu-count: 2`, 30 % and 70 % of each GPU), the
dispatcher lays out each GPU's turns, and one process per container under the real shim runs kernels back to back
on both of its devices at once (a thread per device, each with its device's primary context current, as
`cudaSetDevice` in each thread). What each got of each GPU is read from that GPU's own simulated timeline: each
within 3 points of its cap on both GPUs (scaled by what the GPU delivered to them together), nothing on one GPU
charged to the other, each GPU's memory limit exact in its own region."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from test_dispatcher import Recorder, now_ns, within_scaled
from test_profiler import build, timelines  # noqa: F401 - the fixtures
from test_usage_multigpu import two_gpu_env

from alnair_agent.constants import ENV_REGIONS, ENV_VISIBLE_DEVICES, RESOURCE_COMPUTE, RESOURCE_MEMORY
from alnair_agent.node.region import Region
from alnair_standins.apiserver import make_pod
from alnair_standins.gpu import sim_uuid
from alnair_standins.kubelet import KubeletEmulator
from alnair_standins.node import NODE, kubernetes_for, node_settings, registered, running_agent
from alnair_standins.simbuild import Build

pytestmark = pytest.mark.timeout(120)

GiB = 1 << 30
KERNEL_NS = 1_000_000
RUN_MS = 6_000
SKIP_NS = 1_000_000_000  # the first second (start-up, the dispatcher's first layout) is not judged


async def run_devices(build: Build, env: dict[str, str], ms: int) -> tuple[int, list[dict[str, str]]]:  # noqa: F811
    p = await asyncio.create_subprocess_exec(str(build.app), "init", f"devices:2:{ms}:{KERNEL_NS}", env=env,
                                             stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await p.communicate()
    assert p.returncode == 0, err.decode()
    lines = [dict(w.split("=", 1) for w in ln.split()[1:]) for ln in out.decode().splitlines()
             if ln.startswith("device ")]
    assert p.pid is not None
    return p.pid, lines


async def test_two_containers_of_two_gpus_each_get_their_cap_on_both(root: Path, api, build, timelines) -> None:  # noqa: F811
    settings = node_settings(root, sim_timeline_dir=timelines)
    gpus = [sim_uuid(k, NODE) for k in range(2)]
    caps = {"a": 30, "b": 70}
    for name, cap in caps.items():
        api.add_pod(make_pod(name, node=NODE, restart_policy="Never",
                             containers=[{"name": "main", "memory": 2, "compute": 2 * cap, "gpus": 2}]))
    async with api.api_client() as client, running_agent(settings, kubernetes_for(client)), \
            KubeletEmulator(settings.device_plugin_dir, settings.pod_resources_socket) as kubelet:
        await registered(kubelet)
        envs = {}
        for name, cap in caps.items():
            answers = await kubelet.admit("default", name, "main", {RESOURCE_MEMORY: 2, RESOURCE_COMPUTE: 2 * cap})
            envs[name] = two_gpu_env(build, answers, timelines)
            assert envs[name][ENV_VISIBLE_DEVICES] == ",".join(gpus)  # both GPUs, in the same order
            for path in envs[name][ENV_REGIONS].split(","):
                r = Region.open(Path(path))
                try:  # each GPU's own limits: 1 GiB and the cap, exactly
                    assert (r.memory_limit, r.compute_limit) == (GiB, cap)
                finally:
                    r.close()
        recorders = [Recorder(timelines / g) for g in gpus]
        tasks = [asyncio.create_task(r.run()) for r in recorders]
        try:
            t0 = now_ns()
            (pid_a, ran_a), (pid_b, ran_b) = await asyncio.gather(
                run_devices(build, envs["a"], RUN_MS), run_devices(build, envs["b"], RUN_MS))
            t1 = now_ns()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for r in recorders:
            r.poll()
        charged = {}  # container -> the GPU time its shim charged on each of its GPUs (the regions' slots)
        for name in caps:
            charged[name] = []
            for path in envs[name][ENV_REGIONS].split(","):
                r = Region.open(Path(path))
                try:
                    charged[name].append(sum(x.gpu_ns for x in r.slots()))
                finally:
                    r.close()
    for ran in (ran_a, ran_b):
        assert [d["dev"] for d in ran] == ["0", "1"] and all(d["bad"] == "0" for d in ran), ran
    shares = [(r.share({pid_a}, t0 + SKIP_NS, t1), r.share({pid_b}, t0 + SKIP_NS, t1)) for r in recorders]
    print("each GPU's shares (a at 30, b at 70):", [(round(x, 1), round(y, 1)) for x, y in shares])
    for k, (sa, sb) in enumerate(shares):
        assert within_scaled([sa, sb], (caps["a"], caps["b"])), (k, sa, sb)
    # what each process did on each device is what that device's timeline shows for it, and what its shim charged
    # there: a kernel on device 1 is never charged to device 0
    for name, pid, ran in (("a", pid_a, ran_a), ("b", pid_b, ran_b)):
        for k, r in enumerate(recorders):
            did = int(ran[k]["gpu_ns"])
            on_gpu = sum(b.get(pid, 0) for b in r.busy.values())
            assert abs(on_gpu - did) <= 0.1 * did + 20 * KERNEL_NS, (name, k, on_gpu, ran[k])
            assert abs(charged[name][k] - did) <= 0.1 * did + 20 * KERNEL_NS, (name, k, charged[name], ran[k])
