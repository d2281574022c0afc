"""A container of several GPUs (`alnair/vgpu-count: N`) behind the device plugin: how kubelet's device IDs of one
resource map onto its N GPUs.

kubelet allocates each resource of a container once, as one list of device IDs: `alnair/vgpu-memory` and
`alnair/vgpu-compute` are the container's totals, so its IDs of a resource are N equal shares, one on each of its
GPUs (GetPreferredAllocation proposes exactly that, and Allocate checks it). The allocator then keeps one allocation
per GPU (`Allocation.part`, `Allocation.gpus`), each with its own folder and region, so everything that works per
allocation (the dispatcher's turns, the shim's limits, kubelet's record winning) works per (container, GPU).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import grpc

from alnair_agent.constants import DEVICE_ID_SEPARATOR
from alnair_agent.kube.pods import ContainerRequest, PodInfo
from alnair_agent.kubelet.errors import AllocationError


def _error(code: grpc.StatusCode, message: str) -> Exception:
    return AllocationError(code, message)


def gpu_of(device_id: str) -> str:
    return device_id.split(DEVICE_ID_SEPARATOR, 1)[0]


def split_ids(device_ids: Sequence[str], gpus: Sequence[str], resource: str, pod: PodInfo,
              c: ContainerRequest) -> list[list[str]]:
    """kubelet's IDs of `resource` for the container, per GPU in `gpus` order; refused (FAILED_PRECONDITION) unless
    they are the same number on each of its GPUs and on no other."""
    per = {g: [] for g in gpus}  # type: dict[str, list[str]]
    for device_id in device_ids:
        bucket = per.get(gpu_of(device_id))
        if bucket is None:
            raise _error(grpc.StatusCode.FAILED_PRECONDITION,
                         f"pod {pod.namespace}/{pod.name} container {c.container!r} goes on GPUs {list(gpus)}; "
                         f"kubelet offers {resource} device {device_id} of another GPU")
        bucket.append(device_id)
    counts = {len(ids) for ids in per.values()}
    if len(counts) != 1:
        raise _error(grpc.StatusCode.FAILED_PRECONDITION,
                     f"pod {pod.namespace}/{pod.name} container {c.container!r}: its {resource} units must be split "
                     f"evenly over its GPUs {list(gpus)}; kubelet offers "
                     + ", ".join(f"{len(ids)} on {g}" for g, ids in per.items()))
    return [per[g] for g in gpus]


def pick_on_each(pick: Callable[[str, list[str], list[str], int, str], list[str]], resource: str,
                 available: list[str], must_include: list[str], size: int, gpus: Sequence[str]) -> list[str]:
    """GetPreferredAllocation for a container of several GPUs: `size / len(gpus)` IDs on each GPU, each chosen by
    the one-GPU rule `pick` (kubelet's must-include IDs first)."""
    if size % len(gpus):
        raise _error(grpc.StatusCode.INVALID_ARGUMENT,
                     f"allocation size {size} of {resource} does not split evenly over {len(gpus)} GPUs")
    stray = [i for i in must_include if gpu_of(i) not in gpus]
    if stray:
        raise _error(grpc.StatusCode.FAILED_PRECONDITION,
                     f"kubelet requires device {stray[0]}, but this container's {resource} must come from GPUs "
                     f"{list(gpus)}")
    chosen: list[str] = []
    for gpu in gpus:
        chosen += pick(resource, available, [i for i in must_include if gpu_of(i) == gpu], size // len(gpus), gpu)
    return chosen
