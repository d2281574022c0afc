"""bench/latency_gpu.py's analysis without torch or a GPU: the Poisson schedule, latencies and percentiles, the
references and their spread, the goals (p99, p50, the neighbour's, the flood's, the idle one's), per-process NVML
figures, the plan and its estimate, the table; and the stream tenant's own loop run against a stand-in for torch."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import sys
import time
import types
from pathlib import Path

import latency_gpu as lg
import pytest
import shares_gpu as sg

T = lg.Timing(seconds=2.0, settle=0.5, drain=1.0, gap=0.3)


def nvml_at(value: float):
    return lambda t0, t1: value


def neighbour(rate: float, start: float, end: float, dt: float = 0.01, unit: str = "matmul") -> dict:
    """A neighbour's output: `rate` units/s from start to end, a mark every dt."""
    n = round((end - start) / dt)
    return {"unit": unit, "born": start - 5, "set_up": start - 1, "start": start, "host_end": end, "end": end + 0.1,
            "marks": [[start + i * dt, rate * i * dt] for i in range(n + 1)]}


def stream_out(plan: dict, starts: list[float], service_ms: float, t: lg.Timing = T) -> dict:
    """What the stream tenant prints for `plan` when each request takes service_ms and requests queue (FIFO)."""
    phases = []
    for ph, start in zip(plan["phases"], starts, strict=True):
        done, free = [], start
        for off in ph["offsets"]:
            free = max(free, start + off) + service_ms / 1e3
            done.append(free)
        phases.append({"rate": ph["rate"], "start": start, "done": done, "stopped_at": None})
    return {"mode": "open", "born": starts[0] - 9, "set_up": starts[0] - 1, "start": starts[0],
            "host_end": phases[-1]["done"][-1], "phases": phases}


def plan_of(rates: tuple[float, ...], t: lg.Timing = T, seed: int = 1) -> dict:
    return {"mode": "open", "gap": t.gap, "drain_s": t.drain,
            "phases": [{"rate": r, "offsets": lg.poisson_offsets(r, t.settle + t.seconds, seed)} for r in rates]}


# -- the schedule ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rate", [200.0, 500.0, 37.5])
def test_poisson_schedule_is_fixed_by_its_seed_and_has_the_rate(rate: float) -> None:
    a, b = lg.poisson_offsets(rate, 100.0, 1), lg.poisson_offsets(rate, 100.0, 1)
    assert a == b and a != lg.poisson_offsets(rate, 100.0, 2)
    assert a == sorted(a) and 0 < a[0] and a[-1] < 100.0
    assert len(a) / 100.0 == pytest.approx(rate, rel=0.05)
    gaps = [y - x for x, y in zip(a, a[1:], strict=False)]
    cv = math.sqrt(sum((g - 1 / rate) ** 2 for g in gaps) / len(gaps)) * rate
    assert cv == pytest.approx(1.0, abs=0.06)  # exponential gaps: standard deviation = mean


def test_poisson_schedules_of_two_rates_differ_and_a_bad_rate_is_refused() -> None:
    assert lg.poisson_offsets(200, 1, 1)[:5] != lg.poisson_offsets(500, 1, 1)[:5]
    with pytest.raises(ValueError):
        lg.poisson_offsets(0, 1, 1)


# -- latencies and percentiles --------------------------------------------------------------------------------------
@pytest.mark.parametrize("offsets, done, settle, want, unserved", [
    ([0.1, 0.6, 0.7], [10.2, 10.601, 10.705], 0.5, [1.0, 5.0], 0),  # the first arrived in the settle
    ([0.6, 0.7, 0.8], [10.61], 0.5, [10.0], 2),  # the phase stopped: two never served
    ([0.1, 0.2], [10.1, 10.2], 0.5, [], 0),
])
def test_latency_is_from_scheduled_arrival_to_result(offsets, done, settle, want, unserved) -> None:
    lat, n = lg.phase_latencies(offsets, 10.0, done, settle)
    assert lat == pytest.approx(want) and n == unserved


@pytest.mark.parametrize("lat, unserved, p50, p99, mx", [
    (list(range(1, 101)), 0, 51, 99, 100),  # nearest rank on 100 samples (benchstats.pct)
    ([1.0] * 99 + [50.0], 0, 1.0, 1.0, 50.0),  # one slow request of 100 is the max, not the p99
    ([1.0] * 98 + [50.0, 60.0], 0, 1.0, 50.0, 60.0),
    ([1.0] * 97, 3, 1.0, None, None),  # 3 % never served: the p99 is unbounded
    ([1.0] * 999, 1, 1.0, 1.0, None),  # 0.1 %: the p99 holds, the max does not
])
def test_latency_stats(lat, unserved, p50, p99, mx) -> None:
    st = lg.latency_stats(lat, unserved)
    assert (st["p50"], st["p99"], st["max"]) == (p50, p99, mx)
    assert st["requests"] == len(lat) + unserved and st["completed"] == len(lat) and st["unserved"] == unserved


def test_latency_stats_without_requests_is_an_error() -> None:
    with pytest.raises(ValueError):
        lg.latency_stats([], 0)


@pytest.mark.parametrize("xs, want", [([1.0, 1.1], 0.1), ([1.1, 1.0], 0.1), ([2.0, 2.0], 0.0), ([1.0], None),
                                      ([1.0, None], None), ([], None)])
def test_spread(xs, want) -> None:
    got = lg.spread(xs)
    assert got == (None if want is None else pytest.approx(want))


def test_per_second_p99_is_by_arrival_second() -> None:
    offsets = [0.6, 0.7, 1.6, 1.7]
    done = [10 + 0.601, 10 + 0.702, 10 + 1.61, 10 + 1.701]  # 1, 2 ms; 10, 1 ms
    assert lg.per_second_p99(offsets, 10.0, done, T) == pytest.approx([2.0, 10.0], abs=1e-6)
    assert lg.per_second_p99(offsets, 10.0, done[:3], T)[1] is None  # an unserved request in the second


# -- per-process NVML ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("samples, want", [
    ([(1.0, 7, 30.0), (1.0, 8, 60.0)], "shares"),  # two pids in one period
    ([(0.2 * i, 7 + i % 2, 90.0) for i in range(6)], "draw"),  # one pid a period, both seen over six
    ([(0.2 * i, 7 + i % 2, 90.0) for i in range(5)], "unknown"),  # too few periods
    ([(0.2 * i, 7, 90.0) for i in range(10)], "unknown"),  # one process
    ([], "unknown"),
])
def test_attribution(samples, want) -> None:
    assert lg.attribution(samples) == want


@pytest.mark.parametrize("pid, t0, t1, want", [
    (7, 0.0, 1.0, (30.0 + 40.0) / 4),  # four periods in the window, two with pid 7
    (8, 0.0, 1.0, 90.0 / 4),
    (7, 0.5, 1.0, 40.0 / 2),
    (9, 0.0, 1.0, 0.0),  # listed nowhere: 0 over the periods that reported anyone
    (7, 5.0, 6.0, None),  # no period there
    (None, 0.0, 1.0, None),
])
def test_process_share(pid, t0, t1, want) -> None:
    samples = [(0.1, 7, 30.0), (0.3, 8, 90.0), (0.6, 7, 40.0), (0.8, 8, 0.0), (2.0, 7, 99.0)]
    got = lg.process_share(samples, pid, t0, t1)
    assert got == (None if want is None else pytest.approx(want))


@pytest.mark.parametrize("fetches, want", [
    ([], 0.0), ([(1000.0, 999_900_000)], 0.0),  # wall-clock microseconds
    ([(1000.0, 5_000_000), (1000.1, 5_050_000)], 995.0),  # another clock: the smallest ask - newest
])
def test_clock_offset(fetches, want) -> None:
    assert lg.clock_offset(fetches) == pytest.approx(want)


# -- scenarios analysed ----------------------------------------------------------------------------------------------
def test_stream_beside_a_neighbour_analysed_per_rate() -> None:
    plan = plan_of((200.0, 500.0))
    starts = [100.0, 100.0 + T.phase_s]
    out = stream_out(plan, starts, 0.5)
    nb = neighbour(1000.0, 99.9, 100.0 + 2 * T.phase_s + 1.0)
    proc = [(100.6 + 0.2 * i, 7 if i % 2 else 8, 50.0) for i in range(40)]
    r = lg.analyse_pair(out, plan, nb, T, nvml_at(80.0), proc, 7)
    assert list(r["phases"]) == ["200", "500"]
    p = r["phases"]["200"]
    assert p["completed"] == p["requests"] == sum(1 for o in plan["phases"][0]["offsets"] if o >= T.settle)
    assert p["p50"] >= 0.5 and p["max"] < 50  # 0.5 ms each, and the queue behind close arrivals
    assert p["window"] == pytest.approx([100.5, 102.5]) and p["device_nvml"] == 80.0
    assert p["neighbour"]["rate"] == pytest.approx(1000.0) and p["neighbour"]["window_s"] == pytest.approx(2.0)
    assert p["attribution"] == "draw" and p["process_nvml"] == pytest.approx(25.0)
    assert r["phases"]["500"]["p99"] > p["p99"]  # more queueing at 500/s


def test_a_neighbour_that_ended_early_has_no_figure_for_the_phase() -> None:
    plan = plan_of((200.0,))
    out = stream_out(plan, [100.0], 0.5)
    r = lg.analyse_pair(out, plan, neighbour(1000.0, 99.9, 101.2), T, nvml_at(80.0))
    assert r["phases"]["200"]["neighbour"]["rate"] is None  # 0.7 s of overlap
    assert r["phases"]["200"]["process_nvml"] is None and r["phases"]["200"]["attribution"] is None


def stats(p50: float | None, p99: float | None, nvml: float | None = 5.0, mx: float | None = None) -> dict:
    return {"p50": p50, "p99": p99, "max": mx if mx is not None else p99, "device_nvml": nvml, "requests": 100,
            "unserved": 0}


@pytest.mark.parametrize("before, after, p99, unstable, spread", [
    (stats(0.5, 1.0), stats(0.56, 0.98), 0.98, False, 0.0204),  # issue 26's alone row
    (stats(0.5, 1.0), stats(0.5, 1.2), 1.0, True, 0.2),
    (stats(0.5, 1.0), None, 1.0, True, None),  # after: not measured
    (stats(0.5, 1.0), {"error": "boom"}, 1.0, True, None),
    (stats(0.5, None), stats(0.5, 1.0), 1.0, True, None),  # an unbounded run: not a stable reference
])
def test_stream_reference(before, after, p99, unstable, spread) -> None:
    ref = lg.stream_reference([before, after])
    assert ref["p99"] == p99 and ref["unstable"] is unstable
    assert ref["spread"] == (None if spread is None else pytest.approx(spread, abs=1e-4))
    row = lg.stream_alone_row("200", ref)
    assert row.ok is (False if unstable else None)


def test_stream_reference_errors() -> None:
    assert lg.stream_reference([{"error": "x\nboom"}, None])["error"] == "x\nboom"
    assert "unserved" in lg.stream_reference([stats(None, None)])["error"]


@pytest.mark.parametrize("p99, ref, limit, ok", [
    (1.05, 1.0, 1.25, True),  # 1.25 x alone is the tighter
    (1.3, 1.0, 1.25, False),
    (5.9, 5.0, 6.0, True),  # alone + 1 ms is the tighter
    (6.2, 5.0, 6.0, False),
    (None, 1.0, 1.25, False),  # unbounded
])
def test_p99_goal(p99, ref, limit, ok) -> None:
    g = lg.p99_goal(p99, ref)
    assert g.limit == pytest.approx(limit) and g.ok is ok


@pytest.mark.parametrize("p50, ref, ok", [(0.55, 0.5, True), (0.56, 0.5, False), (None, 0.5, False)])
def test_p50_goal(p50, ref, ok) -> None:
    assert lg.p50_goal(p50, ref).ok is ok


@pytest.mark.parametrize("pace, cap, share, elastic, want", [
    (5000.0, 70, 6.0, False, 0.9 * 5000 * 0.70),  # its cap is the tighter
    (5000.0, 70, 40.0, False, 0.9 * 5000 * 0.60),  # what the latency container used is
    (5000.0, 70, 6.0, True, 0.9 * 5000 * 0.94),  # elastic: only what the latency container left
    (5000.0, 70, 120.0, True, 0.0),
])
def test_neighbour_target(pace, cap, share, elastic, want) -> None:
    assert lg.neighbour_target(pace, cap, share, elastic) == pytest.approx(want)


def test_neighbour_goal_without_a_share_fails() -> None:
    assert not lg.neighbour_goal(4000.0, 5000.0, 70, None, False).ok
    assert lg.neighbour_goal(3200.0, 5000.0, 70, 6.0, False).ok
    assert not lg.neighbour_goal(None, 5000.0, 70, 6.0, False).ok


@pytest.mark.parametrize("phase, ref, want", [
    ({"attribution": "shares", "process_nvml": 7.5}, {"device_nvml": 5.0}, (7.5, "NVML per process")),
    ({"attribution": "draw", "process_nvml": 40.0}, {"device_nvml": 5.0}, (5.0, "its NVML alone")),
    ({"attribution": None, "process_nvml": None}, None, (None, "no share measured")),
])
def test_latency_share_prefers_per_process_shares_only(phase, ref, want) -> None:
    assert lg.latency_share(phase, ref) == want


def flood_out(rate: float, start: float, seconds: float, batch: int = 32) -> dict:
    n = int(rate * seconds)
    return {"mode": "flood", "born": start - 9, "set_up": start - 1, "start": start, "host_end": start + seconds,
            "done": [start + (i + 1) / rate for i in range(n)], "batch": batch}


@pytest.mark.parametrize("alone_nvml, beside_rate, ok", [
    (95.0, 100.0, True),  # 100 / 300 x 95 = 31.7 <= 33
    (95.0, 110.0, False),  # 34.8
    (25.0, 300.0, None),  # alone it uses 25 %: no test of the cap
])
def test_flood_judged_on_the_proxy_where_the_driver_draws(alone_nvml, beside_rate, ok) -> None:
    ref = lg.analyse_flood_alone(flood_out(300.0, 0.0, 4.7), T, nvml_at(alone_nvml))
    assert ref["rate"] == pytest.approx(300.0, rel=0.01)
    r = lg.analyse_flood(flood_out(beside_rate, 10.0, 4.7), neighbour(3000.0, 9.9, 15.0), T, nvml_at(100.0),
                         [(10.5 + 0.2 * i, 7 + i % 2, 99.0) for i in range(20)], 7)
    assert len(r["rate_per_s"]) == 4 and r["attribution"] == "draw"
    series, source = lg.flood_series(r, ref)
    assert source.startswith("proxy") and series == pytest.approx([beside_rate / ref["rate"] * alone_nvml] * 4,
                                                                   abs=0.5)
    [row] = lg.flood_rows("mm", r, ref)
    assert row.ok is ok and "proxy" in row.figure
    assert r["neighbour"]["rate"] == pytest.approx(3000.0)


def test_flood_uses_per_process_shares_where_the_driver_gives_them() -> None:
    r = {"rate_per_s": [100.0, 100.0], "process_nvml_per_s": [31.0, 35.0], "attribution": "shares", "cap": 30}
    series, source = lg.flood_series(r, {"rate": 300.0, "nvml": 95.0})
    assert series == [31.0, 35.0] and source == "NVML per process"
    assert [x.ok for x in lg.flood_rows("mm", r, {"rate": 300.0, "nvml": 95.0})] == [False]
    assert lg.flood_series({**r, "attribution": "draw"}, None)[0] == []
    assert [x.ok for x in lg.flood_rows("mm", {**r, "attribution": "draw"}, None)] == [False]


def test_flood_too_short_is_an_error() -> None:
    with pytest.raises(ValueError):
        lg.analyse_flood(flood_out(100.0, 0.0, 1.2), None, T, nvml_at(1.0))


@pytest.mark.parametrize("with_rate, ok", [(3430.0, True), (3400.0, True), (3350.0, False)])
def test_idle_latency_container_costs_at_most_two_percent(with_rate, ok) -> None:
    idle = {"mode": "idle", "born": 0.0, "set_up": 6.0, "start": 9.0, "host_end": 14.0}
    r = lg.analyse_idle(neighbour(3440.0, 1.0, 5.7), neighbour(with_rate, 9.0, 13.7), idle, T)
    assert r["ratio"] == pytest.approx(with_rate / 3440.0, abs=1e-4) and r["quiet_s"] == pytest.approx(3.5)
    [row] = lg.idle_rows("mm", r)
    assert row.ok is ok


# -- references from the record, the plan, the table -----------------------------------------------------------------
def test_references_from_before_and_after() -> None:
    before = {"stream": {"200": stats(0.5, 1.0), "500": stats(0.6, 1.5)},
              "neighbours": {"mm": {"rate": 5000.0, "unit": "matmul", "nvml": 99.0}, "train": {"error": "x\nboom"}},
              "flood": {"rate": 300.0, "nvml": 95.0}}
    after = {"stream": {"200": stats(0.52, 1.02), "500": stats(0.6, 2.0)},
             "neighbours": {"mm": {"rate": 4900.0, "unit": "matmul", "nvml": 99.0},
                            "train": {"rate": 40.0, "unit": "step", "nvml": 80.0}}}
    refs = lg.references({"before": before, "after": after})
    assert refs["stream"]["200"]["p99"] == 1.0 and not refs["stream"]["200"]["unstable"]
    assert refs["stream"]["500"]["unstable"]
    assert refs["neighbours"]["mm"]["rate"] == 5000.0 and refs["neighbours"]["mm"]["runs"] == [5000.0, 4900.0]
    assert refs["neighbours"]["train"]["rate"] == 40.0  # the run that measured it
    assert refs["flood"]["rate"] == 300.0


def test_references_when_a_whole_group_raised() -> None:
    refs = lg.references({"before": {"error": "Traceback\nTimeoutError: not set up"}})
    assert "TimeoutError" in refs["stream"]["*"]["error"] and "TimeoutError" in refs["flood"]["error"]
    rows = lg.rows_of(["200"], ["mm"], {"latency"}, {"alone": {"before": {"error": "Traceback\nTimeoutError: x"}}})
    assert [(r.shape, r.ok) for r in rows] == [("stream", False), ("mm", False)]
    assert rows[0].figure == "error: TimeoutError: x"


def test_plan_runs_the_alone_references_first_and_last() -> None:
    steps = lg.plan_steps(["mm", "train"], set(lg.SCENARIOS))
    assert steps[0] == "alone: before" and steps[-1] == "alone: after"
    assert steps[1:9] == [f"{s}: {n}" for n in ("mm", "train") for s in lg.PAIRS]
    assert steps[9:11] == ["flood: mm", "idle: mm"]
    assert lg.plan_steps(["mm"], {"idle"}) == ["idle: mm"]
    assert lg.plan_steps(["mm"], {"flood"}) == ["alone: before", "flood: mm"]  # the flood's alone reference


def test_default_run_fits_in_five_minutes_and_scales_with_seconds() -> None:
    steps = lg.plan_steps(list(lg.NEIGHBOURS), set(lg.SCENARIOS))
    default = lg.estimate_s(steps, len(lg.RATES), len(lg.NEIGHBOURS), lg.Timing())
    assert 180 <= default <= 5 * 60
    assert lg.estimate_s(steps, 2, 2, lg.Timing(seconds=8.0)) > default
    assert lg.estimate_s(lg.plan_steps(["mm"], {"idle"}), 2, 1, lg.Timing()) < 60


def record_of() -> dict:
    """A whole run's record: alone before/after, latency scenarios beside mm, a flood, an idle run, a failure."""
    plan = plan_of((200.0,))
    alone_out = stream_out(plan, [100.0], 0.5)
    alone = lg.analyse_stream(alone_out, plan, T, nvml_at(6.0))
    record: dict = {"alone": {"before": {"stream": alone, "neighbours": {"mm": lg.analyse_neighbour_alone(
        neighbour(5000.0, 0.0, 2.7), T, nvml_at(99.0))}, "flood": {"rate": 300.0, "nvml": 95.0, "batch": 32}},
        "after": {"stream": alone, "neighbours": {"mm": lg.analyse_neighbour_alone(
            neighbour(4950.0, 0.0, 2.7), T, nvml_at(99.0))}}}, "scenarios": {}}
    nb_end = 200.0 + T.phase_s + 1.0
    good = lg.analyse_pair(stream_out(plan, [200.0], 0.52), plan, neighbour(3400.0, 199.9, nb_end), T, nvml_at(99))
    slow = lg.analyse_pair(stream_out(plan, [200.0], 3.0), plan, neighbour(2000.0, 199.9, nb_end), T, nvml_at(99))
    record["scenarios"] = {
        "no-alnair: mm": slow, "turns: mm": {"error": "Traceback\nRuntimeError: child exited 1"},
        "latency: mm": good, "latency-elastic: mm": slow,
        "flood: mm": {"cap": 30, "batch": 32, "rate_per_s": [100.0, 101.0], "process_nvml_per_s": [None, None],
                      "attribution": "draw"},
        "idle: mm": {"without": 3440.0, "with": 3435.0, "unit": "matmul", "ratio": 3435 / 3440, "quiet_s": 3.1}}
    return record


def test_rows_and_table_of_a_whole_run() -> None:
    record = record_of()
    rows = lg.rows_of(["200"], ["mm"], set(lg.SCENARIOS), record)
    got = [(r.shape, r.scenario, r.verdict) for r in rows]
    lat, el = lg.SPECS["latency"].label, lg.SPECS["latency-elastic"].label
    assert got == [
        ("stream", "alone, no shim @200/s", "-"), ("mm", "alone, no shim", "-"),
        ("mm", f"{lg.SPECS['no-alnair'].label} @200/s", "-"), ("mm", lg.SPECS["turns"].label, "FAIL"),
        ("mm", f"{lat} @200/s: p99", "pass"), ("mm", f"{lat} @200/s: p50", "pass"),
        ("mm", f"{lat} @200/s: neighbour", "pass"),  # 3400 >= 0.9 x 5000 x 0.70 = 3150
        ("mm", f"{el} @200/s: p99", "FAIL"), ("mm", f"{el} @200/s: p50", "FAIL"),
        ("mm", f"{el} @200/s: neighbour", "FAIL"),  # 2000 < 0.9 x 5000 x 0.94
        ("mm", "flood: latency 30 GPU time per 1 s", "pass"), ("mm", "idle latency 30 beside strict 70", "pass")]
    assert "its NVML alone" in rows[6].figure and ">= 3150.0" in rows[6].goal
    assert rows[3].figure == "error: RuntimeError: child exited 1"
    text = sg.table(rows).splitlines()
    assert text[0].split() == ["shape", "scenario", "figure", "goal", "result"]
    assert text[-1] == "5 passed, 4 failed"
    json.dumps(record, allow_nan=False)  # the record is JSON as it is (no infinities)
    assert lg.unmeasured(record) == ["turns: mm"]


def test_rows_of_one_step_say_its_error() -> None:
    [row] = lg.step_rows("flood: mm", {"error": "Traceback\nTimeoutError: tenants not set up"}, {})
    assert (row.scenario, row.ok, row.figure) == ("flood", False, "error: TimeoutError: tenants not set up")


def test_an_unbounded_p99_reads_unbounded_and_fails() -> None:
    refs = {"stream": {"200": {"p50": 0.5, "p99": 1.0}}, "neighbours": {"mm": {"rate": 5000.0}}}
    ph = {**stats(0.6, None), "unserved": 30, "requests": 400, "neighbour": {"rate": 3500.0, "unit": "matmul"},
          "attribution": None, "process_nvml": None}
    rows = lg.pair_rows("mm", "latency", {"phases": {"200": ph}}, refs)
    assert rows[0].figure.startswith("unbounded") and "30 of 400 unserved" in rows[0].figure and not rows[0].ok
    assert not rows[2].ok and "no share" in rows[2].figure  # no share measured: the neighbour's goal has no target


# -- the tenant programs ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("code", [lg.STREAM_CODE] + [sg.SHAPES[n].code for n in lg.NEIGHBOURS])
def test_tenant_programs_compile(code: str) -> None:
    compile(code, "t", "exec")


class _Fake:
    """Stands for a tensor and a model: indexing, .float(), .cpu(), calls, all return itself."""

    def __getitem__(self, _: object) -> "_Fake":
        return self

    def __call__(self, *_: object) -> "_Fake":
        return self

    def float(self) -> "_Fake":
        return self

    def cpu(self) -> "_Fake":
        return self


def run_tail(tmp_path: Path, plan: dict, service_s: float, capsys, seconds: float = 0.3) -> dict:
    """The stream tenant's loop (STREAM_TAIL) with a stand-in for torch and a request that takes service_s."""
    barrier, ready = tmp_path / "go", tmp_path / "ready"
    barrier.write_text("go")
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    torch = types.SimpleNamespace(randn=lambda *a, **k: _Fake(), no_grad=contextlib.nullcontext, bfloat16=None,
                                  __version__="stand-in",
                                  cuda=types.SimpleNamespace(synchronize=lambda: None, get_device_name=lambda: "none"))
    fake_sys = types.SimpleNamespace(argv=["t", str(seconds), str(barrier), str(ready), str(tmp_path / "plan.json")],
                                     exit=sys.exit)
    ns = {"os": os, "sys": fake_sys, "time": time, "json": json, "torch": torch, "born": time.time(),
          "seconds": seconds, "barrier": str(barrier), "ready": str(ready), "m": _Fake(),
          "step": lambda: time.sleep(service_s)}
    exec(compile(lg.STREAM_TAIL, "tail", "exec"), ns)  # the benchmark's own tenant code
    assert ready.exists()
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_the_stream_tenant_serves_its_schedule_open_loop(tmp_path: Path, capsys) -> None:
    t = lg.Timing(seconds=1.0, settle=0.2, drain=1.0, gap=0.05)
    plan = plan_of((50.0,), t)
    out = run_tail(tmp_path, plan, 0.001, capsys)
    [ph] = out["phases"]
    offsets = plan["phases"][0]["offsets"]
    assert ph["stopped_at"] is None and len(ph["done"]) == len(offsets)
    # never before its arrival: an open loop waits for the schedule, not for the previous request only
    assert all(d >= ph["start"] + o for d, o in zip(ph["done"], offsets, strict=True))
    r = lg.analyse_stream(out, plan, t, nvml_at(1.0))
    assert r["50"]["unserved"] == 0 and r["50"]["p50"] >= 1.0


def test_a_stream_tenant_far_behind_its_schedule_stops_the_phase(tmp_path: Path, capsys) -> None:
    t = lg.Timing(seconds=1.0, settle=0.0, drain=0.1, gap=0.0)
    plan = plan_of((500.0, 20.0), t)
    out = run_tail(tmp_path, plan, 0.01, capsys)  # 100 requests/s served against 500 arriving
    first, second = out["phases"]
    assert first["stopped_at"] is not None and len(first["done"]) == first["stopped_at"] < 100
    assert second["start"] >= first["done"][-1]  # the next phase starts after the last one's requests
    r = lg.analyse_stream(out, plan, t, nvml_at(1.0))
    assert r["500"]["unserved"] > 0 and r["500"]["p99"] is None and r["500"]["max"] is None


def test_the_flood_and_idle_tenants(tmp_path: Path, capsys) -> None:
    out = run_tail(tmp_path, {"mode": "flood", "batch": 4}, 0.0, capsys, seconds=0.1)
    assert out["batch"] == 4 and len(out["done"]) > 10 and out["host_end"] >= out["start"] + 0.1
    (tmp_path / "ready").unlink()
    out = run_tail(tmp_path, {"mode": "idle"}, 0.0, capsys, seconds=0.05)
    assert out["host_end"] - out["start"] >= 0.05 and "done" not in out


# -- the command line ------------------------------------------------------------------------------------------------
def test_help_and_bad_arguments(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        lg.main(["--help"])
    assert e.value.code == 0 and "--rates" in capsys.readouterr().out
    for bad in (["--only", "caps"], ["--neighbours", "infer"], ["--rates", "0,200"], ["--seconds", "0.5"],
                ["--neighbour-env", "NOEQUALS"], ["--neighbour-env", "=1"], ["--neighbour-env", "A-B=1"]):
        with pytest.raises(SystemExit) as e:
            lg.main(bad)
        assert e.value.code == 2


# -- the whole run, against stand-ins for the tenants, the node and NVML ----------------------------------------------
async def fake_run_py(code: str, env: dict[str, str], *argv: str, timeout: float = 600) -> dict:
    """A tenant: set up at once, wait at its barrier, then print what the real one would for an ideal GPU (each
    request 0.5 ms after its arrival, neighbours at 1000 units/s), its times on the wall clock now."""
    seconds, go, ready = float(argv[0]), Path(argv[1]), Path(argv[2])
    Path(f"{ready}.pid").write_text(str(os.getpid()))
    ready.write_text("x")
    while not go.exists():
        await asyncio.sleep(0.002)
    if go.read_text() != "go":
        raise RuntimeError("child exited 3: ")
    now = time.time()
    base = {"born": now - 5, "set_up": now - 1, "torch": "stand-in", "device": "none"}
    if code != lg.STREAM_CODE:
        marks = [[now + i * 0.01, 10.0 * i] for i in range(int(seconds * 100) + 1)]
        return {**base, "unit": "u", "start": now, "host_end": now + seconds, "end": now + seconds, "marks": marks}
    plan = json.loads(Path(argv[3]).read_text())
    base["mode"] = plan["mode"]
    if plan["mode"] == "flood":
        done = [now + (i + 1) / 300 for i in range(int(300 * seconds))]
        return {**base, "start": now, "host_end": now + seconds, "done": done, "batch": plan["batch"]}
    if plan["mode"] == "idle":
        return {**base, "start": now, "host_end": now + seconds}
    phases, t = [], now
    for ph in plan["phases"]:
        start = t + plan["gap"]
        done = [start + o + 0.0005 for o in ph["offsets"]]
        phases.append({"rate": ph["rate"], "start": start, "done": done, "stopped_at": None})
        t = done[-1]
    return {**base, "start": phases[0]["start"], "host_end": t, "phases": phases}


class FakeNode:
    admitted: list[tuple[str, int, str | None]] = []

    def __init__(self, policy: str) -> None:
        self.policy, self.n = policy, 0

    async def __aenter__(self) -> "FakeNode":
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass

    async def admit(self, compute: int, memory_gib: int = 16, policy: str | None = None) -> dict[str, str]:
        self.n += 1
        FakeNode.admitted.append((self.policy, compute, policy))
        return {**os.environ, "CUDA_VISIBLE_DEVICES": "0", "ALNAIR_ALLOCATION_ID": f"a{self.n}"}


@contextlib.contextmanager
def fake_samplers(index: int):
    yield lg.Samplers(types.SimpleNamespace(mean=lambda t0, t1: 50.0), None, "stand-in")  # type: ignore[arg-type]


async def test_a_whole_run_against_stand_ins(tmp_path: Path, monkeypatch) -> None:
    seen: list[tuple[bool, str | None]] = []  # (a stream tenant, its X_NB) for every tenant started

    async def recording_run_py(code: str, env: dict[str, str], *argv: str, timeout: float = 600) -> dict:
        seen.append((lg.STREAM_TAIL in code, env.get("X_NB")))
        return await fake_run_py(code, env, *argv, timeout=timeout)

    monkeypatch.setattr(lg, "run_py", recording_run_py)
    monkeypatch.setattr(sg, "run_py", recording_run_py)  # the neighbours: shares_gpu's Tenants.start
    monkeypatch.setattr(lg, "samplers", fake_samplers)
    monkeypatch.setattr(lg, "IDLE_QUIET_S", 0.05)
    monkeypatch.setattr(lg, "gpu_record", lambda i: {"index": i, "name": "stand-in"})
    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(nvmlInit=lambda: None, nvmlShutdown=lambda: None))
    monkeypatch.setattr(lg.Bench, "node", lambda self, policy: FakeNode(policy))
    FakeNode.admitted = []
    bench = lg.Bench(Path("/nonexistent/libalnair.so"), lg.Timing(seconds=1.0, settle=0.2, drain=0.5, gap=0.1),
                     rates=(200.0, 500.0), neighbours=("mm", "train"), neighbour_env={"X_NB": "1"})
    steps = lg.plan_steps(bench.neighbours, set(bench.only))
    record: dict = {}
    rows = await lg.run(bench, steps, record, tmp_path / "latency.json")
    # --neighbour-env reaches the neighbour beside a stream, once per such scenario and neighbour, and no one else
    pairs = len([s for s in steps if s.split(": ")[0] in lg.PAIRS])
    assert seen.count((False, "1")) == pairs and not any(stream and x for stream, x in seen)
    assert len([x for x in seen if x[1] is None]) > 0  # the alone references, the flood, the idle scenario
    assert lg.unmeasured(record) == [] and "cut_short_at" not in record
    saved = json.loads((tmp_path / "latency.json").read_text())["results"]
    assert [r["scenario"] for r in saved["table"]] == [r.scenario for r in rows]
    assert set(saved["scenarios"]) == set(steps) - {"alone: before", "alone: after"}
    assert set(saved["alone"]) == {"before", "after"} and saved["alone"]["before"]["flood"]["batch"] == lg.FLOOD_BATCH
    verdicts = {(r.shape, r.scenario): r.verdict for r in rows}
    assert verdicts[("stream", "alone, no shim @500/s")] == "-"  # before and after agree
    assert verdicts[("train", f"{lg.SPECS['latency'].label} @200/s: p99")] == "pass"
    assert verdicts[("mm", "idle latency 30 beside strict 70")] == "pass"
    # the stand-in's flood does beside mm what it does alone (50 % of the GPU): over its cap, and asking for more
    assert verdicts[("mm", "flood: latency 30 GPU time per 1 s")] == "FAIL"
    assert [r.scenario for r in rows if r.verdict == "FAIL"] == ["flood: latency 30 GPU time per 1 s"]
    # the policies each container was admitted with
    assert ("strict", 30, "latency") in FakeNode.admitted and ("elastic", 70, "elastic") in FakeNode.admitted
    assert ("strict", 30, "strict") in FakeNode.admitted


async def test_sigterm_stops_the_step_under_way_and_keeps_what_was_measured(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(lg, "gpu_record", lambda i: {"index": i, "name": "stand-in"})
    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(nvmlInit=lambda: None, nvmlShutdown=lambda: None))

    async def step(self, key: str) -> dict:
        if key == "turns: mm":
            os.kill(os.getpid(), signal.SIGTERM)  # what `timeout` sends
            await asyncio.sleep(10)
        return {"error": "Traceback\nRuntimeError: stand-in"}

    monkeypatch.setattr(lg.Bench, "step", step)
    bench = lg.Bench(Path("/nonexistent"), lg.Timing(), neighbours=("mm",))
    record: dict = {}
    await asyncio.wait_for(lg.run(bench, lg.plan_steps(["mm"], {"no-alnair", "turns"}), record, tmp_path / "r.json"),
                           5)
    assert record["cut_short_at"] == "turns: mm" and list(record["scenarios"]) == ["no-alnair: mm"]
    assert json.loads((tmp_path / "r.json").read_text())["results"]["cut_short_at"] == "turns: mm"
