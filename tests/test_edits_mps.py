"""The MPS folders in a container's edits (ALNAIR_MPS_PIPE_DIR, ALNAIR_MPS_SHM_DIR), one GPU or several: node/edits.py is the one
definition behind the device plugin's Allocate answer and the DRA front-end's CDI spec."""

from __future__ import annotations

from pathlib import Path

import pytest

from alnair_agent.constants import (
    CONTAINER_MPS_PIPE_DIR,
    CONTAINER_MPS_SHM_DIR,
    ENV_MPS_PIPE_DIRECTORY,
    RESOURCE_COMPUTE,
    RESOURCE_MEMORY,
)
from alnair_agent.node import edits
from alnair_agent.node.workspace import Allocation


def part(k: int, n: int) -> Allocation:
    gpus = [f"GPU-{i}" for i in range(n)] if n > 1 else []
    return Allocation(id=f"a{k}", gpu_uuid=f"GPU-{k}", device_ids={}, wanted={RESOURCE_MEMORY: 4, RESOURCE_COMPUTE: 30},
                      memory_limit=4 << 30, compute_limit=30, part=k, gpus=gpus)


@pytest.mark.parametrize("n_gpus", [1, 2, 3])
@pytest.mark.parametrize("mps", [None, edits.MpsFolders("/run/alnair/mps", "/run/alnair/mps-shm")])
def test_every_container_gets_the_mps_folders_once_whatever_its_gpus(n_gpus: int, mps: edits.MpsFolders | None) -> None:
    parts = [part(k, n_gpus) for k in range(n_gpus)]
    folders = [Path(f"/ws/a{k}") for k in range(n_gpus)]
    e = (edits.container_edits(parts[0], folders[0], "/lib", mps) if n_gpus == 1
         else edits.group_edits(parts, folders, "/lib", mps))
    mps_mounts = [m for m in e.mounts if m[0] in (CONTAINER_MPS_PIPE_DIR, CONTAINER_MPS_SHM_DIR)]
    if mps is None:
        assert ENV_MPS_PIPE_DIRECTORY not in e.envs and mps_mounts == []
    else:
        assert e.envs[ENV_MPS_PIPE_DIRECTORY] == CONTAINER_MPS_PIPE_DIR
        # once each, writable: a client makes its pipes in the one and maps the server's memory in the other
        assert mps_mounts == [(CONTAINER_MPS_PIPE_DIR, mps.pipe, False), (CONTAINER_MPS_SHM_DIR, mps.shm, False)]
    assert len({m[0] for m in e.mounts}) == len(e.mounts)  # no container path mounted twice


@pytest.mark.parametrize("pipe, shm, on", [
    (None, None, False),
    (Path("/run/alnair/mps"), Path("/run/alnair/mps-shm"), True),
    (Path("/run/alnair/mps"), None, None),  # half a pair: an error, never MPS quietly off
    (None, Path("/run/alnair/mps-shm"), None),
])
def test_mps_folders_of_the_settings(pipe: Path | None, shm: Path | None, on: bool | None) -> None:
    if on is None:
        with pytest.raises(ValueError, match="both"):
            edits.MpsFolders.of(pipe, shm)
        return
    folders = edits.MpsFolders.of(pipe, shm)
    assert (folders is not None) == on
    if folders is not None:
        assert (folders.pipe, folders.shm) == (str(pipe), str(shm))
