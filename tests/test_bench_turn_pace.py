"""bench/turn_pace.py's judging: each windows phase against the lent phases around it, a moving reference fails."""

from __future__ import annotations

import pytest
import turn_pace as tp


def phases(kinds: str, shown: bool = True) -> list[tp.Phase]:
    return [tp.Phase("lent" if k == "l" else "windows", float(i), float(i) + 1.0, shown) for i, k in enumerate(kinds)]


def rates(*per_phase: float):  # type: ignore[no-untyped-def]
    return lambda t0, t1: per_phase[int(t0)]


@pytest.mark.parametrize(("cap", "shape", "per_phase", "result", "share"), [
    (30, "train", (100, 30, 100, 30, 100), "pass", 30.0),
    (30, "train", (100, 28, 100, 28.5, 100), "FAIL", 28.5),  # pace 94 %: inside +-3 of the cap, under 97 %
    (30, "train", (100, 30, 110, 30, 100), "FAIL", 28.57),  # a reference that moved 9 %: judges nothing
    (20, "mm", (100, 23, 100, 23, 100), "pass", 23.0),  # a matmul at a duty runs faster: above the cap is allowed
    (20, "train", (100, 23.5, 100, 23.5, 100), "FAIL", 23.5),
    (50, "small", (100, 46, 100, 46, 100), "FAIL", 46.0),
])
def test_a_windows_phase_is_judged_against_the_lent_phases_around_it(cap, shape, per_phase, result, share):
    rows = tp.judge(cap, phases("lwlwl"), rates(*per_phase))
    assert len(rows) == 2
    v = tp.verdict(cap, shape, rows)
    assert v["result"] == result, v
    assert v["share"] == pytest.approx(share, abs=0.01)


def test_a_phase_whose_state_never_showed_judges_nothing():
    rows = tp.judge(30, phases("lwl", shown=False), rates(100, 30, 100))
    assert tp.verdict(30, "train", rows)["unstable"]
    assert tp.verdict(30, "train", [])["result"] == "FAIL"
