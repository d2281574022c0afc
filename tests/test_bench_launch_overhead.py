"""bench/launch_overhead.py's judging: each figure against its goal, the across-process figures judged only when the
processes without the shim agree with each other."""

from __future__ import annotations

import launch_overhead as lo
import pytest


def procs(ref_medians: list[float], uncapped: float, metered: float) -> dict[str, list[list[float]]]:
    return {"no shim": [[m] * 5 for m in ref_medians],
            "shim, region (uncapped)": [[uncapped] * 5 for _ in ref_medians],
            "shim, no region": [[uncapped] * 5 for _ in ref_medians],
            "shim, region (capped: metered)": [[metered] * 5 for _ in ref_medians]}


@pytest.mark.parametrize(("refs", "hook", "metered_hook", "metered", "want"), [
    # refs agree: every figure judged
    ([4000, 4010, 3990], 4010, 4090, 4090, ["pass", "pass", "pass", "pass"]),
    # the metered path over its goal, in process and across processes
    ([4000, 4010, 3990], 4010, 4150, 4150, ["pass", "FAIL", "FAIL", "pass"]),
    # uncapped over its 25 ns in process
    ([4000, 4010, 3990], 4030, 4050, 4050, ["FAIL", "pass", "pass", "pass"]),
    # processes without the shim 300 ns apart: the across-process rows judge nothing, the in-process ones still do
    ([3800, 4100, 4000], 4010, 4050, 4050, ["pass", "UNSTABLE", "pass", "UNSTABLE"]),
])
def test_figures_are_judged_against_their_goals_and_a_moving_reference_judges_nothing(
        refs, hook, metered_hook, metered, want):
    inproc = {"real": [4000.0] * 8, "hook": [float(hook)] * 8}
    inproc_metered = {"real": [4000.0] * 8, "hook": [float(metered_hook)] * 8}
    result = lo.judge(inproc, inproc_metered, procs(refs, 4005.0, float(metered)))
    assert [v["result"].split()[0] for v in result["verdicts"]] == want, result["verdicts"]
    assert result["reference_spread_ns"] == max(refs) - min(refs)
