"""Per-container workspaces on the host: ALNAIR_WORKSPACE/<allocation-id>/{allocation.json, run/region}.

Only `run/` is mounted into the container. The container can write anything there (it is untrusted), so the
record the agent restarts from lives beside it, out of reach, and the region is opened without following links.

The allocation record is what survives an agent restart; it is written atomically (temp file + rename) before
kubelet gets the Allocate answer, so no answered allocation is ever unknown after a restart.

Spares (`make_spare`, in ALNAIR_WORKSPACE/.spares/): a folder with its `run/`, a region without limits and an empty
temporary record, made ahead of need, outside the allocations' namespace, so a creation that takes one
(`create(alloc, spare)`) renames it into place and only writes the limits and the record, creating no file: making
files (an inode each, half a millisecond on a slow disk) is most of a DRA prepare's own cost. No container ever sees
a spare (nothing names it before the rename, and its record is written after), and spares are never kept across
restarts: `load_all` removes them, as it removes any folder without a record.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import structlog

from alnair_agent.constants import (
    ALLOCATION_FILE_NAME,
    CONTAINER_FOLDER_NAME,
    REGION_FILE_NAME,
    RESOURCE_MEMORY,
    RESOURCES,
)
from alnair_agent.node import region_layout as L
from alnair_agent.node.region import AgentBlock, Board, Region, RegionError

log = structlog.get_logger(__name__)

_ID_RE = re.compile(r"^[0-9a-f]{16}$")
SPARES_FOLDER_NAME = ".spares"  # hidden, and never an allocation id
BOARDS_FOLDER_NAME = ".boards"  # one board per GPU (region_layout's board), named by its UUID
_UUID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def new_allocation_id() -> str:
    return secrets.token_hex(8)


@dataclass
class ClaimShare:
    """DRA front-end: the ResourceClaim allocation result an allocation serves (one per result of Alnair's driver).
    Its containers share the one slice: one folder, one region, one set of limits. Results a container takes
    together (several GPUs) are one group: each its own record, listed in `Allocation.gpus` in GPU index order."""

    namespace: str
    name: str
    uid: str
    request: str  # the claim's request (or "<request>/<subrequest>") the result answers
    pool: str
    device: str
    share_id: str = ""  # the result's shareID (consumable capacity), "" where kube-scheduler set none
    # the claim's requests whose results a container takes together (alnair_agent/dra/groups.py), comma-joined; with
    # Allocation.gpus and .part it places this result among them ("" in records made before groups)
    group: str = ""

    def describe(self) -> str:
        return f"claim {self.namespace}/{self.name} request {self.request!r} on {self.pool}/{self.device}"


@dataclass
class Allocation:
    """One container's slice of one GPU, as recorded on disk (DRA: one claim result's slice, which every container
    using that result shares)."""

    id: str
    gpu_uuid: str
    device_ids: dict[str, list[str]]  # resource -> device IDs kubelet allocated
    wanted: dict[str, int]  # resource -> units the container asks for (known from its pod, or as allocated)
    memory_limit: int  # bytes written into the region (0 = none)
    compute_limit: int  # percent written into the region (0 = none)
    namespace: str = ""
    pod_name: str = ""
    pod_uid: str = ""
    container: str = ""  # DRA: the pod's containers using the claim result, comma-separated (the usage key)
    created_at: float = field(default_factory=time.time)
    claim: ClaimShare | None = None  # DRA: the claim result; None for a container the device plugin admitted
    # A container of several GPUs (alnair/vgpu-count) has one allocation per GPU, each with its own folder, region
    # and the per-GPU share of the units; `gpus` lists the container's GPUs in the order it sees them (empty for a
    # one-GPU container) and `part` is this allocation's position in it (its GPU is gpus[part]).
    part: int = 0
    gpus: list[str] = field(default_factory=list)
    # Memory asked as a percent of the GPU (alnair/vgpu-memory-percent): `wanted`'s memory is that share of this
    # GPU's units and is held from the record's creation (kubelet allocates no memory devices for it).
    memory_percent: int = 0

    @property
    def identified(self) -> bool:
        return bool(self.pod_uid or self.pod_name)

    def serves(self, container: str) -> bool:
        """Whether `container` (a name in the record's pod) is one this allocation gives its slice to."""
        return bool(container) and container in self.container.split(",")

    def missing(self) -> list[str]:
        """Resources the container asks for that kubelet has not allocated yet."""
        return [r for r in RESOURCES if self.wanted.get(r, 0) > len(self.device_ids.get(r, []))
                and not (r == RESOURCE_MEMORY and self.memory_percent)]

    def all_ids(self) -> set[str]:
        return {i for ids in self.device_ids.values() for i in ids}

    def ref(self) -> str | None:
        """namespace/pod for logs; None when unidentified."""
        return f"{self.namespace}/{self.pod_name}" if self.identified else None

    def describe(self) -> str:
        who = f"{self.namespace}/{self.pod_name}/{self.container}" if self.identified else "unidentified container"
        return f"allocation {self.id} ({who})"


def _record_from_json(data: object) -> Allocation:
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    try:
        alloc = Allocation(**data)
        if alloc.claim is not None:
            if not isinstance(alloc.claim, dict):
                raise ValueError("claim must be a JSON object")
            alloc.claim = ClaimShare(**alloc.claim)
            if not all(isinstance(v, str) for v in vars(alloc.claim).values()):
                raise ValueError("claim fields must be strings")
    except TypeError as e:
        raise ValueError(str(e)) from None
    if not _ID_RE.match(str(alloc.id)):
        raise ValueError(f"bad allocation id {alloc.id!r}")
    for name, mapping in (("device_ids", alloc.device_ids), ("wanted", alloc.wanted)):
        if not isinstance(mapping, dict) or not set(mapping) <= set(RESOURCES):
            raise ValueError(f"{name} must map {RESOURCES} to values")
    if not all(isinstance(i, str) for ids in alloc.device_ids.values() for i in ids):
        raise ValueError("device_ids must be strings")
    if not all(isinstance(v, int) and v >= 0 for v in alloc.wanted.values()):
        raise ValueError("wanted must be non-negative integers")
    if isinstance(alloc.memory_percent, bool) or not isinstance(alloc.memory_percent, int) or not (
            0 <= alloc.memory_percent <= 100):
        raise ValueError(f"memory_percent {alloc.memory_percent!r} is not 0..100")
    if not isinstance(alloc.gpus, list) or not all(isinstance(g, str) and g for g in alloc.gpus):
        raise ValueError("gpus must be a list of GPU UUIDs")
    if (isinstance(alloc.part, bool) or not isinstance(alloc.part, int)
            or not (0 <= alloc.part < len(alloc.gpus) or alloc.part == 0 == len(alloc.gpus))
            or (alloc.gpus and alloc.gpus[alloc.part] != alloc.gpu_uuid)):
        raise ValueError(f"part {alloc.part!r} does not name gpu_uuid's position in gpus")
    return alloc


@dataclass(frozen=True)
class Spare:
    """A folder made ahead (`Workspace.make_spare`): its name under the spares folder, and its region, open (no
    limits yet; `close` it when the spare is not taken)."""

    name: str
    region: Region

    def close(self) -> None:
        self.region.close()


class WorkspaceError(Exception):
    """The workspace folder cannot be used (a file, under a file, read-only, missing and not creatable)."""


# Modes: the tightest that work. The agent (root) is the only host user that needs any of it. A container sees
# only its own `run/` (a bind mount: the host folders above it are never traversed from inside the container),
# so `run/` is 0755 (the container's user, whatever its uid, lists it; only root in the container can add
# files) and the region 0666 (any container uid maps it read-write), while every folder above them is 0700:
# no other host user reaches any region or record.
ROOT_MODE = 0o700
FOLDER_MODE = 0o700
RUN_MODE = 0o755
RECORD_MODE = 0o600


def _truncate_plain(path: Path, size: int = 0) -> None:
    """Empty a regular file without following a link or opening anything else (O_PATH, fstat, then the same
    inode through /proc/self/fd)."""
    try:
        pfd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if not stat.S_ISREG(os.fstat(pfd).st_mode):
            return
        fd = os.open(f"/proc/self/fd/{pfd}", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
    except OSError:
        pass
    finally:
        os.close(pfd)


def _signature(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class Workspace:
    def __init__(self, root: Path) -> None:
        self.root = root
        # Regions found bad, by allocation: (what the path looked like, the error). Not re-opened, nor logged
        # again, until the path changes.
        self._bad: dict[str, tuple[tuple[int, ...], RegionError]] = {}
        # open_region is called from the loop's services and from the profiler's worker thread: a bad file met by
        # both at once was said twice (seen in a full-suite run). Held only around one file's open and read.
        self._opening = threading.Lock()
        # What the agent wrote into each region's agent block, by allocation: one record shared by every service's
        # handle on that region, since the file itself is the container's to scribble on (region.py).
        self._blocks: dict[str, AgentBlock] = {}
        self._boards: dict[str, Board] = {}  # GPU UUID -> its board (the latency class), made on first use

    def ensure(self) -> None:
        """Create the root if needed (0700) and check it is a writable folder; WorkspaceError in one line if not."""
        try:
            self.root.mkdir(mode=ROOT_MODE, parents=True, exist_ok=True)
        except FileExistsError:
            raise WorkspaceError(f"{self.root} exists and is not a folder") from None
        except NotADirectoryError:
            raise WorkspaceError(f"{self.root} lies under a file, not a folder") from None
        except OSError as e:
            raise WorkspaceError(f"cannot create {self.root}: {e.strerror}") from None
        if not self.root.is_dir():
            raise WorkspaceError(f"{self.root} is not a folder")
        probe = self.root / f".probe-{os.getpid()}"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise WorkspaceError(f"{self.root} is not writable: {e.strerror}") from None
        try:
            os.chmod(self.root, ROOT_MODE)
        except OSError as e:
            raise WorkspaceError(f"cannot set the mode of {self.root}: {e.strerror}") from None

    def path(self, alloc_id: str) -> Path:
        if not _ID_RE.match(alloc_id):
            raise ValueError(f"bad allocation id {alloc_id!r}")
        return self.root / alloc_id

    def container_folder(self, alloc_id: str) -> Path:
        """The host folder mounted at /run/alnair in the container."""
        return self.path(alloc_id) / CONTAINER_FOLDER_NAME

    @property
    def spares_folder(self) -> Path:
        return self.root / SPARES_FOLDER_NAME

    def make_spare(self) -> Spare:
        """A folder with `run/`, a region without limits and an empty temporary record, for a later `create` to
        take. It touches nothing but its own new folder, so it may run in a worker thread beside the event loop."""
        spares = self.spares_folder
        spares.mkdir(mode=FOLDER_MODE, exist_ok=True)
        name = secrets.token_hex(8)
        folder = spares / name
        folder.mkdir(mode=FOLDER_MODE)
        region = None
        try:
            run = folder / CONTAINER_FOLDER_NAME
            run.mkdir(mode=RUN_MODE)
            os.chmod(run, RUN_MODE)  # whatever the umask
            os.close(os.open(folder / (ALLOCATION_FILE_NAME + ".tmp"),
                             os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, RECORD_MODE))
            region = Region.create(run / REGION_FILE_NAME, 0, 0)
        except BaseException:
            if region is not None:
                region.close()
            self._rmtree(folder)
            raise
        return Spare(name, region)

    def remove_spares(self) -> None:
        self._rmtree(self.spares_folder)

    def create(self, alloc: Allocation, spare: Spare | None = None) -> Region:
        """Create the container's folder, its region (with the limits) and its record; from `spare` when given
        (renamed into place: an allocation's folder is never empty, so a clash of ids fails the rename)."""
        if spare is not None:
            return self._take(alloc, spare)
        folder = self.path(alloc.id)
        folder.mkdir(mode=FOLDER_MODE)
        region = None
        try:
            run = self.container_folder(alloc.id)
            run.mkdir(mode=RUN_MODE)
            os.chmod(run, RUN_MODE)  # whatever the umask
            region = Region.create(run / REGION_FILE_NAME, alloc.memory_limit, alloc.compute_limit)
            self.save(alloc)
            self._blocks[alloc.id] = region.block
        except BaseException:
            # A full disk (or anything else) leaves nothing behind: no half-made folder, no open descriptor.
            if region is not None:
                region.close()
            self.remove(alloc.id)
            raise
        return region

    def _take(self, alloc: Allocation, spare: Spare) -> Region:
        region = spare.region  # open since it was made, by this agent, and never handed to anyone
        try:
            os.rename(self.spares_folder / spare.name, self.path(alloc.id))
        except FileNotFoundError:  # the spare went (the workspace cleared under the agent): made the usual way
            region.close()
            return self.create(alloc)
        except OSError:  # not taken (e.g. the name is held): the spare's region is not leaked with it
            region.close()
            raise
        try:
            region.path = self.container_folder(alloc.id) / REGION_FILE_NAME
            region.set_limits(alloc.memory_limit, alloc.compute_limit)
            self.save(alloc)  # into the spare's temporary record: no file made
            self._blocks[alloc.id] = region.block
        except BaseException:
            region.close()
            self.remove(alloc.id)
            raise
        return region

    def save(self, alloc: Allocation) -> None:
        folder = self.path(alloc.id)
        tmp = folder / (ALLOCATION_FILE_NAME + ".tmp")
        data = json.dumps(asdict(alloc), sort_keys=True).encode()
        # Atomic against an agent crash (rename); no fsync: after a node crash kubelet re-admits every container.
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, RECORD_MODE)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.replace(tmp, folder / ALLOCATION_FILE_NAME)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def open_region(self, alloc_id: str) -> Region:
        """Open the container's region. One found bad is said once (`region_unreadable`, whichever service met it)
        and remembered: until its path changes it is not opened again; the same RegionError is raised without
        touching it."""
        path = self.container_folder(alloc_id) / REGION_FILE_NAME
        with self._opening:
            try:
                sig = _signature(os.lstat(path))
            except OSError:
                sig = ()
            bad = self._bad.get(alloc_id)
            if bad is not None and bad[0] == sig:
                raise bad[1]
            try:
                region = Region.open(path, self._blocks.get(alloc_id))
            except RegionError as e:
                log.warning("region_unreadable", allocation=alloc_id, error=str(e))
                self._bad[alloc_id] = (sig, e)
                raise
            self._bad.pop(alloc_id, None)
            self._blocks[alloc_id] = region.block
            return region

    @property
    def boards_folder(self) -> Path:
        return self.root / BOARDS_FOLDER_NAME

    def board(self, gpu_uuid: str) -> Board:
        """The GPU's board, made (or made whole again) on first use; RegionError/OSError when it cannot be."""
        b = self._boards.get(gpu_uuid)
        if b is None:
            if not _UUID_RE.match(gpu_uuid):
                raise ValueError(f"bad GPU UUID {gpu_uuid!r}")
            self.boards_folder.mkdir(mode=FOLDER_MODE, exist_ok=True)
            b = self._boards[gpu_uuid] = Board.create(self.boards_folder / gpu_uuid)
        return b

    def link_board(self, alloc_id: str, gpu_uuid: str) -> bool:
        """The GPU's board as `board` in the container's run folder (a hard link: the same file for every container
        of the GPU). Whatever the container put under that name goes first (unlinked, never followed). True when
        a link was made now."""
        board = self.board(gpu_uuid)
        path = self.container_folder(alloc_id) / L.BOARD_FILE_NAME
        want = os.stat(board.path)
        try:
            st = os.lstat(path)
            if (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino):
                return False
            if stat.S_ISDIR(st.st_mode):
                self._rmtree(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass
        os.link(board.path, path)
        return True

    def _is_board(self, st: os.stat_result) -> bool:
        for b in self._boards.values():
            with contextlib.suppress(OSError):
                bs = os.stat(b.path)
                if (bs.st_dev, bs.st_ino) == (st.st_dev, st.st_ino):
                    return True
        return False

    def close_boards(self) -> None:
        for b in self._boards.values():
            b.close()
        self._boards.clear()

    def sweep(self, alloc_id: str) -> int:
        """Bound what a container keeps in its `run/` (on the workspace filesystem): only `region` belongs there.
        Anything else the container made is emptied (a plain file, through an O_PATH-checked descriptor, so space
        held by the container's own open descriptor is freed too) and removed; nothing is followed or opened
        before its type is known. Returns the bytes freed (as st_blocks said)."""
        run = self.container_folder(alloc_id)
        freed = 0
        try:
            entries = os.listdir(run)
        except OSError:
            return 0
        for name in entries:
            path = run / name
            if name == REGION_FILE_NAME:
                # A region grown past its size (writes beyond the end) is cut back: its extra bytes are no
                # part of the layout.
                with contextlib.suppress(OSError):
                    st = os.lstat(path)
                    if stat.S_ISREG(st.st_mode) and st.st_size > L.REGION_SIZE:
                        freed += max(0, st.st_blocks * 512 - L.REGION_SIZE)
                        _truncate_plain(path, L.REGION_SIZE)
                continue
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if name == L.BOARD_FILE_NAME and stat.S_ISREG(st.st_mode) and self._is_board(st):
                continue  # its GPU's board, linked by the agent
            freed += st.st_blocks * 512
            if stat.S_ISREG(st.st_mode):
                _truncate_plain(path)
            if stat.S_ISDIR(st.st_mode):
                self._rmtree(path)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        return freed

    def bad_regions(self) -> dict[str, str]:
        """Allocation -> why its region is refused (for metrics and logs)."""
        return {alloc_id: str(e) for alloc_id, (_, e) in self._bad.items()}

    def load_all(self) -> list[Allocation]:
        """Every readable record; unreadable folders are logged and left alone (never deleted blindly)."""
        out: list[Allocation] = []
        if not self.root.is_dir():
            return out
        self.remove_spares()  # an earlier run's spares: never handed to any container
        for folder in sorted(self.root.iterdir()):
            if not _ID_RE.match(folder.name) or folder.is_symlink() or not folder.is_dir():
                continue
            record = folder / ALLOCATION_FILE_NAME
            if not record.exists() and not record.is_symlink():
                # The record is written last, before kubelet gets the answer: a folder without one was never
                # handed to any container (an Allocate that failed half-way, or a crash mid-Allocate).
                log.warning("workspace_half_made_folder_removed", folder=str(folder))
                self.remove(folder.name)
                continue
            try:
                alloc = _record_from_json(json.loads(record.read_text()))
                if alloc.id != folder.name:
                    raise ValueError(f"record names allocation {alloc.id}")
            except (OSError, ValueError) as e:
                log.warning("workspace_record_unreadable", folder=str(folder), error=str(e))
                continue
            # Folders made by an earlier agent (0755, run/ 0777) get today's modes.
            for path, mode in ((folder, FOLDER_MODE), (record, RECORD_MODE),
                               (self.container_folder(alloc.id), RUN_MODE)):
                with contextlib.suppress(OSError):
                    if not path.is_symlink():
                        os.chmod(path, mode)
            out.append(alloc)
        return out

    def remove(self, alloc_id: str) -> None:
        """Remove the folder and everything in it. The container may have left folders it made unreadable
        (mode 000): they are opened up first. Links are removed, never followed."""
        self._bad.pop(alloc_id, None)
        self._blocks.pop(alloc_id, None)
        self._rmtree(self.path(alloc_id))

    @staticmethod
    def _rmtree(top: Path) -> None:
        def retry(func: Callable[[str], object], path: str, exc: object) -> None:
            parent = os.path.dirname(path)
            with contextlib.suppress(OSError):
                os.chmod(parent, 0o700)
                if not os.path.islink(path) and os.path.isdir(path):
                    os.chmod(path, 0o700)
                func(path)

        shutil.rmtree(top, onerror=retry)
        if top.exists():
            shutil.rmtree(top, ignore_errors=True)
