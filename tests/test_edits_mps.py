"""The MPS pipe folder in a container's edits (ALNAIR_MPS_PIPE_DIR), one GPU or several: node/edits.py is the one
definition behind the device plugin's Allocate answer and the DRA front-end's CDI spec."""

from __future__ import annotations

from pathlib import Path

import pytest

from alnair_agent.constants import CONTAINER_MPS_PIPE_DIR, ENV_MPS_PIPE_DIRECTORY, RESOURCE_COMPUTE, RESOURCE_MEMORY
from alnair_agent.node import edits
from alnair_agent.node.workspace import Allocation


def part(k: int, n: int) -> Allocation:
    gpus = [f"GPU-{i}" for i in range(n)] if n > 1 else []
    return Allocation(id=f"a{k}", gpu_uuid=f"GPU-{k}", device_ids={}, wanted={RESOURCE_MEMORY: 4, RESOURCE_COMPUTE: 30},
                      memory_limit=4 << 30, compute_limit=30, part=k, gpus=gpus)


@pytest.mark.parametrize("n_gpus", [1, 2, 3])
@pytest.mark.parametrize("mps", [None, "/run/alnair/mps"])
def test_every_container_gets_the_pipe_folder_once_whatever_its_gpus(n_gpus: int, mps: str | None) -> None:
    parts = [part(k, n_gpus) for k in range(n_gpus)]
    folders = [Path(f"/ws/a{k}") for k in range(n_gpus)]
    e = (edits.container_edits(parts[0], folders[0], "/lib", mps) if n_gpus == 1
         else edits.group_edits(parts, folders, "/lib", mps))
    pipe_mounts = [m for m in e.mounts if m[0] == CONTAINER_MPS_PIPE_DIR]
    if mps is None:
        assert ENV_MPS_PIPE_DIRECTORY not in e.envs and pipe_mounts == []
    else:
        assert e.envs[ENV_MPS_PIPE_DIRECTORY] == CONTAINER_MPS_PIPE_DIR
        assert pipe_mounts == [(CONTAINER_MPS_PIPE_DIR, mps, False)]  # once, writable: a client makes its pipes there
    assert len({m[0] for m in e.mounts}) == len(e.mounts)  # no container path mounted twice
