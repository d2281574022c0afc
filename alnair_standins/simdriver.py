"""The simulated CUDA driver (libcuda.so.1, libnvidia-ml.so.1) and its test program `simapp`, as the demo runs them.

Its sources are C, in tests/shim/simcuda (beside the shim tests that drive it). `pip install` builds it with the
shim's compiler into this package (setup.py: alnair_standins/lib/sim/), so `alnair-agent demo` runs from any
folder; a checkout that was never installed builds it with `make` instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

SIM_DRIVER_DIR = "lib/sim"  # under alnair_standins/, where setup.py puts the build
SIM_DRIVER_FILES = ("libcuda.so.1", "libnvidia-ml.so.1", "simapp")  # what `alnair-agent demo` runs of it


class DriverUnavailable(RuntimeError):
    """Neither a built driver in the package nor a checkout and `make` to build one; the message says why."""


def packaged_simulated_driver() -> Path:
    """Where setup.py builds the driver into the package."""
    return Path(__file__).resolve().parent / SIM_DRIVER_DIR


def source_root() -> Path | None:
    """The checkout with tests/shim/simcuda and shim/ (the package's parent in a checkout, else the working dir)."""
    for root in (Path(__file__).resolve().parents[1], Path.cwd()):
        if (root / "tests/shim/simcuda/Makefile").is_file() and (root / "shim/cuda_abi.h").is_file():
            return root
    return None


def simulated_driver(out: Path) -> Path:
    """The simulated driver (libcuda.so.1, libnvidia-ml.so.1) and simapp in `out`: copied from the package, or
    built from a checkout when the package holds none (run from a source tree that was never installed)."""
    packaged = packaged_simulated_driver()
    if all((packaged / name).is_file() for name in SIM_DRIVER_FILES):
        out.mkdir(parents=True, exist_ok=True)
        for name in SIM_DRIVER_FILES:
            shutil.copyfile(packaged / name, out / name)
            os.chmod(out / name, 0o755)  # simapp runs; a wheel's installer need not have kept the mode
        return out
    return build_simulated_driver(out)


def build_simulated_driver(out: Path) -> Path:
    """`make` the simulated driver (libcuda.so.1, libnvidia-ml.so.1) and simapp into `out`; the folder."""
    root = source_root()
    if root is None:
        raise DriverUnavailable(f"the package holds no simulated CUDA driver ({packaged_simulated_driver()}) and no "
                                "checkout of the project is here to build it from: reinstall it from a checkout "
                                "(`pip install .` builds the driver beside the shim)")
    if shutil.which("make") is None:
        raise DriverUnavailable("the demo builds the simulated CUDA driver with `make` and a C compiler; install them")
    done = subprocess.run(["make", "-s", "-C", str(root / "tests/shim/simcuda"), f"BUILD={out}",
                           f"SHIM={root / 'shim'}"], capture_output=True, text=True)
    if done.returncode != 0:
        raise DriverUnavailable(f"building the simulated CUDA driver failed: {done.stderr.strip()[-400:]}")
    return out
