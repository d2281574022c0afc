"""The shim and the simulated driver, built for the tests and benchmarks that run real processes under the shim.

The shim is built as the package build does (`make -C shim` with the pinned toolchain: zig cc from this
interpreter's `ziglang`, glibc 2.17); the simulated driver (tests/shim/simcuda: libcuda.so.1, libnvidia-ml.so.1 and
the `simapp` program) with the host compiler.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIM_SRC = ROOT / "tests" / "shim" / "simcuda"


@dataclass(frozen=True)
class Build:
    shim: Path  # libalnair.so
    sim: Path  # folder with libcuda.so.1, libnvidia-ml.so.1, simapp

    @property
    def app(self) -> Path:
        return self.sim / "simapp"


def build_shim_and_driver(out: Path, cflags: str | None = None) -> Build:
    """Build both under `out` (shim/ and sim/); `cflags` for a diagnostic build of the shim ("-O2 -DLAT_WAIT_HOLD=1")."""
    shim = ["make", "-s", "-C", str(ROOT / "shim"), f"BUILD={out / 'shim'}", f"PYTHON={sys.executable}"]
    for args in (shim + ([f"CFLAGS={cflags}"] if cflags else []),
                 ["make", "-s", "-C", str(SIM_SRC), f"BUILD={out / 'sim'}", f"SHIM={ROOT / 'shim'}"]):
        subprocess.run(args, check=True, capture_output=True, text=True)
    return Build(shim=out / "shim" / "libalnair.so", sim=out / "sim")
