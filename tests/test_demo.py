"""The demo in a shortened mode, as CI runs it: three containers run a CUDA workload through the real shim on the
simulated driver, a fourth is refused; the table shows each one's cap, and no container goes past it (what the
system guarantees today: caps and memory limits are ceilings; a container sharing a GPU may get less than its
cap until the dispatcher hands out the unused time). No log line lands in the table."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from alnair_agent.demo import DEMO_WORKLOADS, HEADER, demo

pytestmark = pytest.mark.timeout(60)
GiB = 1 << 30


async def test_demo_shows_the_caps_and_no_container_exceeds_its_cap(tmp_path: Path) -> None:
    out = io.StringIO()
    result = await demo(tmp_path, seconds=2.5, out=out)
    text = out.getvalue()
    rows = {r.workload.pod: r for r in result.rows}
    assert set(rows) == {w.pod for w in DEMO_WORKLOADS}
    assert rows["too-big-d"].refused and "refused at admission" in text
    # the 30/70 pair shares one GPU, the third is on the other
    assert rows["train-a"].gpu == rows["train-b"].gpu != rows["notebook-c"].gpu
    shown = {}
    for line in text.splitlines():
        m = re.match(r"^(\S+)/main\s+GPU\d\s+(\d+)%", line)
        if m:
            shown[m.group(1)] = int(m.group(2))
    assert shown == {"train-a": 30, "train-b": 70, "notebook-c": 20}  # the caps the table shows
    for pod in ("train-a", "train-b", "notebook-c"):
        r = rows[pod]
        assert r.returncode == 0, r.output
        assert r.compute_limit == shown[pod]
        assert 0 < r.util_mean <= r.compute_limit + 3, (pod, r.util_mean)
        # One profiler sample may overshoot while the dispatcher's charge factor ramps up at start (seen: 78 % under
        # 70 % in a 2.5 s run); the mean is the cap's guarantee.
        assert r.util_max <= r.compute_limit + 15, (pod, r.util_max)
        assert 0 < r.memory_max <= r.memory_limit
    assert rows["train-a"].throttled_s > 0.5 and rows["train-b"].throttled_s > 0.5  # held back by their caps
    assert rows["train-a"].memory_max >= 6 * GiB
    # past its 4 GiB limit, the notebook's second allocation is refused by the shim
    assert any(ln.startswith(f"alloc {2 * GiB} rc=2 ") for ln in rows["notebook-c"].output)
    assert "CUDA_ERROR_OUT_OF_MEMORY" in text and "Summary" in text and HEADER in text
    # nothing but the demo's own lines: no log line in the table
    assert not re.search(r"^\{|\[(info|warning|error)|fork_posix|^\d{4}-\d\d-\d\d", text, flags=re.M)
