"""A kubelet crash loop against the kubelet emulator, and how long the agent takes to register once kubelet stays up.

One episode: the registered kubelet is killed (its kubelet.sock left on disk, refusing connections); then, for a
random stretch of `down_s`, it keeps coming back and failing: turns in which a new kubelet dies as it starts (the
socket folder emptied, a new kubelet.sock that refuses connections) or starts and refuses every Register before it
dies (as one still starting does); then a kubelet starts and stays. The figure is the time from that kubelet
serving its kubelet.sock to both resources registered with their device lists received. Used by
tests/test_deviceplugin.py and bench/reregister.py.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

from alnair_agent.constants import RESOURCES
from alnair_standins.kubelet import KubeletEmulator

REFUSE_ALL = 1 << 30


@dataclass(frozen=True)
class Turn:
    kind: str  # "dies": a new kubelet.sock that refuses connections; "refuses": up, refusing Register, then killed
    seconds: float


@dataclass(frozen=True)
class Episode:
    seed: int
    turns: tuple[Turn, ...]
    down_s: float  # from the first kill to the kubelet that stays

    @classmethod
    def draw(cls, seed: int, down_s: tuple[float, float] = (1.0, 4.0), refuses: float = 0.3) -> "Episode":
        rng = random.Random(seed)
        goal = rng.uniform(*down_s)
        turns: list[Turn] = []
        total = 0.0
        while total < goal:
            turn = Turn("refuses" if rng.random() < refuses else "dies", min(rng.uniform(0.05, 0.9), goal - total))
            turns.append(turn)
            total += turn.seconds
        return cls(seed, tuple(turns), total)


@dataclass(frozen=True)
class Outcome:
    seed: int
    down_s: float
    turns: int
    reregister_s: float  # kubelet back (serving) -> both resources registered, devices listed


async def run_episode(kubelet: KubeletEmulator, episode: Episode, timeout: float = 10.0) -> Outcome:
    """Kill the registered kubelet, crash-loop it as `episode` says, then start one that stays; time the agent."""
    await kubelet.crash()
    for turn in episode.turns:
        if turn.kind == "dies":
            await kubelet.restart(dies=True)
            await asyncio.sleep(turn.seconds)
        else:
            kubelet.refuse_registrations = REFUSE_ALL
            await kubelet.restart()
            await asyncio.sleep(turn.seconds)
            await kubelet.crash()
            kubelet.refuse_registrations = 0
    before = len(kubelet.registrations)
    await kubelet.restart()
    back = time.monotonic()
    await kubelet.wait_for(lambda k: len(k.registrations) >= before + len(RESOURCES)
                           and all(r in k.plugins and k.plugins[r].devices for r in RESOURCES), timeout)
    return Outcome(episode.seed, round(episode.down_s, 3), len(episode.turns), time.monotonic() - back)
