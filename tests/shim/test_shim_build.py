"""The shim's build contracts: the region header is the generated one, and the hook table, the exported names and
the real-function table agree."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from shimkit import ROOT

from alnair_agent.node import region_layout


def test_checked_in_region_header_is_the_generated_one():
    checked_in = (ROOT / "shim" / "region_layout.h").read_text()
    assert checked_in == region_layout.c_header(), (
        "shim/region_layout.h differs from alnair_agent/node/region_layout.py: regenerate it with "
        "`python -m alnair_agent.node.region_layout > shim/region_layout.h`"
    )


def _exported(lib) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], check=True, capture_output=True, text=True).stdout
    return {ln.split()[-1].split("@")[0] for ln in out.splitlines() if ln.strip()}


def test_exports_hook_table_and_real_functions_agree(build, runner, make_region):
    region = make_region(memory_limit=1 << 30, compute_limit=50)
    res = runner.run("hooks", region=region)
    table = {}
    for ln in res.lines:
        if ln.startswith("hook "):
            name, *kv = ln.split()[1:]
            table[name] = dict(w.split("=") for w in kv)
    assert len(table) > 40, res.lines

    # exported names == the hook table, plus dlsym and the introspection functions
    exported = _exported(build.shim)
    introspection = {n for n in exported if n.startswith("alnair_")}
    assert exported == set(table) | {"dlsym", "dlvsym"} | introspection
    assert introspection == {"alnair_hook_count", "alnair_hook_name", "alnair_hook_real", "alnair_hook_address"}

    # every hooked name exists in the (simulated) real library, and the shim resolved it there
    real_names = (_exported(build.sim / "libcuda.so.1") | _exported(build.sim / "libnvidia-ml.so.1")) - {"SIMCUDA_1.0"}
    assert set(table) <= real_names, set(table) - real_names
    for name, row in table.items():
        assert row == {"real": "1", "exported": "1", "dlsym_is_hook": "1"}, (name, row)


def test_shim_builds_without_cuda_headers_and_warnings_are_errors():
    makefile = (ROOT / "shim" / "Makefile").read_text()
    for flag in ("-O2", "-fPIC", "-Wall", "-Wextra", "-Werror", "-std=gnu11", "-pthread", "-ldl"):
        assert flag in makefile
    for src in (ROOT / "shim").glob("*.[ch]"):
        text = src.read_text()
        assert "#include <cuda" not in text and "#include <nvml" not in text, src


def _glibc_needs(lib) -> list[tuple[int, ...]]:
    out = subprocess.run(["readelf", "-W", "-V", str(lib)], check=True, capture_output=True, text=True).stdout
    return sorted({tuple(int(x) for x in v.split(".")) for v in re.findall(r"Name: GLIBC_([0-9.]+)", out)})


def test_shipped_build_needs_nothing_newer_than_glibc_2_17(build):
    """The shim is preloaded into every GPU container whatever its base image (Ubuntu 20.04, UBI 8, CentOS 7 era):
    the build the tests run (the pinned zig toolchain, as `pip install` builds it) needs no newer glibc symbol."""
    needs = _glibc_needs(build.shim)
    assert needs and max(needs) <= (2, 17), needs
    dyn = subprocess.run(["readelf", "-W", "-d", str(build.shim)], check=True, capture_output=True, text=True).stdout
    needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", dyn))
    assert needed <= {"libc.so.6", "libdl.so.2", "libpthread.so.0"}, needed
    assert "TEXTREL" not in dyn


@pytest.mark.parametrize("cflags", ["-O0", "-O2"])
def test_host_compiler_builds_with_werror_and_cflags_keep_pic(tmp_path, cflags):
    """`make CC=gcc CFLAGS=...` (a developer's build): -Werror passes with gcc too, and a CFLAGS given on the
    command line keeps -fPIC and the warnings."""
    if shutil.which("gcc") is None:
        pytest.skip("no gcc")
    args = ["make", "-s", "-C", str(ROOT / "shim"), f"BUILD={tmp_path}", "CC=gcc", f"CFLAGS={cflags}"]
    dry = subprocess.run([*args, "-n", "-B"], check=True, capture_output=True, text=True).stdout
    compiles = [ln for ln in dry.splitlines() if " -c " in ln]
    assert compiles and all("-fPIC" in ln and "-Werror" in ln and cflags in ln for ln in compiles), dry
    subprocess.run(args, check=True, capture_output=True, text=True)
    dyn = subprocess.run(["readelf", "-W", "-d", str(tmp_path / "libalnair.so")], check=True, capture_output=True,
                         text=True).stdout
    assert "TEXTREL" not in dyn


def test_arm_build_with_the_pinned_toolchain(tmp_path):
    """The same pinned toolchain cross-builds the aarch64 shim (Grace Hopper nodes): -Werror clean, glibc 2.17."""
    import sys

    subprocess.run(["make", "-s", "-C", str(ROOT / "shim"), f"BUILD={tmp_path}", f"PYTHON={sys.executable}",
                    "ARCH=aarch64"], check=True, capture_output=True, text=True)
    lib = tmp_path / "libalnair.so"
    header = subprocess.run(["readelf", "-h", str(lib)], check=True, capture_output=True, text=True).stdout
    assert "AArch64" in header
    needs = _glibc_needs(lib)
    assert needs and max(needs) <= (2, 17), needs


# The metered launch path, each launch after the program's own work: its code (ALNAIR_HOT_TEXT) side by side
# (shim/hot_text.ld), its process-wide words on one cache line (struct alnair_hot, checked by _Static_assert).
HOT_PATH = ("cuLaunchKernel", "cuLaunchKernel_ptsz", "cuLaunchKernelEx", "cuLaunchKernelEx_ptsz", "pre_launch",
            "post_launch", "turn_gate", "windows", "stream_find", "capturing", "alnair_now_ns")


def _hot_layout(lib) -> tuple[dict[str, int], tuple[int, int]]:
    syms = {}
    for ln in subprocess.run(["nm", str(lib)], check=True, capture_output=True, text=True).stdout.splitlines():
        parts = ln.split()
        if len(parts) == 3 and parts[1] in "tT" and parts[2] in HOT_PATH:
            syms[parts[2]] = int(parts[0], 16)
    secs = subprocess.run(["readelf", "-W", "-S", str(lib)], check=True, capture_output=True, text=True).stdout
    m = re.search(r"\.text\.alnair_hot\s+PROGBITS\s+([0-9a-f]+)\s+[0-9a-f]+\s+([0-9a-f]+)", secs)
    assert m, secs
    return syms, (int(m.group(1), 16), int(m.group(2), 16))


@pytest.mark.parametrize("toolchain, pages", [("pinned", 2), ("gcc", 3)])
def test_launch_path_code_lies_on_two_pages(tmp_path, toolchain, pages):
    """Every function of the metered launch path lies in the shim's hot text section, which starts on a page and
    spans at most two in the shipped build (it touched six pages of the shim's text before: a VM's TLB miss is a
    two-level walk); gcc's code (a developer's build) is 8.1 KB, so three there."""
    import sys

    if toolchain == "gcc" and shutil.which("gcc") is None:
        pytest.skip("no gcc")
    cc = ["CC=gcc"] if toolchain == "gcc" else [f"PYTHON={sys.executable}"]
    subprocess.run(["make", "-s", "-C", str(ROOT / "shim"), f"BUILD={tmp_path}", *cc], check=True,
                   capture_output=True, text=True)
    syms, (start, size) = _hot_layout(tmp_path / "libalnair.so")
    assert set(syms) == set(HOT_PATH), set(HOT_PATH) - set(syms)
    assert start % 4096 == 0 and size <= pages * 4096, (hex(start), size)
    assert all(start <= a < start + size for a in syms.values()), {k: hex(v) for k, v in syms.items()}
