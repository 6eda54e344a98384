"""Pure helpers of perf/run_cpu_suite.py on hand-made inputs with known answers."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "perf"))

import run_cpu_suite as suite  # noqa: E402


def test_overlap_clips_intervals_to_the_window():
    spans = [(0.0, 1.0), (2.0, 3.0), (4.5, 6.0), (9.0, 10.0)]
    assert suite.overlap(spans, 0.5, 5.0) == pytest.approx(0.5 + 1.0 + 0.5)
    assert suite.overlap(spans, 6.0, 9.0) == 0.0


def test_ablation_rate_is_the_highest_rate_meeting_ttfa_with_chunks_mostly_on_time():
    res = {0.1: {"ttfa_p90_s": 0.3, "on_time_chunk_pct": 95.0}, 0.4: {"ttfa_p90_s": 0.9, "on_time_chunk_pct": 90.0},
           0.6: {"ttfa_p90_s": 0.9, "on_time_chunk_pct": 30.0},  # past the throughput knee: streams fall behind
           0.8: {"ttfa_p90_s": 1.4, "on_time_chunk_pct": 99.0}, 1.6: {"ttfa_p90_s": None}}
    assert suite.choose_ablation_rate(res, 1.0) == 0.4
    assert suite.choose_ablation_rate(res, 0.1) == 0.1  # none meets it: the lowest rate


def _tl(chunks: list[tuple[float, float]]) -> dict:
    return suite.StreamTimeline(send_time=0.0, chunks=chunks).to_dict()


def test_stall_positions_bins_the_first_late_chunk():
    ok = _tl([(1.0, 0.085), (1.05, 0.085), (1.1, 0.085)])
    late_at_1 = _tl([(1.0, 0.085), (1.2, 0.085)])  # 85 ms buffered, 200 ms passed
    late_at_3 = _tl([(1.0, 0.5), (1.1, 0.085), (1.2, 0.085), (1.9, 0.085)])  # 0.67 s buffered, 0.9 s passed
    text = suite.stall_positions({0.5: [ok, late_at_1], 1.0: [late_at_3]})
    assert "2 stalled" in text and "chunk 1: 1" in text and "chunk 2-3: 1" in text
    assert suite.stall_positions({0.5: [ok]}) == "No stream stalled."


def test_ablation_table_has_one_row_per_policy():
    s = {"count": 10, "errors": 0, "ttfa_p50_s": 0.2, "ttfa_p90_s": 0.5, "ttfa_p99_s": 0.9,
         "on_time_chunk_pct": 97.5, "stall_free_pct": 80.0, "x_real_time": 1.5}
    table = suite.ablation_table({"online": s, "fcfs": dict(s, ttfa_p50_s=None)})
    lines = table.splitlines()
    assert len(lines) == 4 and lines[2].startswith("| online | 10 | 0 | 200 | 500 | 900 | 97.5 | 80.0 | 1.50 |")
    assert "| fcfs | 10 | 0 | - |" in lines[3]


def test_ablation_table_shows_stall_free_for_players_with_a_startup_buffer():
    s = {"count": 10, "errors": 0, "ttfa_p50_s": 0.2, "ttfa_p90_s": 0.5, "ttfa_p99_s": 0.9,
         "on_time_chunk_pct": 97.5, "stall_free_pct": 80.0, "x_real_time": 1.5,
         "stall_free_pct_after": {0.5: 90.0, 1.0: 100.0}}
    lines = suite.ablation_table({"online": s}).splitlines()
    assert "| stall-free % | stall-free after 0.5 s | stall-free after 1 s | x real time |" in lines[0]
    assert lines[1].count("---") == 11 and lines[2].endswith("| 80.0 | 90.0 | 100.0 | 1.50 |")


def test_ablation_runs_at_the_knee_and_the_next_rate_above():
    res = {0.4: {}, 0.8: {}, 1.6: {}, 2.4: {}}
    assert suite.ablation_rates(res, 0.8) == [0.8, 1.6]
    assert suite.ablation_rates(res, 2.4) == [2.4]  # nothing above the last swept rate


def test_ablation_table_shows_each_seeds_stall_free_share():
    s = {"count": 10, "errors": 0, "ttfa_p50_s": 0.2, "ttfa_p90_s": 0.5, "ttfa_p99_s": 0.9,
         "on_time_chunk_pct": 97.5, "stall_free_pct": 80.0, "x_real_time": 1.5}
    table = suite.ablation_table({"online @ 0.8 req/s": s},
                                 {"online @ 0.8 req/s": [dict(s, stall_free_pct=70.0), dict(s, stall_free_pct=90.0)]})
    lines = table.splitlines()
    assert lines[0].endswith("stall-free % per seed |") and lines[2].endswith("| 1.50 | 70.0, 90.0 |")


def test_goodput_sweep_interleaves_targets_by_rate_and_drops_one_after_two_misses(monkeypatch):
    import goodput as gp

    calls = []

    def fake_run_load(url, model, prompts, rate, duration, **kw):
        calls.append((model, rate))
        ttfa = 0.2 if model == "engine" or rate < 1.0 else 3.0  # naive misses from 1 req/s on
        return [suite.StreamTimeline(send_time=0.0, chunks=[(ttfa, 0.1), (ttfa + 0.05, 0.1)], end_time=ttfa + 0.05)]

    monkeypatch.setattr(gp, "run_load", fake_run_load)
    targets = [gp.Target("engine", "e:1", "engine"), gp.Target("naive", "n:1", "naive")]
    results, raw = gp.sweep(targets, [2.0, 0.5, 1.0, 4.0], ["hi"], 1.0, seed=0, burstiness=1.0, opts=None,
                            ttfa_p90=1.0, stall_free=0.0, stop_after_failures=2, request_timeout=5.0,
                            log=lambda m: None)
    assert calls == [("engine", 0.5), ("naive", 0.5), ("engine", 1.0), ("naive", 1.0), ("engine", 2.0),
                     ("naive", 2.0), ("engine", 4.0)]
    assert sorted(results["engine"]) == [0.5, 1.0, 2.0, 4.0] and sorted(results["naive"]) == [0.5, 1.0, 2.0]
    assert results["naive"][1.0]["ttfa_p90_s"] == pytest.approx(3.0) and len(raw["naive"][2.0]) == 1
