"""bench/shim_trace.py: a trace build's records summed over a benchmark's phase."""

import json
from pathlib import Path

import shim_trace

TRACE = """\
W 1000 2000 48000000 0 0
f 1500 3000000 2000000 256 0
f 1600 1000000 1500000 256 0
d 1700 400000 0 0 0
g 1800 1 2 3 0
i 1900 50000 0 0 0
s 2000 5 6 7 0
w 2100 70000 9 0 0
h 2200 80000 1 0 0
W 5000 4000 30000000 0 0
W 9000 1 2 3 4
garbage line
"""


def test_a_phase_sums_only_its_own_records(tmp_path: Path) -> None:
    path = tmp_path / "t.trace"
    path.write_text(TRACE)
    recs = shim_trace.read(path)
    assert len(recs) == 11  # the garbage line is skipped
    s = shim_trace.summarise(recs, 1000, 9000)  # the last W is past the span
    assert s["windows"] == {"n": 2, "late_us_median": 4.0, "left_ms_median": 48.0}
    assert s["trueups"] == {"n": 2, "over_ms": 1.0, "under_ms": 0.5}  # ran 1 ms over one charge, 0.5 under the other
    assert s["drains"] == {"n": 1, "ms": 0.4}
    assert s["refused"] == 1 and s["samples"] == 1
    assert s["inflight"] == {"n": 1, "ms": 0.05}
    assert s["sample_waits"] == {"n": 1, "ms": 0.07}
    assert s["holds"] == {"n": 1, "ms": 0.08}


def test_no_trace_reads_as_nothing(tmp_path: Path) -> None:
    assert shim_trace.read(tmp_path / "absent.trace") == []
    s = shim_trace.summarise([], 0, 10**9)
    assert s["windows"]["n"] == 0 and s["windows"]["late_us_median"] is None and s["trueups"]["over_ms"] == 0


def test_excess_is_placed_by_its_windows_phase(tmp_path: Path) -> None:
    ms = 1_000_000
    recs = [("W", 100 * ms, 0, 70 * ms, 0, 0),  # a window starting at 100 ms
            ("f", 101 * ms, 3 * ms, 1 * ms, 8, 0),  # 1 ms into it: 2 ms over
            ("f", 112 * ms, 2 * ms, 2 * ms, 8, 0),  # 12 ms in: exact
            ("f", 150 * ms, 1 * ms, 2 * ms, 8, 0),  # 50 ms in: 1 ms under
            ("W", 205 * ms, 5 * ms, 65 * ms, 0, 0),  # the next window began at 200 ms; its thread went on 5 ms late
            ("f", 203 * ms, 2 * ms, 1 * ms, 8, 0),  # 3 ms in: 1 ms over
            ("f", 450 * ms, 2 * ms, 1 * ms, 8, 0),  # 250 ms after the last start: a lease
            ("H", 204 * ms, 4 * ms, 4 * ms, 0, 0),  # a head-guard build left 4 ms unowed
            ("f", 50 * ms, 9 * ms, 1 * ms, 8, 0)]  # before any window: not placed
    r = shim_trace.excess_by_phase(sorted(recs, key=lambda x: x[1]), bucket_ms=5)
    assert r["windows"] == 2
    assert r["buckets"] == {"0": {"excess_ms": 3.0, "n": 2}, "10": {"excess_ms": 0.0, "n": 1},
                            "50": {"excess_ms": -1.0, "n": 1}, "lease": {"excess_ms": 1.0, "n": 1}}
    assert r["total_ms"] == 3.0 and r["head_ms"] == 3.0 and r["guarded_ms"] == 4.0


def test_the_command_line_prints_a_table_per_trace(tmp_path: Path, capsys) -> None:
    path = tmp_path / "t.trace"
    path.write_text(TRACE)
    out = tmp_path / "x.json"
    assert shim_trace.main([str(path), str(tmp_path / "none.trace"), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "3 windows; true-ups over their charge 0.5 ms" in text and "none.trace: no records" in text
    assert list(json.loads(out.read_text())) == [str(path)]
