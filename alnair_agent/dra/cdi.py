"""CDI spec files: how a DRA-prepared container gets what the device plugin's Allocate gives one.

kubelet hands the container runtime the CDI device IDs that NodePrepareResources returned; the runtime (containerd,
CRI-O) reads the spec files in ALNAIR_CDI_DIR and applies each device's `containerEdits`. One spec file per claim
(`alnair.centaurus.io-gpu_<claim UID>.json`), one device per claim result, named by its allocation id, whose edits
are `alnair_agent.node.edits.container_edits`: the same environment and mounts as Allocate's answer.

A spec is written to a temporary name the runtime ignores (a dot-file not ending in .json), then renamed: a runtime
reading the folder meanwhile sees the old spec or the new one, never half of one. That temporary file may be a spare
(`make_spare`: an empty `.spare-<hex>.tmp` made ahead, off the prepare's path), so that writing a new claim's spec
makes no file: on a slow disk making one is half a millisecond.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
from pathlib import Path
from typing import Any

from alnair_agent.constants import CDI_KIND, CDI_SPEC_PREFIX, CDI_VERSION
from alnair_agent.node.edits import ContainerEdits

SPEC_MODE = 0o644  # the runtime (root) reads it; nothing in it is secret
_UID = re.compile(r"^[0-9a-fA-F-]{1,64}$")  # a Kubernetes UID; anything else never becomes a file name
SPARE_PREFIX = ".spare-"
_SPARE = re.compile(r"^\.spare-[0-9a-f]{16}\.tmp$")


class CdiError(OSError):
    """A spec file cannot be written (full disk, read-only folder)."""


def is_uid(text: str) -> bool:
    """Whether `text` has the shape of a Kubernetes UID (hex and dashes): only those become file names."""
    return bool(_UID.match(text))


def device_id(alloc_id: str) -> str:
    """The fully-qualified CDI device name of an allocation's slice: `alnair.centaurus.io/gpu=<allocation id>`."""
    return f"{CDI_KIND}={alloc_id}"


def container_edits_json(edits: ContainerEdits) -> dict[str, Any]:
    """CDI containerEdits for the environment and mounts a container gets."""
    return {
        "env": [f"{k}={v}" for k, v in edits.envs.items()],
        "mounts": [{"hostPath": host, "containerPath": path, "type": "bind",
                    "options": ["bind", "ro" if read_only else "rw"]} for path, host, read_only in edits.mounts],
    }


class CdiWriter:
    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def path(self, claim_uid: str) -> Path:
        if not _UID.match(claim_uid):
            raise ValueError(f"bad claim UID {claim_uid!r}")
        return self.folder / f"{CDI_SPEC_PREFIX}{claim_uid}.json"

    def make_spare(self) -> str:
        """An empty temporary spec file for a later `write` to fill (its name); it touches nothing but that file, so
        it may run in a worker thread beside the event loop."""
        self.folder.mkdir(parents=True, exist_ok=True)
        name = f"{SPARE_PREFIX}{secrets.token_hex(8)}.tmp"
        fd = os.open(self.folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, SPEC_MODE)
        try:
            os.fchmod(fd, SPEC_MODE)  # whatever the umask
        finally:
            os.close(fd)
        return name

    def remove_spares(self) -> None:
        """Remove every spare temporary file (made by this agent or an earlier run; none holds a spec)."""
        try:
            names = os.listdir(self.folder)
        except OSError:
            return
        for name in names:
            if _SPARE.match(name):
                with contextlib.suppress(OSError):
                    os.unlink(self.folder / name)

    def write(self, claim_uid: str, devices: list[tuple[str, ContainerEdits]], spare: str | None = None) -> Path:
        """Write the claim's spec: one CDI device per (allocation id, edits), through the `spare` temporary file
        when given (`make_spare`). CdiError when it cannot be written."""
        spec = {"cdiVersion": CDI_VERSION, "kind": CDI_KIND,
                "devices": [{"name": alloc_id, "containerEdits": container_edits_json(edits)}
                            for alloc_id, edits in devices]}
        path = self.path(claim_uid)
        tmp = self.folder / f".{path.name}.tmp"
        data = json.dumps(spec, indent=1, sort_keys=True).encode()
        try:
            fd = -1
            if spare is not None and _SPARE.match(spare):
                with contextlib.suppress(FileNotFoundError):  # gone (a tmpfs cleared): a file is made as without
                    fd = os.open(self.folder / spare, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC)
                    tmp = self.folder / spare
            if fd < 0:
                try:
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, SPEC_MODE)
                except FileNotFoundError:  # the folder went (a tmpfs cleared): made again
                    self.folder.mkdir(parents=True, exist_ok=True)
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                                 SPEC_MODE)
            try:
                os.fchmod(fd, SPEC_MODE)  # whatever the umask
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise CdiError(e.errno, f"cannot write CDI spec {path}: {e.strerror}") from None
        return path

    def remove(self, claim_uid: str) -> None:
        """Remove the claim's spec (absent already: nothing to do); CdiError when it cannot be removed."""
        try:
            os.unlink(self.path(claim_uid))
        except (FileNotFoundError, NotADirectoryError):
            pass
        except OSError as e:
            raise CdiError(e.errno, f"cannot remove CDI spec {self.path(claim_uid)}: {e.strerror}") from None

    def claim_uids(self) -> set[str]:
        """Claims whose specs this agent wrote and which are on disk now."""
        try:
            names = os.listdir(self.folder)
        except OSError:
            return set()
        return {n[len(CDI_SPEC_PREFIX):-len(".json")] for n in names
                if n.startswith(CDI_SPEC_PREFIX) and n.endswith(".json")
                and _UID.match(n[len(CDI_SPEC_PREFIX):-len(".json")])}

    def read(self, claim_uid: str) -> dict[str, Any] | None:
        """The claim's spec as written (tests, the kubelet emulator); None when absent."""
        try:
            return json.loads(self.path(claim_uid).read_text())
        except FileNotFoundError:
            return None
