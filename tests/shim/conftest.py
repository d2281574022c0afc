"""Fixtures for the shim tests: build libalnair.so and the simulated driver once (session), a runner, regions.

Helpers live in shimkit.py (a uniquely named module, so tests can import it whatever other conftest is loaded).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from shimkit import Build, Runner

from alnair_agent.node.region import Region
from alnair_standins.simbuild import build_shim_and_driver


@pytest.fixture(scope="session")
def build(tmp_path_factory: pytest.TempPathFactory) -> Build:
    return build_shim_and_driver(tmp_path_factory.mktemp("shimbuild"))


@pytest.fixture
def runner(build: Build, tmp_path: Path) -> Runner:
    return Runner(build, tmp_path)


@pytest.fixture
def make_region(tmp_path: Path):
    """Create a region file as the agent does; returns its path."""
    made = []

    def make(memory_limit: int = 0, compute_limit: int = 0, name: str = "region") -> Path:
        path = tmp_path / name
        made.append(Region.create(path, memory_limit, compute_limit))
        return path

    yield make
    for r in made:
        r.close()
