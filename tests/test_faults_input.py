"""Fault suite, part 2: hostile and malformed input, fuzzed with hypothesis. gRPC requests and raw bytes against
the real agent process, environment variables, the extender's request bodies, pods with odd fields, a
multi-container Allocate whose second entry is bad. (The admission webhook is not on this branch: its fuzzing
belongs with it; see docs/reliability.md.)"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import string
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from faults_util import open_paths, stop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from alnair_agent.config import VARIABLES, ConfigError, Settings
from alnair_agent.constants import (
    ALLOCATION_FILE_NAME,
    RESOURCE_COMPUTE,
    RESOURCE_MEMORY,
    SOCKET_NAME,
)
from alnair_agent.kube.pods import PodError, parse_pod
from alnair_agent.proto import deviceplugin_pb2 as pb
from alnair_agent.proto import deviceplugin_pb2_grpc as pb_grpc
from alnair_agent.scheduler.server import answer_filter, answer_prioritize
from alnair_standins.gpu import sim_uuid
from alnair_standins.kubelet import KubeletEmulator
from alnair_standins.node import (
    AgentProcess,
    node_settings,
    registered,
    remove_tree,
    running_agent,
    short_tmp,
)

MEM, SM = RESOURCE_MEMORY, RESOURCE_COMPUTE
NODE = "node-1"
# What a refusal may be: kubelet shows the message; never UNKNOWN (an unhandled exception) or INTERNAL.
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.RESOURCE_EXHAUSTED}


# -- a live node shared by the gRPC fuzzers: the real agent process, kubelet emulated on a loop thread ----------
class LiveNode:
    def __init__(self) -> None:
        self.root = short_tmp()
        self.settings = node_settings(self.root, sim_gpus=node_settings(self.root).sim_gpus)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.kubelet = KubeletEmulator(self.settings.device_plugin_dir, self.settings.pod_resources_socket)
        self.run(self.kubelet.start())
        self.agent = AgentProcess(self.settings)
        self.agent.start()
        self.run(registered(self.kubelet, timeout=20))
        self.channels = {r: grpc.insecure_channel(f"unix://{self.settings.device_plugin_dir / SOCKET_NAME[r]}")
                         for r in (MEM, SM)}
        self.stubs = {r: pb_grpc.DevicePluginStub(c) for r, c in self.channels.items()}

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def close(self) -> None:
        for c in self.channels.values():
            c.close()
        stop(self.agent)
        self.run(self.kubelet.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()
        remove_tree(self.root)

    def folders_ok(self) -> None:
        for folder in self.settings.workspace.iterdir():
            assert (folder / ALLOCATION_FILE_NAME).is_file(), f"half-made folder {folder.name}"


@pytest.fixture(scope="module")
def live() -> Iterator[LiveNode]:
    node = LiveNode()
    yield node
    node.close()


def _ids(kind: str) -> list[str]:
    n = 16 if kind == "mem" else 100
    return [f"{sim_uuid(g, NODE)}::{kind}::{i}" for g in (0, 1) for i in (0, 1, n - 1)]


device_id = st.one_of(
    st.sampled_from(_ids("mem") + _ids("sm")),
    st.text(max_size=80),
    st.builds(lambda g, k, i: f"{sim_uuid(g, NODE)}::{k}::{i}", st.integers(0, 3),
              st.sampled_from(["mem", "sm", "gpu", ""]), st.one_of(st.integers(-5, 10**20), st.text(max_size=5))),
)
container_requests = st.lists(st.lists(device_id, max_size=6), max_size=3)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(resource=st.sampled_from([MEM, SM]), requests=container_requests)
def test_fuzzed_allocate_is_answered_or_refused_clearly(live, resource, requests):
    stub = live.stubs[resource]
    before = set(os.listdir(live.settings.workspace))
    try:
        resp = stub.Allocate(pb.AllocateRequest(container_requests=[
            pb.ContainerAllocateRequest(devices_ids=ids) for ids in requests]), timeout=10)
    except grpc.RpcError as e:
        assert e.code() in REFUSALS, (e.code(), e.details())
        assert e.details()
        # a refused call keeps nothing (the reconciler may retire old folders meanwhile: only none new)
        assert set(os.listdir(live.settings.workspace)) <= before
        return
    assert len(resp.container_responses) == len(requests)
    live.folders_ok()


@FUZZ
@given(resource=st.sampled_from([MEM, SM]),
       reqs=st.lists(st.tuples(st.lists(device_id, max_size=6), st.lists(device_id, max_size=3),
                               st.integers(-(2**31), 2**31 - 1)), max_size=3))
def test_fuzzed_preferred_allocation_is_answered_or_refused_clearly(live, resource, reqs):
    try:
        live.stubs[resource].GetPreferredAllocation(pb.PreferredAllocationRequest(container_requests=[
            pb.ContainerPreferredAllocationRequest(available_deviceIDs=a, must_include_deviceIDs=m, allocation_size=n)
            for a, m, n in reqs]), timeout=10)
    except grpc.RpcError as e:
        assert e.code() in REFUSALS, (e.code(), e.details())


def test_raw_garbage_on_the_plugin_sockets_is_survived(live):
    rng = random.Random(10)
    for i in range(60):
        for r in (MEM, SM):
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(2)
                s.connect(str(live.settings.device_plugin_dir / SOCKET_NAME[r]))
                if i % 3 == 0:  # a valid HTTP/2 preface, then junk frames
                    s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + rng.randbytes(rng.randint(0, 4096)))
                else:
                    s.sendall(rng.randbytes(rng.randint(1, 4096)))
    assert live.agent.proc.poll() is None
    opts = live.stubs[MEM].GetDevicePluginOptions(pb.Empty(), timeout=5)
    assert opts.get_preferred_allocation_available
    # No descriptor piles up: a few sockets, the regions of live allocations, the log; not one per connection.
    assert len(open_paths(live.agent.proc.pid)) < 100


@pytest.fixture
def fresh() -> Iterator[LiveNode]:
    """A node of its own (the fuzzers leave allocations behind on the shared one)."""
    node = LiveNode()
    yield node
    node.close()


def test_multi_container_allocate_with_a_bad_second_entry_keeps_nothing(fresh):
    live = fresh
    mem = _ids("mem")
    for bad in (["not-a-device"], [mem[0], mem[3]], [mem[1], mem[1]], []):  # unknown, two GPUs, repeated, none
        before = set(os.listdir(live.settings.workspace))
        with pytest.raises(grpc.RpcError) as err:
            live.stubs[MEM].Allocate(pb.AllocateRequest(container_requests=[
                pb.ContainerAllocateRequest(devices_ids=[mem[2]]),
                pb.ContainerAllocateRequest(devices_ids=bad)]), timeout=10)
        assert err.value.code() in REFUSALS
        assert set(os.listdir(live.settings.workspace)) == before, bad
    # ...and the units are not held: the same device can be allocated at once.
    resp = live.stubs[MEM].Allocate(pb.AllocateRequest(container_requests=[
        pb.ContainerAllocateRequest(devices_ids=[mem[2]])]), timeout=10)
    assert resp.container_responses[0].envs


async def test_multi_container_allocate_rolls_back_a_completed_record(root):
    """The second resource of a container completes its record (limits rewritten); a bad next entry in the
    same call puts the record and the region's limits back."""
    settings_ = node_settings(root)
    async with KubeletEmulator(settings_.device_plugin_dir, settings_.pod_resources_socket) as kubelet:
        async with running_agent(settings_) as running:
            await registered(kubelet)
            alloc = (await kubelet.allocate_raw(MEM, [_ids("mem")[0]]))
            assert alloc.container_responses
            ledger = running.agent.ledger
            record = next(iter(ledger.allocations.values()))
            snapshot = json.loads((settings_.workspace / record.id / ALLOCATION_FILE_NAME).read_text())
            with pytest.raises(grpc.aio.AioRpcError):
                await kubelet.plugins[SM].stub.Allocate(pb.AllocateRequest(container_requests=[
                    pb.ContainerAllocateRequest(devices_ids=_ids("sm")[:1]),
                    pb.ContainerAllocateRequest(devices_ids=["junk"])]), timeout=5)
            assert json.loads((settings_.workspace / record.id / ALLOCATION_FILE_NAME).read_text()) == snapshot
            assert list(ledger.allocations) == [record.id]
            assert SM not in record.device_ids


# -- environment ---------------------------------------------------------------------------------------------
NUMERIC = [v for v in VARIABLES if (v.parse.__doc__ or "").startswith(("integer", "number"))]
odd_text = st.one_of(
    st.text(max_size=30),
    st.text(alphabet="0123456789.-+e_xXiInNfF ", max_size=25),
    st.sampled_from(["", " ", "1e400", "nan", "inf", "-0", "0x10", "1_0", "١٢", "９", "1.", ".5", "00001"]),
)


@settings(max_examples=400, deadline=None)
@given(var=st.sampled_from(NUMERIC + [v for v in VARIABLES if v.name == "ALNAIR_SIM_GPUS"]), text=odd_text)
def test_fuzzed_settings_are_bounded_or_refused_in_one_line(var, text):
    env = {"ALNAIR_NODE_NAME": "n", "ALNAIR_GPU_BACKEND": "simulated", var.name: text}
    try:
        s = Settings.from_env(env)
    except ConfigError as e:
        assert "\n" not in str(e) and var.name in str(e) or "ALNAIR_MEMORY_UNIT_MIB" in str(e)
        return
    value = getattr(s, var.attr)
    if var.name == "ALNAIR_SIM_GPUS":
        assert 1 <= len(value) <= 64 and all(0 < g.memory_bytes <= 16 << 40 for g in value)
        return
    if text.strip() == "":
        assert value == var.parse(var.default)  # empty means the default
        return
    assert set(text.strip()) <= set("0123456789.")  # ASCII decimals only
    lo, hi = (float(x) for x in var.parse.__doc__.split()[-1].split(".."))  # type: ignore[union-attr]
    assert lo <= value <= hi


# -- the extender's request bodies ---------------------------------------------------------------------------
json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=25,
)
pod_like = st.fixed_dictionaries({}, optional={
    "metadata": st.fixed_dictionaries({}, optional={"name": json_value | st.text(max_size=10),
                                                   "namespace": json_value, "uid": json_value,
                                                   "annotations": json_value}),
    "spec": st.fixed_dictionaries({}, optional={
        "containers": st.lists(st.fixed_dictionaries({}, optional={
            "name": json_value, "resources": st.fixed_dictionaries({}, optional={
                "limits": st.dictionaries(st.sampled_from([MEM, SM, "cpu"]), json_value, max_size=3),
                "requests": json_value})}), max_size=3) | json_value,
        "initContainers": json_value, "schedulerName": json_value}),
    "status": json_value,
})
extender_args = st.fixed_dictionaries({}, optional={
    "Pod": pod_like | json_value, "NodeNames": st.lists(st.text(max_size=10), max_size=3) | json_value,
    "Nodes": json_value})


@pytest.fixture(scope="module")
def view():
    from test_scheduler import HTTP_NODES, view_of

    return view_of(HTTP_NODES)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.one_of(st.binary(max_size=200), extender_args.map(lambda a: json.dumps(a).encode()),
                      json_value.map(lambda a: json.dumps(a).encode())))
def test_fuzzed_extender_bodies_never_reach_the_internal_error_path(view, body):
    for answer in (answer_filter(body, view), answer_prioritize(body, view)):
        json.loads(answer.body)
        assert "internal error" not in answer.error, answer.error


# -- pods with odd fields ------------------------------------------------------------------------------------
@settings(max_examples=400, deadline=None)
@given(pod=st.one_of(pod_like, json_value.filter(lambda v: isinstance(v, dict))))
def test_fuzzed_pods_parse_or_are_refused_as_pods(pod):
    try:
        info = parse_pod(pod)
    except PodError:
        return
    for c in info.containers:
        assert c.units(MEM) >= 0 and c.units(SM) >= 0


async def test_agent_with_odd_pods_on_its_node_keeps_serving(root, api):
    """Odd pods bound to the node (names, quantities, statuses of every shape) reach the real pod watch."""
    from alnair_standins.apiserver import make_pod
    from alnair_standins.node import kubernetes_for

    rng = random.Random(10)
    odd_values: list[Any] = [None, "", "-1", "1e400", "NaN", "1.5", "9" * 40, "２", [], {}, True, -3, 2**70, "1Ki"]
    for i in range(30):
        pod = make_pod(f"odd-{i}", node=NODE, containers=[{"name": "main", "memory": 1, "compute": 10}])
        c = pod["spec"]["containers"][0]
        c["resources"]["limits"][rng.choice([MEM, SM])] = rng.choice(odd_values)
        if i % 3 == 0:
            pod["spec"]["initContainers"] = rng.choice(odd_values)
        if i % 4 == 0:
            pod["status"] = {"containerStatuses": rng.choice(odd_values), "phase": rng.choice(odd_values)}
        if i % 5 == 0:
            pod["metadata"]["annotations"] = {"ai.centaurus.io/placement": "".join(rng.choices(string.printable, k=40))}
        api.add_pod(pod)
    settings_ = node_settings(root)
    client = api.api_client()
    async with KubeletEmulator(settings_.device_plugin_dir, settings_.pod_resources_socket) as kubelet:
        async with running_agent(settings_, kubernetes_for(client)) as running:
            await registered(kubelet)
            await asyncio.sleep(0.5)
            assert not running.task.done()
            for i in range(30):  # they were waiting for admission, ahead of the next pod: gone now
                api.delete_pod("default", f"odd-{i}")
            await asyncio.sleep(0.2)
            api.add_pod(make_pod("fine", node=NODE, containers=[{"name": "main", "memory": 1, "compute": 10}]))
            answers = await kubelet.admit("default", "fine", "main", {MEM: 1, SM: 10})
            assert answers[MEM].envs
    await client.close()


async def test_fuzzed_bodies_against_the_extender_process(view):
    """The real `alnair-scheduler` process: every verb answers JSON to hostile bodies and keeps serving."""
    import sys

    import aiohttp

    env = os.environ | {"ALNAIR_SCHEDULER_PORT": "0", "ALNAIR_SCHEDULER_HEALTH_PORT": "0", "ALNAIR_KUBERNETES": "off"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "alnair_agent.scheduler.main", "--host", "127.0.0.1", env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    assert proc.stderr is not None
    drain: asyncio.Task[None] | None = None
    try:
        while True:
            line = json.loads(await asyncio.wait_for(proc.stderr.readline(), 20))
            if line["event"] == "scheduler_listening":
                break
        base, health = (f"http://{a}" for a in line["addresses"])

        async def drain_stderr() -> None:  # keep the pipe from filling up
            while await proc.stderr.read(65536):
                pass

        drain = asyncio.create_task(drain_stderr())
        rng = random.Random(10)
        bodies = [json.dumps(_odd_args(rng)).encode() for _ in range(40)]
        bodies += [random.Random(i).randbytes(200) for i in range(20)] + [b"", b"{}", b"[]", b"null", b"1e999"]
        async with aiohttp.ClientSession() as session:
            for body in bodies:
                for verb in ("filter", "prioritize", "bind"):
                    async with session.post(f"{base}/{verb}", data=body) as resp:
                        assert resp.status == 200, (verb, body)
                        await resp.json()
            async with session.get(f"{health}/healthz") as resp:
                assert resp.status == 200
        assert proc.returncode is None
    finally:
        if proc.returncode is None:
            proc.terminate()
            await proc.wait()
        if drain is not None:
            await drain


def _odd_json(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["none", "bool", "int", "float", "str"] + (["list", "dict"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "list":
        return [_odd_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == "dict":
        return {rng.choice(["name", "uid", "containers", "limits", "", "x"]): _odd_json(rng, depth + 1)
                for _ in range(rng.randint(0, 3))}
    return {"none": None, "bool": rng.random() < 0.5, "int": rng.randint(-(2**70), 2**70),
            "float": rng.choice([0.5, -1.0, 1e308]), "str": "".join(rng.choices(string.printable, k=8))}[kind]


def _odd_args(rng: random.Random) -> dict[str, Any]:
    """ExtenderArgs-shaped, with odd values where kube-scheduler puts pods and node names."""
    pod = {"metadata": {"name": _odd_json(rng), "namespace": "default", "uid": _odd_json(rng)},
           "spec": {"containers": [{"name": "main", "resources": {"limits": {
               rng.choice([MEM, SM]): _odd_json(rng)}}}] if rng.random() < 0.7 else _odd_json(rng)}}
    return {"Pod": pod if rng.random() < 0.8 else _odd_json(rng),
            "NodeNames": rng.choice([["gpu-a", "gpu-b"], [], _odd_json(rng)]), "Nodes": _odd_json(rng),
            "PodName": _odd_json(rng), "PodNamespace": _odd_json(rng), "PodUID": _odd_json(rng),
            "Node": _odd_json(rng)}
