"""The demo's DRA run, shortened as CI runs it: the same workloads as claims, allocated by the scheduler stand-in
from the agent's ResourceSlice, prepared by the DRA kubelet emulator, run through the real shim on the simulated
driver: the same caps and limits hold, and the claims leave nothing behind once unprepared."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from alnair_agent.demo.dra import demo_dra
from alnair_standins.simdriver import build_simulated_driver

pytestmark = pytest.mark.timeout(60)
GiB = 1 << 30


async def test_the_dra_run_enforces_the_claims_slices(tmp_path: Path) -> None:
    sim = build_simulated_driver(tmp_path / "sim")
    out = io.StringIO()
    result = await demo_dra(tmp_path / "dra", sim, seconds=2.5, out=out)
    text = out.getvalue()
    rows = {r.workload.pod: r for r in result.rows}
    assert rows["too-big-d"].refused and "stays Pending" in text
    assert rows["train-a"].gpu == rows["train-b"].gpu != rows["notebook-c"].gpu  # first fit packs 30 + 70
    for pod, cap in (("train-a", 30), ("train-b", 70), ("notebook-c", 20)):
        r = rows[pod]
        assert r.returncode == 0, r.output
        assert r.compute_limit == cap and 0 < r.util_mean <= cap + 3, (pod, r.util_mean)
        assert 0 < r.memory_max <= r.memory_limit
    assert rows["notebook-c"].memory_limit == 4 * GiB
    assert any(ln.startswith(f"alloc {2 * GiB} rc=2 ") for ln in rows["notebook-c"].output)  # past 4 GiB: refused
    assert "Claims unprepared: 0 DRA slices left on the node, 0 CDI specs." in text
    assert "consumed {'memory': '8Gi', 'compute': '30'}" in text and "alnair.centaurus.io/gpu=" in text
    assert not re.search(r"^\{|\[(info|warning|error)|^\d{4}-\d\d-\d\d", text, flags=re.M)
