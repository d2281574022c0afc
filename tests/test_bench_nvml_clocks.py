"""bench/nvml_clocks.py's offline half: the clock samples read against bench/turn_trace.py's runs."""

from __future__ import annotations

import json
from pathlib import Path

import benchstats
import nvml_clocks

MS = 1_000_000
PERIOD, LENGTH, EPOCH = 100 * MS, 30 * MS, 5 * MS


def clock_at(t: int) -> int:
    """A GPU that idles down between windows: 600 MHz at a window's start, up 50 MHz a ms to 1980 in the window,
    down to 600 again while it is off."""
    ph = (t - EPOCH) % PERIOD
    return min(1980, 600 + 50 * (ph // MS)) if ph < LENGTH else 600


def write_clocks(path: Path, t0: int, t1: int, every: int = 5 * MS) -> None:
    lines = [json.dumps({"mono_ns": t, "wall": 0.0, "sm_mhz": clock_at(t), "mem_mhz": 2619, "pstate": 0,
                         "power_w": 100.0, "util": 50}) for t in range(t0, t1, every)]
    lines.insert(3, json.dumps({"mono_ns": t0 + 1, "error": "Unknown Error"}))  # a failed read: no clocks in it
    path.write_text("\n".join(lines) + '\n{"mono_ns": 12')  # the sampler's last line cut short


def turns(path: Path, t0: int, t1: int) -> None:
    raw = {"t_start": t0, "t_end": t1, "epoch": EPOCH, "offset": 0}
    # written as turn_trace writes it (benchstats.write_json wraps it under "results"): the first device run's fold
    # read the unwrapped form and printed nothing
    benchstats.write_json(path, {"runs": [
        {"shape": "small", "caps": [0], "raw": [{**raw, "period": 50 * MS, "length": 50 * MS}]},
        {"shape": "small", "caps": [30], "raw": [{**raw, "period": PERIOD, "length": LENGTH}]},
        {"shape": "small", "caps": [30], "raw": [{"epoch": EPOCH, "offset": 0, "period": PERIOD, "length": LENGTH}]},
    ]})


def test_a_capped_loops_clock_is_folded_by_phase_of_its_period(tmp_path: Path) -> None:
    t0, t1 = EPOCH, EPOCH + 20 * PERIOD
    write_clocks(tmp_path / "c.jsonl", t0, t1)
    turns(tmp_path / "t.json", t0, t1)
    alone, capped, old = nvml_clocks.fold_runs(tmp_path / "c.jsonl", tmp_path / "t.json")
    assert alone["cap"] == 0 and "sm_mhz_by_phase" not in alone  # no window: the loop's mean alone
    assert alone["samples"] == 400 and alone["pstates"] == [0]
    assert capped["in_window_bins"] == [True] * 3 + [False] * 7
    assert capped["sm_mhz_by_phase"][3:] == [600.0] * 7  # off: idled down
    assert capped["window_head_mhz"] < 800 < 1200 < capped["window_tail_mhz"]
    assert old == {"shape": "small", "cap": 30, "error": old["error"]}  # a turn_trace without t_start: said so


def test_spans_take_only_their_own_samples(tmp_path: Path) -> None:
    write_clocks(tmp_path / "c.jsonl", EPOCH, EPOCH + PERIOD)
    off, empty = nvml_clocks.summarise(tmp_path / "c.jsonl", [("off", EPOCH + LENGTH, EPOCH + PERIOD),
                                                              ("none", 0, EPOCH)])
    assert off["samples"] == 14 and off["sm_mhz_min"] == off["sm_mhz_max"] == 600
    assert empty == {"span": "none", "samples": 0}
