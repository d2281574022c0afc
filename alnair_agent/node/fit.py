"""Which GPU a container lands on: ALNAIR_GPU_POLICY, as a pure function of free and total units."""

from __future__ import annotations

from dataclasses import dataclass

from alnair_agent.constants import RESOURCES

BINPACK = "binpack"
SPREAD = "spread"
POLICIES = (BINPACK, SPREAD)


@dataclass(frozen=True)
class GpuRoom:
    """What one healthy GPU has free (and in all) of each resource."""

    uuid: str
    index: int
    free: dict[str, int]
    total: dict[str, int]

    def fits(self, need: dict[str, int]) -> bool:
        return all(self.free.get(r, 0) >= n for r, n in need.items())

    def free_share_after(self, need: dict[str, int]) -> float:
        """Free fraction left after placing `need`, averaged over both resources (0 = full, 1 = empty)."""
        shares = [(self.free[r] - need.get(r, 0)) / self.total[r] for r in RESOURCES if self.total.get(r)]
        return sum(shares) / len(shares) if shares else 0.0


def choose_gpu(rooms: list[GpuRoom], need: dict[str, int], policy: str) -> GpuRoom | None:
    """binpack: the GPU left fullest; spread: the GPU left emptiest; ties go to the lowest index."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}")
    fitting = [room for room in rooms if room.fits(need)]
    if not fitting:
        return None
    sign = 1 if policy == BINPACK else -1
    return min(fitting, key=lambda room: (sign * room.free_share_after(need), room.index))
