"""The profiler's merging rules with stand-ins for its neighbours (pod watch, annotation writer, backend): what
it writes never drops entries it does not own, never writes before the pods are known, never carries a deleted
pod's entries onto a new pod of the same name, and adds a container's samples up as documented."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from alnair_agent.constants import USAGE_ANNOTATION
from alnair_agent.gpu.backend import GpuSample, ProcessSample, Samples
from alnair_agent.kube.pods import PodInfo, parse_pod
from alnair_agent.node.workspace import Allocation, Workspace
from alnair_agent.profiler.service import Profiler
from alnair_standins.apiserver import make_pod

GPU = "GPU-0b8a5f29-a68d-c604-39f3-5174ded264da"
CID = "ab" * 32


@dataclass
class Pods:
    synced: bool = True
    by_name: dict[tuple[str, str], PodInfo] = field(default_factory=dict)

    def get(self, uid: str) -> PodInfo | None:
        return next((p for p in self.by_name.values() if p.uid == uid), None)

    def find(self, namespace: str, name: str) -> PodInfo | None:
        return self.by_name.get((namespace, name))


@dataclass
class Sink:
    writes: list[tuple[str, str, dict]] = field(default_factory=list)

    def set_pod(self, namespace: str, name: str, annotations: dict) -> None:
        self.writes.append((namespace, name, dict(annotations)))

    def set_node(self, annotations: dict) -> None: ...

    async def flush(self, timeout: float, pod: tuple[str, str] | None = None) -> bool:
        return True

    def forget_pod(self, namespace: str, name: str) -> None: ...


@dataclass
class Backend:
    samples: Samples = Samples()

    def sample(self) -> Samples:
        return self.samples


@dataclass
class Ledger:
    allocations: dict[str, Allocation] = field(default_factory=dict)


def pod_info(name: str, uid: str, usage: dict | None = None, containers=("main",)) -> PodInfo:
    obj = make_pod(name, uid=uid, containers=[{"name": c, "memory": 1} for c in containers])
    if usage is not None:
        obj["metadata"]["annotations"] = {USAGE_ANNOTATION: json.dumps(usage)}
    info = parse_pod(obj)
    return replace(info, container_ids=tuple((c, CID) for c in containers))


def alloc(alloc_id: str, pod: str, uid: str, container: str = "main") -> Allocation:
    return Allocation(alloc_id, GPU, {}, {}, 1 << 30, 0, "default", pod, uid, container, created_at=1_700_000_000.0)


def written(sink: Sink) -> dict:
    return json.loads(sink.writes[-1][2][USAGE_ANNOTATION])


def make(tmp_path: Path, pods: Pods, allocs: list[Allocation], samples: Samples | None = None) -> tuple[Profiler, Sink]:
    sink = Sink()
    ledger = Ledger({a.id: a for a in allocs})
    p = Profiler(Backend(samples or Samples()), ledger, Workspace(tmp_path), pods, sink, 1.0, 30.0,  # type: ignore[arg-type]
                 proc_root=tmp_path / "proc")
    return p, sink


async def test_merges_into_what_the_pod_has_and_waits_for_the_pod_watch(tmp_path: Path) -> None:
    pods = Pods(synced=False)
    a = alloc("00000000000000a1", "p", "uid-1")
    p, sink = make(tmp_path, pods, [a])
    p.seen(a)
    assert sink.writes == []  # the pods' annotations are unknown yet: writing now could drop what is there
    pods.synced = True
    pods.by_name[("default", "p")] = pod_info("p", "uid-1", {"other": {"x": 1}, "main": {"allocation": "old"}})
    p.seen(a)
    got = written(sink)
    assert got["other"] == {"x": 1}  # not ours: kept
    assert got["main"]["allocation"] == "00000000000000a1" and got["main"]["observed_seconds"] == 0
    p.seen(a)
    assert len(sink.writes) == 1  # rate limit: one write per pod per interval


async def test_resumes_the_same_allocation_after_a_restart(tmp_path: Path) -> None:
    earlier = {"main": {"allocation": "00000000000000a1", "observed_seconds": 10.0, "gpu_util_mean": 40.0, "gpu_util_max": 90.0,
                        "memcpy_util_mean": 5.0, "memcpy_util_max": 7.0, "memory_max_bytes": 123,
                        "throttled_seconds": 2.0, "first_seen": "2026-12-01T00:00:00Z",
                        "last_seen": "2026-12-01T00:00:10Z"}}
    pods = Pods(by_name={("default", "p"): pod_info("p", "uid-1", earlier)})
    a = alloc("00000000000000a1", "p", "uid-1")
    p, sink = make(tmp_path, pods, [a])
    p.seen(a)
    got = written(sink)["main"]
    assert (got["observed_seconds"], got["gpu_util_mean"], got["gpu_seconds"], got["throttled_seconds"]) == (
        10.0, 40.0, 4.0, 2.0)
    assert got["first_seen"] == "2026-12-01T00:00:00Z" and got["memory_max_bytes"] == 123
    b = alloc("00000000000000b1", "q", "uid-2")  # another allocation: figures of an older one are not its own
    pods.by_name[("default", "q")] = pod_info("q", "uid-2", {"main": earlier["main"]})
    p.ledger.allocations["00000000000000b1"] = b
    p.seen(b)
    assert written(sink)["main"]["observed_seconds"] == 0


async def test_ended_entries_stay_for_their_pod_and_never_reach_a_new_pod_of_the_same_name(tmp_path: Path) -> None:
    pods = Pods(by_name={("default", "s-0"): pod_info("s-0", "uid-1", containers=("init", "main"))})
    first, second = alloc("00000000000000c1", "s-0", "uid-1", "init"), alloc("00000000000000d1", "s-0", "uid-1", "main")
    p, sink = make(tmp_path, pods, [first, second])
    assert await p.final(first)
    p.forget(first)
    del p.ledger.allocations["00000000000000c1"]
    p._published.clear()
    p.seen(second)
    assert set(written(sink)) == {"init", "main"} and written(sink)["init"]["state"] == "ended"
    # the StatefulSet's pod is deleted and made again under the same name, faster than a tick
    pods.by_name[("default", "s-0")] = pod_info("s-0", "uid-2", containers=("main",))
    third = alloc("00000000000000d2", "s-0", "uid-2", "main")
    p.ledger.allocations = {"00000000000000d2": third}
    await p.tick()
    p._published.clear()
    p.seen(third)
    assert set(written(sink)) == {"main"} and written(sink)["main"]["allocation"] == "00000000000000d2"


async def test_a_container_retired_while_a_pass_gives_the_loop_back_keeps_its_final_figures(tmp_path: Path) -> None:
    """A pass over every pod (`seen_all`, and the tick's `_publish_due`) gives the loop back every few pods written;
    the reconciler or an unprepare may retire one of a later pod's containers meanwhile (its final figures written
    earlier, e.g. held back by an API outage). That pod's write must carry the container's final figures, not a
    fresh entry made again for an allocation no longer held (its figures reset, and an entry never forgotten)."""
    import asyncio

    names = [f"q{i}" for i in range(8)]  # written first: the pass gives the loop back after them
    pods = Pods(by_name={("default", n): pod_info(n, f"uid-{n}") for n in names})
    pods.by_name[("default", "s")] = pod_info("s", "uid-s", containers=("init", "main"))
    first = [alloc(f"00000000000000{i:02x}", n, f"uid-{n}") for i, n in enumerate(names)]
    init, main = alloc("00000000000000e1", "s", "uid-s", "init"), alloc("00000000000000e2", "s", "uid-s", "main")
    p, sink = make(tmp_path, pods, [*first, init, main])

    assert await p.final(init)  # its last figures, set a while ago
    p._published.clear()  # ... more than an interval ago: the pod is due again

    async def retired() -> None:  # runs when the pass first gives the loop back
        p.forget(init)
        del p.ledger.allocations[init.id]

    retire = asyncio.create_task(retired())
    await p.seen_all([*first, main])
    await retire
    [last] = [w for w in sink.writes if w[1] == "s"][-1:]
    entries = json.loads(last[2][USAGE_ANNOTATION])
    assert entries["init"]["state"] == "ended" and entries["main"]["state"] != "ended"
    assert init.id not in p.usage


async def test_samples_add_up_for_the_container_of_the_process(tmp_path: Path) -> None:
    proc = tmp_path / "proc" / "4242"
    proc.mkdir(parents=True)
    samples = Samples((GpuSample(GPU, 50.0, 10.0),),
                      (ProcessSample(GPU, 4242, 30.0, 8.0, 1 << 20), ProcessSample(GPU, 999, 20.0, 2.0, 5)), 2.0)
    uid = "6f8f4f1c-2d0b-4a8e-9f3e-0b1a2c3d4e5f"
    (proc / "cgroup").write_text(f"0::/kubepods/burstable/pod{uid}/{CID}\n")
    pods = Pods(by_name={("default", "p"): pod_info("p", uid)})
    a = alloc("00000000000000a1", "p", uid)
    p, sink = make(tmp_path, pods, [a], samples)
    await p.tick()
    await p.tick()
    u = p.usage["00000000000000a1"]
    assert (u.observed_s, u.gpu_seconds, u.gpu_util_max, u.memcpy_util_max, u.memory_max_bytes) == (
        4.0, 1.2, 30.0, 8.0, 1 << 20)
    assert p.unattributed == {GPU: 1}  # pid 999: in no container


@dataclass
class CountingBackend(Backend):
    at: list[float] = field(default_factory=list)

    def sample(self) -> Samples:
        import time

        self.at.append(time.monotonic())
        return self.samples


def capped(alloc_id: str, cap: int, pod: str) -> Allocation:
    return Allocation(alloc_id, GPU, {}, {}, 1 << 30, cap, "default", pod, "", "main", created_at=1_700_000_000.0)


def write_slot(region: Path, pid: int, start_time: int | None, gpu_ns: int, launches: int = 0) -> None:
    """What a container's shim writes in its region's first slot: its pid (and start time), the GPU time it
    counted (capped), its launches."""
    import struct

    from alnair_agent.node import region_layout as L

    with open(region, "r+b") as f:
        f.seek(L.absolute_offset("alnair_region_slot", "pid"))
        f.write(struct.pack("<i", pid))
        if start_time is not None:
            f.seek(L.absolute_offset("alnair_region_slot", "start_time"))
            f.write(struct.pack("<Q", start_time))
        f.seek(L.absolute_offset("alnair_region_slot", "gpu_ns"))
        f.write(struct.pack("<Q", gpu_ns))
        f.seek(L.absolute_offset("alnair_region_slot", "launches"))
        f.write(struct.pack("<Q", launches))


async def test_a_capped_containers_utilization_is_the_gpu_time_its_shim_counted(tmp_path: Path) -> None:
    """Capped containers: their GPU time as their shims counted it in their turns (the slots' gpu_ns), not NVML's
    per-process draw; scaled down by one factor where they claim more than the device's (exact) utilization."""
    import time


    ws = Workspace(tmp_path / "ws")
    ws.ensure()
    a, b = capped("00000000000000a1", 30, "p"), capped("00000000000000b1", 70, "q")
    regions = {x.id: ws.create(x) for x in (a, b)}
    backend = Backend(Samples((GpuSample(GPU, 99.0),), (ProcessSample(GPU, 4242, 100.0, 0.0, 5),), 1.0))
    p = Profiler(backend, Ledger({a.id: a, b.id: b}), ws, Pods(), Sink(), 1.0, 30.0,  # type: ignore[arg-type]
                 proc_root=tmp_path / "proc")
    counted = {a.id: 0, b.id: 0}

    def run_for(seconds: float, shares: dict[str, float]) -> None:
        for alloc_id, share in shares.items():
            counted[alloc_id] += int(share / 100 * seconds * 1e9)
            write_slot(ws.container_folder(alloc_id) / "region", 4242, None, counted[alloc_id])

    run_for(0.0, {a.id: 0, b.id: 0})
    await p.tick()  # the baseline
    for share_a, share_b, device, want in ((30.0, 69.0, 99.0, (30.0, 69.0)), (40.0, 80.0, 96.0, (32.0, 64.0))):
        backend.samples = Samples((GpuSample(GPU, device),), (), 1.0)
        before = {k: p.usage[k].gpu_util_integral for k in counted}
        t = p._regions_at
        run_for(1.0, {a.id: share_a, b.id: share_b})
        while time.monotonic() < t + 1.0:
            time.sleep(0.01)
        await p.tick()
        got = tuple(round((p.usage[k].gpu_util_integral - before[k]) / backend.samples.window_s)
                    for k in (a.id, b.id))
        assert all(abs(g - w) <= 2 for g, w in zip(got, want, strict=True)), (got, want)
    for r in regions.values():
        r.close()


@pytest.mark.parametrize(("comm", "want", "want_mem"), [("nvidia-cuda-mps", (30, 69), (7.9, 18.1)),
                                                      ("python3", (0, 0), (0.0, 0.0))])
async def test_an_mps_servers_figure_is_its_clients_work_not_a_strangers(tmp_path: Path, comm: str,
                                                                        want: tuple[int, int],
                                                                        want_mem: tuple[float, float]) -> None:
    """Under MPS (ALNAIR_MPS_PIPE_DIR) NVML books every client's work to the server, a process of no container: its
    figure must not be taken off what the capped containers can have run, as a stranger's is (a stranger at 99 % of
    a 99 % busy GPU leaves the capped containers nothing), and its memory figure (26 %, the clients' traffic: an
    H100's server read 26 % beside two matmul clients) is the capped containers' to split by their GPU time; a
    stranger's memory traffic is not theirs."""
    import time

    ws = Workspace(tmp_path / "ws")
    ws.ensure()
    a, b = capped("00000000000000a1", 30, "p"), capped("00000000000000b1", 70, "q")
    regions = {x.id: ws.create(x) for x in (a, b)}
    server = tmp_path / "proc" / "5555"
    server.mkdir(parents=True)
    (server / "comm").write_text(comm + "\n")
    (server / "cgroup").write_text("0::/system.slice/nvidia-mps.service\n")
    backend = Backend(Samples((GpuSample(GPU, 99.0),), (ProcessSample(GPU, 5555, 99.0, 26.0, 5),), 1.0))
    p = Profiler(backend, Ledger({a.id: a, b.id: b}), ws, Pods(), Sink(), 1.0, 30.0,  # type: ignore[arg-type]
                 proc_root=tmp_path / "proc")
    counted = {a.id: 0, b.id: 0}
    for alloc_id in counted:
        write_slot(ws.container_folder(alloc_id) / "region", 4242, None, 0)
    await p.tick()  # the baseline
    before = {k: p.usage[k].gpu_util_integral for k in counted}
    before_mem = {k: p.usage[k].memcpy_util_integral for k in counted}
    t = p._regions_at
    for alloc_id, share in ((a.id, 30.0), (b.id, 69.0)):
        write_slot(ws.container_folder(alloc_id) / "region", 4242, None, int(share / 100 * 1e9))
    while time.monotonic() < t + 1.0:
        time.sleep(0.01)
    await p.tick()
    got = tuple(round((p.usage[k].gpu_util_integral - before[k]) / backend.samples.window_s) for k in (a.id, b.id))
    assert all(abs(g - w) <= 2 for g, w in zip(got, want, strict=True)), (got, want)
    mem = tuple((p.usage[k].memcpy_util_integral - before_mem[k]) / backend.samples.window_s for k in (a.id, b.id))
    assert all(abs(g - w) <= 1 for g, w in zip(mem, want_mem, strict=True)), (mem, want_mem)
    assert p.unattributed == {GPU: 1}  # the server is still on no container
    for r in regions.values():
        r.close()


@pytest.mark.parametrize(("comm", "want"), [
    ("nvidia-cuda-mps", {"cap": (30.0, 6.7), "u1": (45.0, 10.0), "u2": (15.0, 3.3), "idle": None}),
    # a stranger's 90 % leaves the capped container 5 of the device's 95, and the uncapped ones their own (0)
    ("python3", {"cap": (5.0, 0.0), "u1": (0.0, 0.0), "u2": (0.0, 0.0), "idle": None}),
])
async def test_under_mps_uncapped_containers_get_what_the_server_ran_beyond_the_capped_ones(
        tmp_path: Path, comm: str, want: dict[str, tuple[float, float] | None]) -> None:
    """Under MPS an uncapped client's own NVML samples read 0 (the server holds its work; its shim times nothing).
    What the server ran beyond the capped containers' figures is the uncapped clients': the server at 90 % beside a
    capped container that ran 30 leaves 60, split by the launches the uncapped ones counted (300 and 100: 45 and
    15); one that launched nothing gets nothing; the server's memory traffic (20 %) split by those figures. A
    stranger's figure is nobody's."""
    import time

    ws = Workspace(tmp_path / "ws")
    ws.ensure()
    allocs = {"cap": capped("00000000000000c1", 30, "p"), "u1": capped("00000000000000d1", 0, "q"),
              "u2": capped("00000000000000d2", 0, "r"), "idle": capped("00000000000000d3", 0, "s")}
    regions = {a.id: ws.create(a) for a in allocs.values()}
    server = tmp_path / "proc" / "5555"
    server.mkdir(parents=True)
    (server / "comm").write_text(comm + "\n")
    (server / "cgroup").write_text("0::/system.slice/nvidia-mps.service\n")
    backend = Backend(Samples((GpuSample(GPU, 95.0),), (ProcessSample(GPU, 5555, 90.0, 20.0, 5),), 1.0))
    p = Profiler(backend, Ledger({a.id: a for a in allocs.values()}), ws, Pods(), Sink(), 1.0, 30.0,  # type: ignore[arg-type]
                 proc_root=tmp_path / "proc")
    for a in allocs.values():
        write_slot(ws.container_folder(a.id) / "region", 4242, None, 0, 1000)
    await p.tick()  # the baseline
    before = {k: (p.usage[a.id].gpu_util_integral, p.usage[a.id].memcpy_util_integral, p.usage[a.id].observed_s)
              for k, a in allocs.items()}
    t = p._regions_at
    for k, gpu_ns, launches in (("cap", int(0.3e9), 1000), ("u1", 0, 1300), ("u2", 0, 1100), ("idle", 0, 1000)):
        write_slot(ws.container_folder(allocs[k].id) / "region", 4242, None, gpu_ns, launches)
    while time.monotonic() < t + 1.0:
        time.sleep(0.01)
    await p.tick()
    for k, a in allocs.items():
        u = p.usage[a.id]
        util = (u.gpu_util_integral - before[k][0]) / backend.samples.window_s
        mem = (u.memcpy_util_integral - before[k][1]) / backend.samples.window_s
        expected = want[k]
        if expected is None:  # no sample: it ran nothing
            assert u.observed_s == before[k][2], k
            continue
        assert abs(util - expected[0]) <= 2 and abs(mem - expected[1]) <= 0.5, (k, util, mem, expected)
    for r in regions.values():
        r.close()


async def test_capped_containers_share_the_memory_traffic_nvml_drew_for_one_of_them(tmp_path: Path) -> None:
    """On a time-sliced GPU NVML's per-process memory figure is a draw: an H100 gave one of two capped matmul
    processes the device's whole 24 % every second and the other 0. Each capped container gets its part of what the
    capped processes drew together, by the GPU time its shim counted (30 and 60 here: 8 and 16)."""
    import time


    ws = Workspace(tmp_path / "ws")
    ws.ensure()
    a, b = capped("00000000000000a2", 30, "p"), capped("00000000000000b2", 60, "q")
    pids = {a.id: 4242, b.id: 4343}
    for pid in pids.values():  # processes sharing the host's namespaces, placed by their region slots
        d = tmp_path / "proc" / str(pid)
        d.mkdir(parents=True)
        (d / "status").write_text(f"Pid:\t{pid}\nNSpid:\t{pid}\n")
        (d / "stat").write_text(f"{pid} (python3) S " + " ".join(["0"] * 18) + f" {pid + 7}\n")
    regions = {x.id: ws.create(x) for x in (a, b)}
    drawn = (ProcessSample(GPU, 4242, 99.0, 24.0, 5), ProcessSample(GPU, 4343, 0.0, 0.0, 5))
    backend = Backend(Samples((GpuSample(GPU, 95.0),), drawn, 1.0))
    p = Profiler(backend, Ledger({a.id: a, b.id: b}), ws, Pods(), Sink(), 1.0, 30.0,  # type: ignore[arg-type]
                 proc_root=tmp_path / "proc")
    counted = {a.id: 0, b.id: 0}

    def run_for(seconds: float, shares: dict[str, float]) -> None:
        for alloc_id, share in shares.items():
            counted[alloc_id] += int(share / 100 * seconds * 1e9)
            write_slot(ws.container_folder(alloc_id) / "region", pids[alloc_id], pids[alloc_id] + 7,
                       counted[alloc_id])

    run_for(0.0, {a.id: 0, b.id: 0})
    await p.tick()  # the baseline
    for _ in range(2):
        before = {k: p.usage[k].memcpy_util_integral for k in counted}
        t = p._regions_at
        run_for(1.0, {a.id: 30.0, b.id: 60.0})
        while time.monotonic() < t + 1.0:
            time.sleep(0.01)
        await p.tick()
        got = [(p.usage[k].memcpy_util_integral - before[k]) / backend.samples.window_s for k in (a.id, b.id)]
        assert abs(got[0] - 8.0) <= 1 and abs(got[1] - 16.0) <= 1, got
    for r in regions.values():
        r.close()


GPU1 = "GPU-7c1d2e3f-0000-4000-8000-000000000001"


def part(alloc_id: str, gpu: str, k: int, pod: str = "p", uid: str = "uid-1") -> Allocation:
    """A container's allocation on the k-th of its two GPUs (GPU, then GPU1)."""
    return Allocation(alloc_id, gpu, {}, {}, 1 << 30, 0, "default", pod, uid, "main", created_at=1_700_000_000.0,
                      part=k, gpus=[GPU, GPU1])


async def test_a_process_on_two_gpus_counts_on_each_for_its_containers_allocation_there(tmp_path: Path) -> None:
    """One process of a two-GPU container, placed by its cgroup, seen by NVML on both GPUs: each GPU's figures go to
    the container's allocation on that GPU (not both to one of them), and the pod's entry holds both, apart."""
    proc = tmp_path / "proc" / "4242"
    proc.mkdir(parents=True)
    uid = "6f8f4f1c-2d0b-4a8e-9f3e-0b1a2c3d4e5f"
    (proc / "cgroup").write_text(f"0::/kubepods/burstable/pod{uid}/{CID}\n")
    samples = Samples((GpuSample(GPU, 50.0, 10.0), GpuSample(GPU1, 20.0, 0.0)),
                      (ProcessSample(GPU, 4242, 40.0, 8.0, 3 << 20), ProcessSample(GPU1, 4242, 15.0, 1.0, 1 << 20)),
                      2.0)
    pods = Pods(by_name={("default", "p"): pod_info("p", uid)})
    # the second GPU's allocation made first: the entry's order is the container's, not the ledger's
    second, first = part("00000000000000b1", GPU1, 1, uid=uid), part("00000000000000a1", GPU, 0, uid=uid)
    p, sink = make(tmp_path, pods, [second, first], samples)
    await p.tick()
    await p.tick()
    u0, u1 = p.usage[first.id], p.usage[second.id]
    assert (u0.gpu_util_max, u0.memory_max_bytes, u0.gpu_seconds) == (40.0, 3 << 20, 1.6)
    assert (u1.gpu_util_max, u1.memory_max_bytes, u1.gpu_seconds) == (15.0, 1 << 20, 0.6)
    assert p.unattributed == {GPU: 0, GPU1: 0}
    p._published.clear()
    p.seen(first)
    entry = written(sink)["main"]
    assert [g["gpu"] for g in entry["gpus"]] == [GPU, GPU1]
    assert [g["gpu_util_max"] for g in entry["gpus"]] == [40.0, 15.0]
    assert entry["gpu"] == f"{GPU},{GPU1}" and entry["allocation"] == f"{first.id},{second.id}"
    assert (entry["gpu_util_max"], entry["memory_max_bytes"], entry["gpu_seconds"]) == (55.0, 4 << 20, 2.2)


async def test_a_two_gpu_container_resumes_each_gpu_from_its_own_figures_and_ends_whole(tmp_path: Path) -> None:
    def earlier(alloc_id: str, gpu: str, observed: float) -> dict:
        return {"gpu": gpu, "allocation": alloc_id, "observed_seconds": observed, "gpu_util_mean": 50.0,
                "first_seen": "2026-12-01T00:00:00Z", "last_seen": "2026-12-01T00:00:10Z"}
    found = {"main": {"gpu": f"{GPU},{GPU1}", "gpus": [earlier("00000000000000a1", GPU, 10.0),
                                                       earlier("00000000000000b1", GPU1, 4.0)]}}
    pods = Pods(by_name={("default", "p"): pod_info("p", "uid-1", found)})
    first, second = part("00000000000000a1", GPU, 0), part("00000000000000b1", GPU1, 1)
    p, sink = make(tmp_path, pods, [first, second])
    p.seen(first)
    entry = written(sink)["main"]
    assert [g["observed_seconds"] for g in entry["gpus"]] == [10.0, 4.0]  # each carries on from its own
    assert [g["gpu_seconds"] for g in entry["gpus"]] == [5.0, 2.0] and entry["gpu_seconds"] == 7.0
    # the container ends: its last figures are written with both GPUs, and stay after the allocations go
    assert await p.final(first) and await p.final(second)
    for a in (first, second):
        p.forget(a)
        del p.ledger.allocations[a.id]
    p._published.clear()
    p._publish(("default", "p"), 0.0)
    entry = written(sink)["main"]
    assert entry["state"] == "ended" and [g["state"] for g in entry["gpus"]] == ["ended", "ended"]
    assert [g["allocation"] for g in entry["gpus"]] == [first.id, second.id]


async def test_a_placed_process_stays_placed_while_it_is_the_same_process(tmp_path: Path) -> None:
    """A container's process whose evidence goes for a sample (its slot reclaimed as it exits while the driver still
    lists it) keeps its allocation, never flickers to unattributed; a new process under the same pid (another start
    time) is placed afresh: unattributed when nothing places it."""
    proc = tmp_path / "proc" / "4242"
    proc.mkdir(parents=True)
    samples = Samples((GpuSample(GPU, 50.0, 10.0),), (ProcessSample(GPU, 4242, 30.0, 8.0, 1 << 20),), 1.0)
    uid = "6f8f4f1c-2d0b-4a8e-9f3e-0b1a2c3d4e5f"
    stat = "4242 (app) S " + " ".join(["0"] * 18) + " {start} 0 0\n"  # field 22: start time
    (proc / "stat").write_text(stat.format(start=777))
    (proc / "cgroup").write_text(f"0::/kubepods/burstable/pod{uid}/{CID}\n")
    pods = Pods(by_name={("default", "p"): pod_info("p", uid)})
    a = alloc("00000000000000a1", "p", uid)
    p, _ = make(tmp_path, pods, [a], samples)
    for cgroup, start, want in [
        (f"0::/kubepods/burstable/pod{uid}/{CID}\n", 777, 0),  # placed by its cgroup
        ("0::/\n", 777, 0),  # its cgroup says nothing for a moment: the same process stays placed
        ("0::/\n", 777, 0),
        ("0::/\n", 778, 1),  # another process under the same pid: nothing places it
        (f"0::/kubepods/burstable/pod{uid}/{CID}\n", 778, 0),
    ]:
        (proc / "cgroup").write_text(cgroup)
        (proc / "stat").write_text(stat.format(start=start))
        await p.tick()
        assert p.unattributed == {GPU: want}, (cgroup, start)
