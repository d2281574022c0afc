"""The shim's build contracts: the region header is the generated one, and the hook table, the exported names and
the real-function table agree."""

from __future__ import annotations

import subprocess

from alnair_agent.node import region_layout
from shimkit import ROOT


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
    assert exported == set(table) | {"dlsym"} | introspection
    assert introspection == {"alnair_hook_count", "alnair_hook_name", "alnair_hook_real", "alnair_hook_address"}

    # every hooked name exists in the (simulated) real library, and the shim resolved it there
    real_names = _exported(build.sim / "libcuda.so.1") | _exported(build.sim / "libnvidia-ml.so.1")
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
