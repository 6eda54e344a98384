"""perf_analyzer CSV/profile parsing on recorded output (perf_analyzer 2.51.0 from the tritonclient wheel, real
tritonserver 2.51.0, gRPC streaming, count windows, on the 2-core dev machine).

  pa_sample*.csv / *_profile.json   the `orpheus` ensemble served by `voxbackend serve` (tiny default random-weight
                                    checkpoint), input perf/data/pa_orpheus_max256.json, COUNT=8:
                                    request_rate_sweep.sh RANGE=0.5:1:0.5 and concurrency_sweep.sh RANGE=1:2:1
  pa_toy_*                          a toy decoupled Python model with a known answer: first 0.1 s chunk at 40 ms,
                                    then one every 60 ms, 6 chunks (rate 2:6:2 Poisson and concurrency 1:4:1)
Profiles are --profile-export-file output slimmed by parse.slim_profile (payloads dropped, timestamps kept).
"""
import json
from pathlib import Path

import pytest

from perf.perf_analyzer.parse import (attach_profile, first_response_latencies, load_profile, markdown, parse_csv,
                                      plot, slim_profile)

DATA = Path(__file__).parent / "data"


def test_request_rate_csv():
    rows = parse_csv(DATA / "pa_sample.csv")
    assert [r.load for r in rows] == [0.5, 1.0] and {r.mode for r in rows} == {"request_rate"}
    r = rows[0]
    assert r.infer_per_s == pytest.approx(0.230463) and r.responses_per_s == pytest.approx(7.1259)
    assert r.latency_us == {50: 2171618, 90: 3187523, 95: 3401222, 99: 3476480}
    assert r.avg_latency_us == pytest.approx(2058905)


def test_concurrency_csv_sorted_by_load():
    rows = parse_csv(DATA / "pa_sample_concurrency.csv")
    assert [r.load for r in rows] == [1, 2] and rows[0].mode == "concurrency"
    assert rows[1].responses_per_s == pytest.approx(31.2452)
    toy = parse_csv(DATA / "pa_toy_concurrency.csv")  # no --verbose-csv: no Avg latency column
    assert [r.load for r in toy] == [1, 2, 3, 4] and toy[3].avg_latency_us is None


def test_real_profile_first_response_before_last():
    rows = parse_csv(DATA / "pa_sample.csv")
    attach_profile(rows, json.loads((DATA / "pa_sample_profile.json").read_text()))
    for r in rows:
        assert r.requests == 25
        # time to first audio is a fraction of the whole stream that PA's CSV latency measures
        assert 0 < r.first_response_ms[50] < r.latency_us[50] / 1000 / 3
    md = markdown(rows)
    assert md.splitlines()[2].startswith("| 0.5 | 0.23 | 7.13 | 211.5 |")


def test_csv_without_load_column(tmp_path):
    p = tmp_path / "bad.csv"
    p.write_text("Foo,Inferences/Second\n1,2\n")
    with pytest.raises(ValueError):
        parse_csv(p)


def test_first_response_known_answer_toy():
    profile = json.loads((DATA / "pa_toy_rate_profile.json").read_text())
    lats = first_response_latencies(profile)
    assert sorted(lats) == [2.0, 4.0, 6.0]
    every = [x for v in lats.values() for x in v]
    # the toy sends its first chunk 40 ms after the request; PA's CSV latency (~341 ms) is the last response
    assert len(every) > 100 and all(0.035 < x < 0.2 for x in every)
    rows = parse_csv(DATA / "pa_toy_rate.csv")
    attach_profile(rows, profile)
    assert all(40 < r.first_response_ms[50] < 50 for r in rows)
    assert all(340 < r.latency_us[50] / 1000 < 345 for r in rows)  # PA 2.51's CSV latency: the last response
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
    plot(parse_csv(DATA / "pa_toy_concurrency.csv"), tmp_path / "b.png")
    assert (tmp_path / "a.png").stat().st_size > 1000 and (tmp_path / "b.png").stat().st_size > 1000


def test_load_profile_tolerates_raw_bytes(tmp_path):
    # PA exports BYTES outputs (encoded audio) as raw non-UTF-8 bytes inside JSON strings
    p = tmp_path / "prof.json"
    p.write_bytes(b'{"experiments": [{"experiment": {"mode": "concurrency", "value": 1}, "requests": [{"timestamp": 0,'
                  b' "response_timestamps": [5000000], "response_outputs": [{"AUDIO": "\x9b\xaf\xff"}]}]}]}')
    assert first_response_latencies(load_profile(p)) == {1.0: [pytest.approx(0.005)]}
