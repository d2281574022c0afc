"""Per-container workspaces on the host: ALNAIR_WORKSPACE/<allocation-id>/{allocation.json, run/region}.

Only `run/` is mounted into the container. The container can write anything there (it is untrusted), so the
record the agent restarts from lives beside it, out of reach, and the region is opened without following links.

The allocation record is what survives an agent restart; it is written atomically (temp file + rename) before
kubelet gets the Allocate answer, so no answered allocation is ever unknown after a restart.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import structlog

from alnair_agent.constants import ALLOCATION_FILE_NAME, CONTAINER_FOLDER_NAME, REGION_FILE_NAME, RESOURCES
from alnair_agent.node.region import Region

log = structlog.get_logger(__name__)

_ID_RE = re.compile(r"^[0-9a-f]{16}$")


def new_allocation_id() -> str:
    return secrets.token_hex(8)


@dataclass
class Allocation:
    """One container's slice of one GPU, as recorded on disk."""

    id: str
    gpu_uuid: str
    device_ids: dict[str, list[str]]  # resource -> device IDs kubelet allocated
    wanted: dict[str, int]  # resource -> units the container asks for (known from its pod, or as allocated)
    memory_limit: int  # bytes written into the region (0 = none)
    compute_limit: int  # percent written into the region (0 = none)
    namespace: str = ""
    pod_name: str = ""
    pod_uid: str = ""
    container: str = ""
    created_at: float = field(default_factory=time.time)

    @property
    def identified(self) -> bool:
        return bool(self.pod_uid or self.pod_name)

    def missing(self) -> list[str]:
        """Resources the container asks for that kubelet has not allocated yet."""
        return [r for r in RESOURCES if self.wanted.get(r, 0) > len(self.device_ids.get(r, []))]

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
    return alloc


class Workspace:
    def __init__(self, root: Path) -> None:
        self.root = root

    def ensure(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, alloc_id: str) -> Path:
        if not _ID_RE.match(alloc_id):
            raise ValueError(f"bad allocation id {alloc_id!r}")
        return self.root / alloc_id

    def container_folder(self, alloc_id: str) -> Path:
        """The host folder mounted at /run/alnair in the container."""
        return self.path(alloc_id) / CONTAINER_FOLDER_NAME

    def create(self, alloc: Allocation) -> Region:
        """Create the container's folder, its region (with the limits) and its record."""
        folder = self.path(alloc.id)
        folder.mkdir(mode=0o755)
        self.container_folder(alloc.id).mkdir()
        os.chmod(self.container_folder(alloc.id), 0o777)  # a container may run as any user
        region = Region.create(self.container_folder(alloc.id) / REGION_FILE_NAME, alloc.memory_limit,
                               alloc.compute_limit)
        self.save(alloc)
        return region

    def save(self, alloc: Allocation) -> None:
        folder = self.path(alloc.id)
        tmp = folder / (ALLOCATION_FILE_NAME + ".tmp")
        # Atomic against an agent crash (rename); no fsync: after a node crash kubelet re-admits every container.
        tmp.write_text(json.dumps(asdict(alloc), sort_keys=True))
        os.replace(tmp, folder / ALLOCATION_FILE_NAME)

    def open_region(self, alloc_id: str) -> Region:
        return Region.open(self.container_folder(alloc_id) / REGION_FILE_NAME)

    def load_all(self) -> list[Allocation]:
        """Every readable record; unreadable folders are logged and left alone (never deleted blindly)."""
        out = []
        if not self.root.is_dir():
            return out
        for folder in sorted(self.root.iterdir()):
            if not folder.is_dir() or not _ID_RE.match(folder.name):
                continue
            record = folder / ALLOCATION_FILE_NAME
            try:
                alloc = _record_from_json(json.loads(record.read_text()))
                if alloc.id != folder.name:
                    raise ValueError(f"record names allocation {alloc.id}")
            except (OSError, ValueError) as e:
                log.warning("workspace_record_unreadable", folder=str(folder), error=str(e))
                continue
            out.append(alloc)
        return out

    def remove(self, alloc_id: str) -> None:
        shutil.rmtree(self.path(alloc_id), ignore_errors=True)
