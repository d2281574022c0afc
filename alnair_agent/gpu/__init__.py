"""GPU backends: where the agent learns which GPUs the node has and whether they are healthy."""

from alnair_agent.config import Settings
from alnair_agent.gpu.backend import GpuBackend, GpuInfo, HealthEvent

__all__ = ["GpuBackend", "GpuInfo", "HealthEvent", "make_backend"]


def make_backend(settings: Settings) -> GpuBackend:
    """The backend ALNAIR_GPU_BACKEND names. Only the NVML backend imports pynvml; the simulated one is a stand-in
    (alnair_standins), imported only when named."""
    if settings.gpu_backend == "simulated":
        from alnair_standins.gpu import SimulatedBackend

        return SimulatedBackend.from_settings(settings)
    from alnair_agent.gpu.nvml import NvmlBackend

    return NvmlBackend()
