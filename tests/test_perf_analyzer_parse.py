"""perf_analyzer CSV/profile parsing on recorded output.

Fixtures in tests/data were recorded on the 2-core dev machine with perf_analyzer 2.51.0 (tritonclient wheel)
against a real tritonserver 2.51.0 serving a toy decoupled Python model (first 0.1 s chunk at 40 ms, then one
every 60 ms, MAX_TOKENS=6 chunks), over gRPC streaming with count windows:
  pa_sample.csv              --request-rate-range 2:6:2 --request-distribution poisson --verbose-csv
  pa_sample_concurrency.csv  --concurrency-range 1:4:1
  pa_sample_profile.json     --profile-export-file of the rate run, payloads dropped by parse.slim_profile
Replace with a recording against the orpheus ensemble once the model repository serves it.
"""
import json
from pathlib import Path

import pytest

from perf.perf_analyzer.parse import attach_profile, first_response_latencies, markdown, parse_csv, plot, slim_profile

DATA = Path(__file__).parent / "data"


def test_request_rate_csv():
    rows = parse_csv(DATA / "pa_sample.csv")
    assert [r.load for r in rows] == [2.0, 4.0, 6.0] and {r.mode for r in rows} == {"request_rate"}
    r = rows[0]
    assert r.infer_per_s == pytest.approx(1.42202) and r.responses_per_s == pytest.approx(8.35436)
    assert r.latency_us == {50: 341452, 90: 341817, 95: 345286, 99: 346055}
    assert r.avg_latency_us == pytest.approx(334671)


def test_concurrency_csv_sorted_by_load():
    rows = parse_csv(DATA / "pa_sample_concurrency.csv")
    assert [r.load for r in rows] == [1, 2, 3, 4] and rows[0].mode == "concurrency"
    assert rows[3].responses_per_s == pytest.approx(70.7985) and rows[3].avg_latency_us is None


def test_csv_without_load_column(tmp_path):
    p = tmp_path / "bad.csv"
    p.write_text("Foo,Inferences/Second\n1,2\n")
    with pytest.raises(ValueError):
        parse_csv(p)


def test_first_response_from_profile():
    profile = json.loads((DATA / "pa_sample_profile.json").read_text())
    lats = first_response_latencies(profile)
    assert sorted(lats) == [2.0, 4.0, 6.0]
    every = [x for v in lats.values() for x in v]
    # the toy sends its first chunk 40 ms after the request; PA's CSV latency (~341 ms) is the last response
    assert len(every) > 100 and all(0.035 < x < 0.2 for x in every)
    rows = parse_csv(DATA / "pa_sample.csv")
    attach_profile(rows, profile)
    assert all(40 < r.first_response_ms[50] < 50 for r in rows)
    assert all(r.first_response_ms[50] <= r.first_response_ms[90] <= r.first_response_ms[99] for r in rows)
    md = markdown(rows)
    assert "first response p50 (ms)" in md and md.splitlines()[2].startswith("| 2 | 1.42 | 8.35 |")


def test_empty_first_response_skipped_and_slim():
    profile = {"version": "2.51.0", "experiments": [{"experiment": {"mode": "concurrency", "value": 1},
               "requests": [{"timestamp": 1_000_000_000, "request_inputs": {"TEXT": "x"},
                             "response_timestamps": [1_100_000_000, 1_300_000_000],
                             "response_outputs": [{}, {"AUDIO": [0, 0]}]}]}]}
    assert first_response_latencies(profile) == {1.0: [pytest.approx(0.3)]}
    slim = slim_profile(profile)
    assert slim["version"] == "2.51.0"
    assert slim["experiments"][0]["requests"] == [{"timestamp": 1_000_000_000,
                                                    "response_timestamps": [1_100_000_000, 1_300_000_000]}]


def test_plot_writes_png(tmp_path):
    rows = parse_csv(DATA / "pa_sample.csv")
    attach_profile(rows, json.loads((DATA / "pa_sample_profile.json").read_text()))
    plot(rows, tmp_path / "a.png")
    plot(parse_csv(DATA / "pa_sample_concurrency.csv"), tmp_path / "b.png")
    assert (tmp_path / "a.png").stat().st_size > 1000 and (tmp_path / "b.png").stat().st_size > 1000
