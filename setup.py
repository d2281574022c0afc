"""Build hooks: generate the gRPC code from the project's .proto files, build the C shim and the demo's simulated
CUDA driver.

They run on every build (wheel, sdist install, editable install). In editable mode the outputs land in the
source tree (ignored by git) so `import alnair_agent` from the checkout finds them.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from alnair_agent.config import SHIM_CC  # noqa: E402 - the build's variables are declared once, with the agent's
from alnair_standins.simdriver import SIM_DRIVER_DIR, SIM_DRIVER_FILES  # noqa: E402

PROTO_DIR = Path("alnair_agent") / "proto"
SHIM_DIR = ROOT / "shim"
SHIM_LIB = "libalnair.so"
SIM_DIR = ROOT / "tests" / "shim" / "simcuda"


def generate_protos(out_root: Path) -> None:
    """Run grpc_tools.protoc on every .proto under alnair_agent/proto, writing into out_root."""
    import grpc_tools
    from grpc_tools import protoc  # build-time dependency (pyproject.toml)

    include = Path(grpc_tools.__file__).parent / "_proto"
    protos = sorted(str(p) for p in PROTO_DIR.glob("*.proto"))
    out_root.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out_root}",
            f"--grpc_python_out={out_root}", f"--pyi_out={out_root}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed for {protos}")


def build_shim(out_dir: Path) -> str | None:
    """Build libalnair.so with the pinned toolchain (make -C shim: zig cc from the `ziglang` build requirement,
    targeting glibc 2.17 whatever this host runs) and copy it to out_dir; the compiler it used (None: no shim/).

    ALNAIR_SHIM_CC=cc (config.SHIM_CC) builds with a host compiler instead (a machine that cannot fetch ziglang,
    say): the library then needs whatever glibc that host's headers give, so it is said loudly and never done
    silently."""
    if not (SHIM_DIR / "Makefile").exists():
        return None
    build_dir = ROOT / "build" / "shim"
    cmd = ["make", "-C", str(SHIM_DIR), f"BUILD={build_dir}", f"PYTHON={sys.executable}"]
    host_cc = os.environ.get(SHIM_CC.name)
    if host_cc:
        print(f"warning: building libalnair.so with {host_cc} ({SHIM_CC.name}): its glibc floor is this host's, "
              "not GLIBC_2.17", file=sys.stderr)
        cmd.append(f"CC={host_cc}")
    elif importlib.util.find_spec("ziglang") is None:
        raise RuntimeError("libalnair.so is built with the pinned zig toolchain: install `ziglang` (a build "
                           "requirement in pyproject.toml, which pip's isolated build installs), or set "
                           f"{SHIM_CC.name}=cc to build with a host compiler (its glibc floor is then the host's)")
    subprocess.run(cmd, check=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(build_dir / SHIM_LIB, out_dir / SHIM_LIB)
    return subprocess.run([*cmd, "-s", "print-cc"], check=True, capture_output=True, text=True).stdout.strip()


def build_simulated_driver(out_dir: Path, cc: str) -> None:
    """Build the demo's simulated CUDA driver (tests/shim/simcuda: libcuda.so.1, libnvidia-ml.so.1 and simapp) with
    the shim's compiler and copy it to out_dir, so `alnair-agent demo` runs from an installed package in any folder.
    Skipped where its sources are not there (the image's build context has no tests/)."""
    if not (SIM_DIR / "Makefile").exists():
        return
    build_dir = ROOT / "build" / "sim"
    subprocess.run(["make", "-C", str(SIM_DIR), f"BUILD={build_dir}", f"SHIM={SHIM_DIR}", f"CC={cc}", "demo"],
                   check=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in SIM_DRIVER_FILES:
        shutil.copy2(build_dir / name, out_dir / name)


class BuildWithGenerated(build_py):
    def run(self) -> None:
        os.chdir(ROOT)
        editable = getattr(self, "editable_mode", False)
        target = ROOT if editable else Path(self.build_lib)
        generate_protos(target)
        cc = build_shim(target / "alnair_agent" / "lib")
        if cc is not None:
            build_simulated_driver(target / "alnair_standins" / SIM_DRIVER_DIR, cc)
        super().run()


if __name__ == "__main__":
    setup(cmdclass={"build_py": BuildWithGenerated})
