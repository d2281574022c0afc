"""bench/shares_gpu.py's analysis on synthetic completion marks (no torch, no GPU): shares per window, the time
from which a figure holds (elastic give-back), the scaled-cap rule, the usage truth, the plan and the table."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import shares_gpu as sg


def marks(pieces: list[tuple[float, float]], t0: float, t1: float, dt: float = 0.01) -> list[list[float]]:
    """Marks every dt from t0 to t1 of a program doing `rate` units/s from each piece's time on (piecewise)."""
    def rate_at(t: float) -> float:
        return [r for since, r in pieces if since <= t + 1e-12][-1]

    out, done, n = [[t0, 0.0]], 0.0, round((t1 - t0) / dt)
    for i in range(n):
        a = t0 + i * dt
        done += rate_at(a) * dt  # pieces start on multiples of dt in these tests
        out.append([t0 + (i + 1) * dt, done])
    return out


def tenant(pieces: list[tuple[float, float]], start: float, end: float, dt: float = 0.01) -> dict:
    return {"unit": "u", "born": start - 5, "set_up": start - 1, "start": start, "host_end": end, "end": end + 0.1,
            "marks": marks(pieces, start, end, dt)}


# -- shares from marks ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("t, want", [(-1.0, 0.0), (0.0, 0.0), (0.5, 5.0), (1.0, 10.0), (2.0, 20.0), (3.0, 30.0),
                                     (9.0, 30.0)])
def test_progress_is_linear_between_marks_and_flat_outside(t: float, want: float) -> None:
    p = sg.Progress([[3.0, 30], [0.0, 0], [1.0, 10]])  # unsorted on purpose
    assert p.at(t) == pytest.approx(want)


@pytest.mark.parametrize("pieces, alone, t0, t1, want", [
    ([(0.0, 50.0)], 100.0, 0.5, 1.5, 50.0),  # half the program's pace alone
    ([(0.0, 10.0), (1.0, 30.0)], 10.0, 0.5, 1.5, 200.0),  # a window across a change: the mean of both halves
    ([(0.0, 70.0)], 100.0, 0.0, 2.0, 70.0),
])
def test_share_is_units_per_second_against_alone(pieces, alone, t0, t1, want) -> None:
    p = sg.Progress(marks(pieces, 0.0, 2.0))
    assert sg.share(p, alone, t0, t1) == pytest.approx(want)


def test_share_series_grid_and_slide() -> None:
    p = sg.Progress(marks([(0.0, 10.0), (1.0, 30.0)], 0.0, 2.0))
    assert sg.share_series(p, 10.0, 0.0, 2.0, 0.5) == pytest.approx([100, 100, 300, 300])
    slid = sg.share_series(p, 10.0, 0.0, 2.0, 0.5, 0.25)
    assert len(slid) == 7 and slid[2] == pytest.approx(100) and slid[3] == pytest.approx(200)
    assert sg.share_series(p, 10.0, 0.0, 0.05, 0.1) == []  # shorter than one window


@pytest.mark.parametrize("xs, want", [
    ([5, 5, 5], 0.0), ([0, 5, 5], 0.1), ([5, 0, 5], 0.2), ([0, 0, 5], 0.2), ([5, 5, 0], None), ([], None),
])
def test_held_from_is_the_first_window_after_which_all_hold(xs, want) -> None:
    assert sg.held_from(xs, lambda x: x > 1, 0.1) == (None if want is None else pytest.approx(want))


def test_arrival_time_on_sliding_windows() -> None:
    # 20 %/s until 0.15 s, then 70 %: a 100 ms window [t, t+0.1] holds >= 63 % from t = 0.136 s, so 0.14 on 10 ms
    p = sg.Progress(marks([(0.0, 20.0), (0.15, 70.0)], 0.0, 1.0, 0.01))
    xs = sg.share_series(p, 100.0, 0.0, 1.0, 0.1, 0.01)
    assert sg.held_from(xs, lambda x: x >= 63, 0.01) == pytest.approx(0.14)


# -- the rules --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("caps, shares, f, ok", [
    ((30, 70), (29.0, 69.0), 0.98, True),  # each at its cap x 0.98
    ((30, 70), (31.0, 62.0), 0.93, False),  # the small one took the loss out of the big one's share (issue 18)
    ((30, 70), (27.0, 63.0), 0.90, True),  # a 10 % loss, split in proportion: still within the rule
    ((30, 70), (26.0, 60.0), 0.86, False),  # split in proportion, but the GPU lost too much
    ((30, 70), (32.0, 71.0), 1.03, True),  # above 1: no scaling, each a ceiling within 3 points
    ((30, 70), (34.0, 70.0), 1.04, False),  # a strict cap overrun by 4 points
    ((20, 30, 50), (21.6, 32.5, 41.5), 0.956, False),  # issue 18's three tenants
    ((20, 30, 50), (19.6, 28.9, 47.0), 0.955, True),
])
def test_scaled_cap_rule(caps, shares, f, ok) -> None:
    r = sg.scaled_caps(caps, shares)
    assert r.f == pytest.approx(f, abs=5e-3)
    assert r.ok is ok
    assert r.targets == pytest.approx([c * min(r.f, 1.0) for c in caps])


@pytest.mark.parametrize("ratio, ok", [(3 / 7, True), (0.47, True), (0.39, True), (0.38, False), (0.491, False),
                                       (0.514, False)])
def test_pair_ratio_within_ten_percent_of_three_to_seven(ratio, ok) -> None:
    assert sg.ratio_ok(ratio) is ok


@pytest.mark.parametrize("device, shares, want", [
    (90.0, (30.0, 60.0), (30.0, 60.0)),
    (95.0, (29.0, 66.0), (29.0, 66.0)),
    (80.0, (20.0, 30.0, 50.0), (16.0, 24.0, 40.0)),  # the device's busy time split by the work each did
    (50.0, (0.0, 0.0), (0.0, 0.0)),
])
def test_usage_truth(device, shares, want) -> None:
    assert sg.usage_truth(device, shares) == pytest.approx(want)


def snaps(rates: dict[str, float], t0: float, n: int, dt: float = 0.25) -> list[sg.Snapshot]:
    """The profiler every dt from t0: each allocation's integral grows by its rate (percent) x dt."""
    return [sg.Snapshot(t0 + i * dt, 100 + i * dt, {a: 7.0 + r * i * dt for a, r in rates.items()},
                        {a: r / 2 for a, r in rates.items()}) for i in range(n)]


@pytest.mark.parametrize("t0, t1, alloc, want", [
    (0.1, 3.0, "a", (30.0, 0.25, 3.0)),
    (0.0, 3.0, "b", (60.0, 0.0, 3.0)),
    (0.1, 0.4, "a", None),  # one sample in the window
    (0.0, 3.0, "c", None),  # not one of the profiler's allocations
])
def test_usage_between_profiler_samples(t0, t1, alloc, want) -> None:
    got = sg.usage_between(snaps({"a": 30.0, "b": 60.0}, 0.0, 20), alloc, t0, t1)
    assert got == (None if want is None else pytest.approx(want))


# -- scenarios analysed -----------------------------------------------------------------------------------------
def nvml_at(value: float):
    return lambda t0, t1: value


@pytest.mark.parametrize("rate, nvml, share_ok, nvml_ok", [(30.0, 30.5, True, True), (34.0, 29.0, False, True),
                                                           (30.0, 26.5, True, False)])
def test_cap_alone(rate, nvml, share_ok, nvml_ok) -> None:
    o = tenant([(0.0, 200.0), (0.5, rate)], 0.0, 4.2)  # a burst before the settle is not counted
    r = sg.analyse_cap(30, o, 100.0, nvml_at(nvml), 1.0)
    assert r["share"] == pytest.approx(rate)
    rows = sg.cap_rows("mm", r)
    assert [x.ok for x in rows] == [share_ok, nvml_ok]
    assert len(r["share_per_100ms"]) == 32  # 3.2 s after the settle


def test_pair_analysed_with_its_usage() -> None:
    outs = [tenant([(0.0, 29.0)], 10.0, 14.2), tenant([(0.0, 68.0)], 10.002, 14.2)]
    r = sg.analyse_together((30, 70), outs, 100.0, nvml_at(97.0), snaps({"a": 29.5, "b": 71.5}, 9.0, 30),
                            ["a", "b"], 1.0)
    assert r["shares"] == pytest.approx([29.0, 68.0], abs=0.01)
    assert r["ratio"] == pytest.approx(29 / 68, abs=1e-3) and r["scaled_ok"]
    assert [u["truth"] for u in r["usage"]] == pytest.approx([29.0, 68.0], abs=0.01)
    assert [u["measured"] for u in r["usage"]] == pytest.approx([29.5, 71.5])
    assert r["usage"][0]["annotation_gpu_util_mean"] == pytest.approx(29.5 / 2)
    rows = sg.together_rows("mm", "pair 30+70", r) + sg.usage_rows("mm", "pair", r)
    assert [x.ok for x in rows] == [True, True, False]  # usage: 71.5 against 68.0 is off by 3.5


def test_together_window_is_when_all_run() -> None:
    outs = [tenant([(0.0, 10.0)], 0.0, 3.0), tenant([(0.0, 10.0)], 0.5, 2.5)]
    assert sg.window(outs, 1.0) == pytest.approx((1.5, 2.5))
    with pytest.raises(ValueError):
        sg.window(outs, 1.9)


def test_usage_without_profiler_samples_is_a_failure() -> None:
    outs = [tenant([(0.0, 30.0)], 0.0, 4.2), tenant([(0.0, 70.0)], 0.0, 4.2)]
    r = sg.analyse_together((30, 70), outs, 100.0, nvml_at(100.0), [], ["a", None], 1.0)
    assert [x.ok for x in sg.usage_rows("mm", "pair", r)] == [False]


PLAN = sg.ElasticPlan(settle=1.0, lone=2.0, horizon=3.0)


@pytest.mark.parametrize("lender_lag, newcomer_lag, lender_s, newcomer_s", [
    (0.0, 0.0, 0.0, 0.0),  # given back at once
    (0.3, 0.0, 0.29, 0.0),  # the lender at 100 % for 0.3 s after the newcomer's first mark
    (0.0, 0.25, 0.0, 0.24),  # the newcomer at 40 % for 0.25 s
    (5.0, 5.0, None, None),  # never
])
def test_elastic_arrival(lender_lag, newcomer_lag, lender_s, newcomer_s) -> None:
    release = 3.0  # lender started at 0; first newcomer mark at 3.01 (marks every 10 ms)
    first = release + 0.01
    lender = tenant([(0.0, 100.0), (round(first + lender_lag, 2), 30.0)], 0.0, 7.0)
    newcomer = tenant([(0.0, 40.0), (round(first + newcomer_lag, 2), 70.0)], release, 6.5)
    r = sg.analyse_elastic(lender, newcomer, 100.0, nvml_at(100.0), PLAN)
    assert r["lone"] == pytest.approx(100.0)
    assert r["first_mark_s"] == pytest.approx(0.01)
    for got, want in ((r["lender_s"], lender_s), (r["newcomer_s"], newcomer_s)):
        assert got == (None if want is None else pytest.approx(want, abs=0.011))
    rows = sg.elastic_rows("mm", r)
    assert [x.ok for x in rows] == [True, newcomer_s is not None and newcomer_s <= 0.2,
                                    lender_s is not None and lender_s <= 0.2]


def test_elastic_arrival_is_judged_on_each_tenants_own_pace_alone() -> None:
    """Both tenants' processes run 30 % faster than the alone reference's (host-bound programs do, between
    processes): the lender back at 30 % of its own pace reads 39 % of the reference, never <= 33 there."""
    plan = sg.ElasticPlan(settle=1.0, lone=2.0, horizon=3.0, tail=1.5)
    release = 3.0
    first = release + 0.01
    lender = tenant([(0.0, 130.0), (first, 39.0)], 0.0, release + 4.0)  # ends horizon + 1 after the release
    newcomer = tenant([(0.0, 91.0), (release + 4.0, 130.0)], release, release + 4.0 + 1.5)
    r = sg.analyse_elastic(lender, newcomer, 100.0, nvml_at(100.0), plan)
    assert r["judged_on"] == "own pace"
    assert r["own_pace_vs_reference"] == [pytest.approx(130.0), pytest.approx(130.0)]
    assert r["lender_s"] == pytest.approx(0.0, abs=0.011) and r["lender_s_reference"] is None
    assert r["newcomer_s"] == pytest.approx(0.0, abs=0.011)
    rows = sg.elastic_rows("small", r)
    assert [x.ok for x in rows] == [True, True, True]
    assert "of own pace after 0 ms; never on the alone reference" in rows[2].figure


def test_elastic_without_a_newcomer_tail_is_judged_on_the_reference() -> None:
    lender = tenant([(0.0, 130.0), (3.01, 39.0)], 0.0, 7.0)
    newcomer = tenant([(0.0, 91.0)], 3.0, 6.5)  # ends before the lender: no pace of its own alone
    r = sg.analyse_elastic(lender, newcomer, 100.0, nvml_at(100.0), PLAN)
    assert r["judged_on"] == "alone reference" and r["lender_s"] is None
    assert "of alone reference after never" in sg.elastic_rows("small", r)[2].figure


def test_elastic_newcomer_without_work() -> None:
    lender = tenant([(0.0, 100.0)], 0.0, 7.0)
    newcomer = {**tenant([(0.0, 0.0)], 3.0, 6.5)}
    r = sg.analyse_elastic(lender, newcomer, 100.0, nvml_at(100.0), PLAN)
    assert "arrival_failed" in r and [x.ok for x in sg.elastic_rows("mm", r)] == [True, False]
    assert [x.scenario for x in sg.rows_of(["mm"], {}, {"elastic: mm": r}, {"elastic"})] == \
        ["elastic: 30 % alone", "elastic: arrival"]


# -- plan, estimate, table --------------------------------------------------------------------------------------
def test_plan_packs_caps_while_they_fit_and_runs_shared_scenarios_first() -> None:
    shapes = list(sg.SHAPES)
    steps = sg.plan(shapes, set(sg.SCENARIOS))
    assert [s.scenario for s in steps[:15]] == ["pair"] * 5 + ["three"] * 5 + ["elastic"] * 5
    caps = [(s.cap, len(s.shapes)) for s in steps[15:]]
    assert caps == [(20, 5), (30, 3), (30, 2), (50, 2), (50, 2), (50, 1)] + [(70, 1)] * 5
    assert len(sg.plan(shapes, {"caps"}, pack=False)) == 20
    assert [s.scenario for s in sg.plan(["mm"], {"usage"})] == ["pair", "three"]  # usage is read in those runs


def test_default_run_fits_in_eight_minutes_and_scales_with_seconds() -> None:
    steps = sg.plan(list(sg.SHAPES), set(sg.SCENARIOS))
    default = sg.estimate_s(steps, sg.Windows(3.0), len(sg.SHAPES))
    assert default <= 8 * 60
    assert sg.estimate_s(steps, sg.Windows(6.0), 5) > default


def test_rows_and_table() -> None:
    cap = sg.analyse_cap(30, tenant([(0.0, 30.0)], 0.0, 4.2), 100.0, nvml_at(31.0), 1.0)
    results = {"caps 30: mm,small": {"mm": cap, "small": {"error": "Traceback...\nRuntimeError: child exited 1"}},
               "pair: mm": {"error": "Traceback\nTimeoutError: tenants not set up"}}
    alone = {"mm": {"rate": 5000.0, "unit": "matmul", "nvml": 99.0}, "small": {"error": "x\nboom"}}
    rows = sg.rows_of(["mm", "small"], alone, results, set(sg.SCENARIOS), caps=(30,))
    got = [(r.shape, r.scenario, r.verdict) for r in rows]
    assert got == [("mm", "alone, no shim", "-"), ("mm", "cap 30: share", "pass"), ("mm", "cap 30: NVML", "pass"),
                   ("mm", "pair", "FAIL"), ("small", "alone, no shim", "FAIL"), ("small", "caps 30", "FAIL")]
    assert rows[3].figure == "error: TimeoutError: tenants not set up"
    text = sg.table(rows).splitlines()
    assert text[0].split() == ["shape", "scenario", "figure", "goal", "result"]
    assert len(text) == 2 + len(rows) + 1 and text[-1] == "2 passed, 3 failed"


def test_a_failed_run_is_one_error_row_under_each_selected_scenario() -> None:
    results = {"pair: mm": {"error": "Traceback\nTimeoutError: tenants not set up"}}
    both = sg.rows_of(["mm"], {}, results, {"pair", "usage"})
    assert [r.scenario for r in both] == ["pair"]  # its usage rows would repeat the same error
    alone = sg.rows_of(["mm"], {}, results, {"usage"})
    assert [(r.scenario, r.ok) for r in alone] == [("usage (pair)", False)]


@pytest.mark.parametrize("name", list(sg.SHAPES))
def test_each_tenant_program_parses(name: str) -> None:
    code = sg.SHAPES[name].code
    ast.parse(code)
    assert "def step()" in code and "SYNCED" in code


@pytest.mark.parametrize("text, want", [("profile_interval_s=0.5", ("profile_interval_s", 0.5)),
                                        ("dispatcher=off", ("dispatcher", "off")), ("x=true", ("x", True))])
def test_parse_setting(text, want) -> None:
    assert sg.parse_setting(text) == want


def test_tenant_env_passes_every_answer_variable_with_host_paths() -> None:
    """The benchmark measures through the Allocate answers whatever they hold (a mechanism's own variables and
    mounts included): container paths become the mounts' host folders; the allocation id comes along."""
    from types import SimpleNamespace as NS

    from alnair_standins.workloads import tenant_env

    mem = NS(envs={"NVIDIA_VISIBLE_DEVICES": "GPU-1", "LD_PRELOAD": "/opt/alnair/lib/libalnair.so",
                   "ALNAIR_REGION": "/run/alnair/region", "ALNAIR_ALLOCATION_ID": "a1", "ALNAIR_MEMORY_LIMIT": "5",
                   "X_PIPE": "/run/alnair/mps/pipe", "X_PLAIN": "/run/alnairx"},
             mounts=[NS(container_path="/run/alnair", host_path="/ws/a1/run"),
                     NS(container_path="/opt/alnair/lib", host_path="/tmp/shim")])
    compute = NS(envs={"ALNAIR_COMPUTE_LIMIT": "30", "ALNAIR_MEMORY_LIMIT": "6"}, mounts=[])
    agent = NS(gpus=[NS(uuid="GPU-0", index=0), NS(uuid="GPU-1", index=1)])
    env = tenant_env({"mem": mem, "compute": compute}, agent, Path("/tmp/shim/libalnair.so"))
    assert env["ALNAIR_REGION"] == "/ws/a1/run/region" and env["X_PIPE"] == "/ws/a1/run/mps/pipe"
    assert env["X_PLAIN"] == "/run/alnairx"  # not under the mount: a path prefix is not a folder
    assert env["LD_PRELOAD"] == "/tmp/shim/libalnair.so" and env["CUDA_VISIBLE_DEVICES"] == "1"
    assert env["ALNAIR_ALLOCATION_ID"] == "a1" and env["ALNAIR_COMPUTE_LIMIT"] == "30"
    assert env["ALNAIR_MEMORY_LIMIT"] == "5"  # first answer wins, as kubelet merges them


def test_the_alone_reference_is_the_fastest_run_and_says_when_runs_disagree() -> None:
    runs = [{"rate": 460.0, "unit": "inference", "nvml": 14.0}, {"rate": 740.0, "unit": "inference", "nvml": 24.0},
            {"error": "Traceback\nRuntimeError: child exited 1"}]
    ref = sg.reference(runs)
    assert ref["rate"] == 740.0 and ref["nvml"] == 24.0 and ref["runs"] == [460.0, 740.0]
    assert ref["spread"] > sg.REF_SPREAD
    [row] = sg.alone_rows("infer", ref)
    assert "UNSTABLE" in row.figure and "460.0 / 740.0" in row.figure
    steady = sg.reference([{"rate": 100.0, "unit": "u", "nvml": 50.0}, {"rate": 104.0, "unit": "u", "nvml": 50.0}])
    assert "UNSTABLE" not in sg.alone_rows("mm", steady)[0].figure
    assert "error" in sg.reference([{"error": "x\nboom"}])
