"""Issue 18's shares on a real GPU, the fast subset of bench/shares_gpu.py (the same code, shorter windows): two
tenants at 30 % and 70 % of a matmul loop that synchronizes every 20 matmuls, a launch-bound loop of small kernels
alone under a 30 % cap, and an elastic 30 % lender giving the GPU back to a 70 % tenant that arrives beside a
never-synchronizing matmul loop. Each program's shares are against the same program alone on the whole GPU, no
shim, measured first. About a minute.

Needs a GPU, torch, pynvml, structlog, kubernetes-asyncio and the shim (ALNAIR_SHIM, else the installed one).
Results (JSON, the table's rows among them) go to $ALNAIR_GPU_RESULTS/shares_gpu_test.json if set.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(400)]

pytest.importorskip("pynvml")
pytest.importorskip("torch")
structlog = pytest.importorskip("structlog")
pytest.importorskip("kubernetes_asyncio")

import shares_gpu as sg

from alnair_standins.workloads import skip_without_gpu_or_shim

ROOT = Path(__file__).resolve().parents[2]

SHIM = Path(os.environ.get("ALNAIR_SHIM") or ROOT / "alnair_agent/lib/libalnair.so")
SECONDS = 2.5  # the measured window (settle 0.83 s before it); the benchmark's default is 3
SHAPES = ["mm-sync", "small", "mm"]
STEPS = [sg.Step("pair", ("mm-sync",)), sg.Step("caps", ("small",), 30), sg.Step("elastic", ("mm",))]
# The launch-bound loop keeps the GPU 29-31 % busy alone (its host sets the pace), so at a 30 % cap NVML reads
# ~9 %: its NVML row is shown by the benchmark, not asserted (no time share can put it at 30).
GOALS = [("mm-sync", "pair 30+70: ratio"), ("mm-sync", "pair 30+70: shares"), ("small", "cap 30: share"),
         ("mm", "elastic: 30 % alone"), ("mm", "elastic: 70 % arrives"), ("mm", "elastic: lender back")]


@pytest.fixture(scope="module")
def rows() -> dict[tuple[str, str], sg.Row]:
    skip_without_gpu_or_shim(SHIM)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    out = os.environ.get("ALNAIR_GPU_RESULTS")
    record: dict = {}
    table = asyncio.run(sg.run(sg.Bench(SHIM, sg.Windows(SECONDS)), SHAPES, STEPS, set(sg.SCENARIOS), record,
                               Path(out) / "shares_gpu_test.json" if out else None))
    print("SHARES\n" + sg.table(table))
    return {(r.shape, r.scenario): r for r in table}


@pytest.mark.parametrize("shape, scenario", GOALS)
def test_goal_holds(rows: dict[tuple[str, str], sg.Row], shape: str, scenario: str) -> None:
    row = rows.get((shape, scenario))
    assert row is not None, [r for (s, _), r in rows.items() if s == shape]  # an error row says why
    assert row.ok, row
