"""What a container gets from Alnair, whichever front-end admitted it: the limits its units make, and its environment
and mounts. One definition: the device plugin's Allocate answer and the DRA front-end's CDI spec are both built
here, so a container admitted either way sees the same GPU, shim, limits and region.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from alnair_agent.constants import (
    COMPUTE_UNITS_PER_GPU,
    CONTAINER_MPS_PIPE_DIR,
    CONTAINER_MPS_SHM_DIR,
    CONTAINER_REGION_PATH,
    CONTAINER_RUN_DIR,
    CONTAINER_SHIM_DIR,
    CONTAINER_SHIM_PATH,
    ENV_ALLOCATION_ID,
    ENV_COMPUTE_LIMIT,
    ENV_CUDA_DEVICE_ORDER,
    ENV_LD_PRELOAD,
    ENV_MEMORY_LIMIT,
    ENV_MPS_PIPE_DIRECTORY,
    ENV_REGION,
    ENV_REGIONS,
    ENV_VISIBLE_DEVICES,
    RESOURCE_COMPUTE,
    RESOURCE_MEMORY,
)
from alnair_agent.node.workspace import Allocation

Mount = tuple[str, str, bool]  # (container_path, host_path, read_only)


@dataclass(frozen=True)
class ContainerEdits:
    envs: dict[str, str]
    mounts: list[Mount]


def limits(memory_units: int, compute_units: int, memory_unit_bytes: int) -> tuple[int, int]:
    """(memory limit in bytes, compute cap in percent; 0 = none) for a container holding these units."""
    # A cap of the whole GPU is no cap: the shim then stays out of the launch path.
    return memory_units * memory_unit_bytes, (compute_units if 0 < compute_units < COMPUTE_UNITS_PER_GPU else 0)


@dataclass(frozen=True)
class MpsFolders:
    """The host folders of the node's MPS control daemon (ALNAIR_MPS_PIPE_DIR, ALNAIR_MPS_SHM_DIR)."""

    pipe: str  # its CUDA_MPS_PIPE_DIRECTORY: a client writes its own pipes there
    shm: str  # what the daemon and its servers have as /dev/shm: a client maps the server's shared memory there

    @classmethod
    def of(cls, pipe: Path | None, shm: Path | None) -> MpsFolders | None:
        """None while MPS is off. The settings read from the environment give both folders or neither; half a pair
        here is a caller's mistake (a client with one of them cannot reach the server), never MPS quietly off."""
        if (pipe is None) != (shm is None):
            raise ValueError(f"MPS needs both its pipe folder and its /dev/shm folder, got pipe={pipe} shm={shm}")
        return None if pipe is None or shm is None else cls(str(pipe), str(shm))


def _mps(mps: MpsFolders | None) -> tuple[dict[str, str], list[Mount]]:
    """The node's MPS folders, when there are some: both writable, as a client writes in both."""
    if mps is None:
        return {}, []
    return ({ENV_MPS_PIPE_DIRECTORY: CONTAINER_MPS_PIPE_DIR},
            [(CONTAINER_MPS_PIPE_DIR, mps.pipe, False), (CONTAINER_MPS_SHM_DIR, mps.shm, False)])


def container_edits(alloc: Allocation, run_folder: Path, shim_dir: str, mps: MpsFolders | None = None) -> ContainerEdits:
    """The environment and mounts of the container(s) `alloc` serves; `run_folder` is its host folder mounted at
    /run/alnair (Workspace.container_folder); `mps` the node's MPS folders, if any."""
    envs = {
        ENV_VISIBLE_DEVICES: alloc.gpu_uuid,
        ENV_LD_PRELOAD: CONTAINER_SHIM_PATH,
        ENV_REGION: CONTAINER_REGION_PATH,
        ENV_ALLOCATION_ID: alloc.id,
    }
    # kubelet merges the device plugin's two resources' answers first-wins per variable: name a limit only once it
    # is known, so the answers never disagree (the region carries the final limits either way). With pod identity,
    # and always in DRA mode, both limits are known from the first answer on.
    if RESOURCE_MEMORY in alloc.wanted:
        envs[ENV_MEMORY_LIMIT] = str(alloc.memory_limit)
    if RESOURCE_COMPUTE in alloc.wanted:
        envs[ENV_COMPUTE_LIMIT] = str(alloc.compute_limit)
    mps_envs, mps_mounts = _mps(mps)
    return ContainerEdits(envs | mps_envs,
                          [(CONTAINER_RUN_DIR, str(run_folder), False), (CONTAINER_SHIM_DIR, shim_dir, True), *mps_mounts])


def part_run_dir(part: int) -> str:
    """Where the folder of a container's `part`-th GPU is mounted: /run/alnair for the first (as for a one-GPU
    container), /run/alnair-<k> for the others (beside it, not inside: the first folder holds only its region)."""
    return CONTAINER_RUN_DIR if part == 0 else f"{CONTAINER_RUN_DIR}-{part}"


def _tightest(limits: Sequence[int]) -> int:
    """The smallest limit that is one (0 = none)."""
    return min((v for v in limits if v > 0), default=0)


def group_edits(parts: Sequence[Allocation], run_folders: Sequence[Path], shim_dir: str,
                mps: MpsFolders | None = None) -> ContainerEdits:
    """The environment and mounts of a container of several GPUs, one allocation per GPU (in `part` order, with their
    host folders): every GPU in NVIDIA_VISIBLE_DEVICES in that order, each GPU's region in ALNAIR_REGIONS in the
    same order, the first GPU's region also in ALNAIR_REGION. Each GPU's limits are in its own region; the limits in
    the environment (what the shim enforces on a GPU whose region it must refuse) are the tightest of its GPUs', the
    same on all (a device plugin container's GPUs all have the same; a DRA claim's requests may differ)."""
    first = container_edits(parts[0], run_folders[0], shim_dir, mps)
    envs = dict(first.envs)
    if any(RESOURCE_MEMORY in p.wanted for p in parts):
        envs[ENV_MEMORY_LIMIT] = str(_tightest([p.memory_limit for p in parts]))
    if any(RESOURCE_COMPUTE in p.wanted for p in parts):
        envs[ENV_COMPUTE_LIMIT] = str(_tightest([p.compute_limit for p in parts]))
    envs[ENV_VISIBLE_DEVICES] = ",".join(p.gpu_uuid for p in parts)
    envs[ENV_REGIONS] = ",".join(f"{part_run_dir(p.part)}/{CONTAINER_REGION_PATH.rsplit('/', 1)[1]}" for p in parts)
    envs[ENV_CUDA_DEVICE_ORDER] = "PCI_BUS_ID"
    mounts = [(part_run_dir(p.part), str(f), False) for p, f in zip(parts, run_folders, strict=True)]
    mounts.append((CONTAINER_SHIM_DIR, shim_dir, True))
    mounts += _mps(mps)[1]
    return ContainerEdits(envs, mounts)
