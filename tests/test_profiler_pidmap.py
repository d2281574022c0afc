"""Host PIDs to containers: `/proc/<pid>/cgroup` as each runtime, cgroup driver and cgroup version writes it, and
the region-slot route (NSpid + start time) for processes that share the host's namespaces."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from alnair_agent.profiler.pidmap import (
    CgroupPlace,
    PidMapper,
    ProcReader,
    SlotPid,
    container_id_of,
    parse_cgroup,
)

UID = "6f8f4f1c-2d0b-4a8e-9f3e-0b1a2c3d4e5f"
UID_ = UID.replace("-", "_")
CID = "3e1c7a8b9d0f2e4c6a8b0d2f4e6a8c0e2a4c6e8b0d2f4a6c8e0a2c4e6b8d0f2a"
V1_CONTROLLERS = ("12:pids", "11:hugetlb", "10:memory", "9:devices", "8:cpu,cpuacct", "7:blkio", "6:net_cls,net_prio",
                  "5:freezer", "4:cpuset", "3:perf_event", "2:rdma", "1:name=systemd")


def v1(path: str, unified: str = "0::/") -> str:
    """A cgroup v1 (hybrid) file: one line per hierarchy, all at `path`, plus the empty unified line."""
    return "".join(f"{c}:{path}\n" for c in V1_CONTROLLERS) + f"{unified}\n"


# (case, /proc/<pid>/cgroup text, expected place)
SAMPLES = [
    ("v2 systemd containerd burstable",
     f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
     CgroupPlace(UID, CID)),
    ("v2 systemd containerd besteffort",
     f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
     CgroupPlace(UID, CID)),
    ("v2 systemd containerd guaranteed",
     f"0::/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{CID}.scope\n", CgroupPlace(UID, CID)),
    ("v2 systemd cri-o",
     f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/crio-{CID}.scope\n",
     CgroupPlace(UID, CID)),
    ("v2 systemd cri-o conmon (not the container)",
     f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/crio-conmon-{CID}.scope\n",
     None),
    ("v2 systemd docker (cri-dockerd)",
     f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/docker-{CID}.scope\n",
     CgroupPlace(UID, CID)),
    ("v2 cgroupfs containerd (k3s)", f"0::/kubepods/burstable/pod{UID}/{CID}\n", CgroupPlace(UID, CID)),
    ("v2 cgroupfs guaranteed", f"0::/kubepods/pod{UID}/{CID}\n", CgroupPlace(UID, CID)),
    ("v2 kind (kubelet nested under systemd)",
     f"0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
     f"kubelet-kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope\n", CgroupPlace(UID, CID)),
    ("v2 pod-level cgroup (sandbox)", f"0::/kubepods/besteffort/pod{UID}\n", CgroupPlace(UID, "")),
    ("v1 cgroupfs docker (dockershim)", v1(f"/kubepods/burstable/pod{UID}/{CID}"), CgroupPlace(UID, CID)),
    ("v1 cgroupfs containerd", v1(f"/kubepods/besteffort/pod{UID}/{CID}"), CgroupPlace(UID, CID)),
    ("v1 cgroupfs cri-o", v1(f"/kubepods/burstable/pod{UID}/crio-{CID}"), CgroupPlace(UID, CID)),
    ("v1 systemd docker",
     v1(f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/docker-{CID}.scope"),
     CgroupPlace(UID, CID)),
    ("v1 systemd containerd",
     v1(f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope"),
     CgroupPlace(UID, CID)),
    ("v1 systemd cri-o",
     v1(f"/kubepods.slice/kubepods-pod{UID_}.slice/crio-{CID}.scope"), CgroupPlace(UID, CID)),
    ("static pod (mirror) uid without dashes",
     "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0123456789abcdef0123456789abcdef.slice/"
     f"cri-containerd-{CID}.scope\n", CgroupPlace("0123456789abcdef0123456789abcdef", CID)),
    ("plain docker, no Kubernetes", f"0::/system.slice/docker-{CID}.scope\n", None),
    ("v1 plain docker", v1(f"/docker/{CID}"), None),
    ("a user's shell", "0::/user.slice/user-1000.slice/session-3.scope\n", None),
    ("systemd's init", "0::/init.scope\n", None),
    ("empty or garbage", "not a cgroup file", None),
]


@pytest.mark.parametrize("text,expected", [(t, e) for _, t, e in SAMPLES], ids=[c for c, _, _ in SAMPLES])
def test_cgroup_samples(text: str, expected: CgroupPlace | None) -> None:
    assert parse_cgroup(text) == expected


@pytest.mark.parametrize("status_id", [f"containerd://{CID}", f"cri-o://{CID}", f"docker://{CID}"])
def test_container_ids_of_every_runtime(status_id: str) -> None:
    assert container_id_of(status_id) == CID


def fake_proc(root: Path, pid: int, cgroup: str, nspid: list[int], start_time: int, comm: str = "python3") -> None:
    """A /proc/<pid> with cgroup, status and stat built from this test process's own real files."""
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "cgroup").write_text(cgroup)
    status = Path("/proc/self/status").read_text().splitlines()
    status = [ln for ln in status if not ln.startswith(("NSpid:", "Pid:"))]
    (d / "status").write_text("\n".join(status + [f"Pid:\t{pid}", "NSpid:\t" + "\t".join(map(str, nspid))]) + "\n")
    real = Path("/proc/self/stat").read_text()
    fields = real[real.rindex(")") + 2:].split()
    fields[19] = str(start_time)
    (d / "stat").write_text(f"{pid} ({comm}) " + " ".join(fields) + "\n")


def test_reader_parses_real_status_and_stat(tmp_path: Path) -> None:
    fake_proc(tmp_path, 4321, "0::/init.scope\n", [4321, 17], 998877, comm="a (weird) name")
    reader = ProcReader(tmp_path)
    assert reader.nspid(4321) == [4321, 17]
    assert reader.start_time(4321) == 998877
    assert reader.cgroup(4321) is None
    assert reader.nspid(1) == [] and reader.start_time(1) is None  # gone: nothing, no exception
    own = ProcReader()  # and the real /proc agrees with itself
    assert own.nspid(os.getpid())[-1] == os.getpid() or len(own.nspid(os.getpid())) > 1
    assert own.start_time(os.getpid()) is not None


def test_cgroup_route_maps_to_the_allocation_and_never_trusts_slots_over_it(tmp_path: Path) -> None:
    other = "ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff"
    fake_proc(tmp_path, 100, f"0::/kubepods/burstable/pod{UID}/{CID}\n", [100, 1], 5)
    fake_proc(tmp_path, 101, f"0::/kubepods/burstable/pod{UID}/{other}\n", [101, 1], 6)
    mapper = PidMapper(ProcReader(tmp_path))
    containers = {(UID, CID): "alloc-a"}
    slots = [SlotPid("alloc-b", 1, 6)]  # a container claiming pid 1 started at 6: it is 101, of another container
    assert mapper.place(100, containers, slots).alloc_id == "alloc-a"
    assert mapper.place(100, containers, slots).route == "cgroup"
    assert mapper.place(101, containers, slots) is None  # in a pod, of no Alnair container: unattributed
    # a container of the pod that the pod's status does not name yet (just started): its own pod's slots place it
    assert mapper.place(101, containers, [SlotPid("alloc-c", 1, 6, pod_uid=UID)]).route == "region"
    assert mapper.place(101, containers, [SlotPid("alloc-c", 1, 6, pod_uid="another-pod")]) is None


def test_region_route_for_processes_of_the_host_namespaces(tmp_path: Path) -> None:
    host = "0::/user.slice/user-1000.slice/session-3.scope\n"
    fake_proc(tmp_path, 200, host, [200], 70)  # shares the host's PID namespace: its slot records 200
    fake_proc(tmp_path, 201, host, [201, 9], 71)  # its own PID namespace (e.g. docker run): the slot says 9
    fake_proc(tmp_path, 202, host, [202, 9], 72)  # another namespace's pid 9
    fake_proc(tmp_path, 203, host, [203], 73)  # on the GPU, in no container
    mapper = PidMapper(ProcReader(tmp_path))
    slots = [SlotPid("alloc-a", 200, 70), SlotPid("alloc-b", 9, 71), SlotPid("alloc-c", 9, 72)]
    assert mapper.place(200, {}, slots).alloc_id == "alloc-a"
    assert mapper.place(200, {}, slots).route == "region"
    assert mapper.place(201, {}, slots).alloc_id == "alloc-b"  # same inner pid, told apart by start time
    assert mapper.place(202, {}, slots).alloc_id == "alloc-c"
    assert mapper.place(203, {}, slots) is None
    assert mapper.place(999, {}, slots) is None  # ended before we looked
    # a slot with the right pid but another start time is a reused pid: not that process
    assert mapper.place(200, {}, [SlotPid("alloc-a", 200, 69)]) is None
    # two allocations claiming the same process: never guess
    assert mapper.place(200, {}, [SlotPid("alloc-a", 200, 70), SlotPid("alloc-x", 200, 70)]) is None
