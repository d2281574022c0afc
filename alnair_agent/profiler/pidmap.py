"""Host PIDs (as NVML reports them) to containers, read from a /proc tree (injectable: tests use a fake one).

Two routes, as the issue asks:
- cgroups: `/proc/<pid>/cgroup` names the pod UID and the container ID for every runtime and cgroup driver
  Kubernetes uses (cgroup v1 and v2; containerd, CRI-O, docker; systemd and cgroupfs drivers). The container ID
  becomes a container name through the pod's `status.containerStatuses[].containerID`.
- region slots: the shim records the PID of its own PID namespace and the process start time in its container's
  region. A host PID matches a slot when the last entry of `NSpid:` in `/proc/<pid>/status` equals the slot's PID
  and the start time (field 22 of `/proc/<pid>/stat`, the same in every namespace) equals the slot's. This is
  the route where processes share the host's namespaces (a bare GPU host). Slots are written by containers and
  untrusted, so this route is used only for processes the cgroups place in no Kubernetes pod, or in a pod whose
  status does not name the container yet (then only that pod's slots count): a container can never claim a
  process of another pod.
A process neither route places is unattributed; nothing is guessed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

# A pod segment in any driver's form: "pod<uid>" (cgroupfs) or "kubepods-<qos>-pod<uid_with_underscores>.slice"
# (systemd). Mirror pods of static pods have a 32-hex UID without dashes.
_POD = re.compile(r"pod([0-9a-f]{8}[-_]?[0-9a-f]{4}[-_]?[0-9a-f]{4}[-_]?[0-9a-f]{4}[-_]?[0-9a-f]{12})(?:\.slice)?$")
# The container segment right below the pod: "<id>" (cgroupfs), "cri-containerd-<id>.scope", "crio-<id>.scope",
# "docker-<id>.scope" (systemd), "crio-<id>" (CRI-O on cgroupfs). A "crio-conmon-<id>" is CRI-O's monitor, not
# the container.
_CONTAINER = re.compile(r"^(?:(?:cri-containerd|crio|docker|cri-o)-)?([0-9a-f]{64})(?:\.scope)?$")


@dataclass(frozen=True)
class CgroupPlace:
    """Where the cgroups put a process: its pod's UID and (when below the pod) its container's ID."""

    pod_uid: str
    container_id: str  # "" when the process sits in the pod's cgroup itself (e.g. the pause container's)


def parse_cgroup(text: str) -> CgroupPlace | None:
    """The pod and container of a `/proc/<pid>/cgroup` text, or None when it names no Kubernetes pod."""
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        segments = [s for s in parts[2].split("/") if s]
        for i, seg in enumerate(segments):
            m = _POD.search(seg)
            if m is None or not (seg.startswith("pod") or "-pod" in seg):
                continue
            uid = m.group(1).replace("_", "-")
            container = ""
            if i + 1 < len(segments):
                c = _CONTAINER.match(segments[i + 1])
                if c is None:
                    continue  # e.g. crio-conmon-<id>: below a pod, but no container of it
                container = c.group(1)
            return CgroupPlace(uid, container)
    return None


def container_id_of(status_id: str) -> str:
    """'containerd://<id>', 'cri-o://<id>', 'docker://<id>' (pod status) -> '<id>'."""
    return status_id.split("://", 1)[-1]


class ProcReader:
    """Reads what the mapping needs from a /proc tree. Every read may fail (the process ended): None then."""

    def __init__(self, root: Path = Path("/proc")) -> None:
        self.root = root

    def _read(self, pid: int, name: str) -> str | None:
        try:
            with open(self.root / str(pid) / name, encoding="utf-8", errors="replace") as f:
                return f.read(65536)
        except OSError:
            return None

    def cgroup(self, pid: int) -> CgroupPlace | None:
        text = self._read(pid, "cgroup")
        return None if text is None else parse_cgroup(text)

    def nspid(self, pid: int) -> list[int]:
        """`NSpid:` of /proc/<pid>/status: the PID in each nested namespace, outermost first ([pid] if absent)."""
        text = self._read(pid, "status")
        if text is None:
            return []
        for line in text.splitlines():
            if line.startswith("NSpid:"):
                try:
                    return [int(v) for v in line.split()[1:]]
                except ValueError:
                    return []
        return [pid]

    def comm(self, pid: int) -> str | None:
        """/proc/<pid>/comm: the program's name, cut to 15 characters by the kernel."""
        text = self._read(pid, "comm")
        return None if text is None else text.rstrip("\n")

    def start_time(self, pid: int) -> int | None:
        """Field 22 of /proc/<pid>/stat (start time in clock ticks since boot; the same in every namespace)."""
        text = self._read(pid, "stat")
        if text is None or ")" not in text:
            return None
        rest = text[text.rindex(")") + 2:].split()
        try:
            return int(rest[19])  # fields after "comm": state is field 3, so field 22 is index 19
        except (IndexError, ValueError):
            return None


@dataclass(frozen=True)
class SlotPid:
    """A process as a region slot records it (container-written: untrusted)."""

    alloc_id: str
    pid: int  # in the container's PID namespace
    start_time: int
    pod_uid: str = ""  # of the allocation's pod, when known


@dataclass(frozen=True)
class Place:
    """A host process placed on an allocation, and by which route."""

    alloc_id: str
    route: str  # "cgroup" | "region"


class PidMapper:
    """Host PID -> allocation. `containers` maps (pod UID, container ID) to an allocation; `slots` are the region
    slots of all allocations (for the namespace route)."""

    def __init__(self, proc: ProcReader) -> None:
        self.proc = proc

    def place(self, pid: int, containers: dict[tuple[str, str], str], slots: list[SlotPid]) -> Place | None:
        where = self.proc.cgroup(pid)
        if where is not None:
            alloc_id = containers.get((where.pod_uid, where.container_id))
            if alloc_id is not None:
                return Place(alloc_id, "cgroup")
            # A container of the pod whose ID the pod's status does not show yet (it has just started): only
            # slots of that same pod's allocations may place it, so no container can claim another pod's process.
            slots = [s for s in slots if s.pod_uid and s.pod_uid == where.pod_uid]
        if not slots:
            return None
        ns = self.proc.nspid(pid)
        if not ns:
            return None
        inner = ns[-1]
        candidates = [s for s in slots if s.pid == inner]
        if not candidates:
            return None
        started = self.proc.start_time(pid)
        matches = {s.alloc_id for s in candidates if started is not None and s.start_time == started}
        if len(matches) == 1:
            return Place(matches.pop(), "region")
        return None  # no slot, or two allocations claim it: never guess
