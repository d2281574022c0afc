"""Fixtures for the shim tests: build libalnair.so and the simulated driver once (session), a runner, regions.

Helpers live in shimkit.py (a uniquely named module, so tests can import it whatever other conftest is loaded).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from alnair_agent.node.region import Region
from shimkit import ROOT, SIM_SRC, Build, Runner


@pytest.fixture(scope="session")
def build(tmp_path_factory: pytest.TempPathFactory) -> Build:
    out = tmp_path_factory.mktemp("shimbuild")
    # the shim with the pinned toolchain the package build uses (zig cc from the venv's ziglang, glibc 2.17)
    for args in (["make", "-s", "-C", str(ROOT / "shim"), f"BUILD={out / 'shim'}", f"PYTHON={sys.executable}"],
                 ["make", "-s", "-C", str(SIM_SRC), f"BUILD={out / 'sim'}", f"SHIM={ROOT / 'shim'}"]):
        subprocess.run(args, check=True, capture_output=True, text=True)
    return Build(shim=out / "shim" / "libalnair.so", sim=out / "sim")


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
