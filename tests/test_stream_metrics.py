"""Streaming metrics on synthetic timelines; every expected value is worked out by hand in the comments."""
import pytest

from clients.stream_metrics import (StreamTimeline, goodput, goodput_label, markdown_table, meets_targets,
                                    on_time_flags, stall_free, summarize, ttfa)


def tl(send, chunks, error=None, end=None):
    return StreamTimeline(send_time=send, chunks=list(chunks), error=error, end_time=end)


def test_on_time_uses_strict_buffer_rule():
    # playback starts at 0.5; buffered before chunk i vs elapsed since 0.5:
    # chunk1: 1.0 > 0.7 on time; chunk2: 1.5 > 1.1 on time; chunk3: 2.0 > 2.0 is false -> late
    t = tl(0.0, [(0.5, 1.0), (1.2, 0.5), (1.6, 0.5), (2.5, 0.3)])
    assert ttfa(t) == pytest.approx(0.5)
    assert on_time_flags(t) == [True, True, False]
    assert not stall_free(t)


def test_stall_free_stream():
    # ttfa 0.25; chunk1: 0.4 > 0.25; chunk2: 0.8 > 0.65
    t = tl(1.0, [(1.25, 0.4), (1.5, 0.4), (1.9, 0.4)])
    assert ttfa(t) == pytest.approx(0.25)
    assert on_time_flags(t) == [True, True]
    assert stall_free(t)


def test_empty_responses_are_not_audio():
    # a zero-sample response (e.g. bare final flag) neither starts playback nor counts as a chunk
    t = tl(1.0, [(1.1, 0.0), (1.3, 0.2), (1.4, 0.0)])
    assert ttfa(t) == pytest.approx(0.3)
    assert on_time_flags(t) == []
    assert stall_free(t)


def test_errors_and_silence_are_not_stall_free():
    assert not stall_free(tl(0.0, [(0.1, 1.0)], error="boom"))
    assert ttfa(tl(0.0, [])) is None
    assert not stall_free(tl(0.0, []))


def summary_set():
    return [
        tl(0.0, [(0.1, 1.0), (0.5, 1.0)]),                 # ttfa .1, flag 1.0>0.4 T, free
        tl(1.0, [(1.2, 0.2), (1.6, 0.2)]),                 # ttfa .2, flag 0.2>0.4 F
        tl(2.0, [(2.3, 2.0)]),                             # ttfa .3, nothing judged, free
        tl(3.0, [(3.4, 0.5), (3.5, 0.5), (3.6, 0.5)]),     # ttfa .4, flags T T, free
        tl(4.0, [(4.5, 1.0)], error="boom"),               # ttfa .5, error
        tl(5.0, [], error="timeout", end=6.0),             # no audio, error; last event at 6.0
    ]


def test_summarize_hand_computed():
    s = summarize(summary_set())
    assert s["count"] == 6 and s["errors"] == 2 and s["ttfa_count"] == 5
    # ttfas .1 .2 .3 .4 .5; numpy linear: p90 at rank 0.9*4 = 3.6 -> .4 + .6*.1 = .46
    assert s["ttfa_mean_s"] == pytest.approx(0.3)
    assert s["ttfa_p50_s"] == pytest.approx(0.3)
    assert s["ttfa_p90_s"] == pytest.approx(0.46)
    assert s["ttfa_p95_s"] == pytest.approx(0.48)
    assert s["ttfa_p99_s"] == pytest.approx(0.496)
    assert s["chunks_judged"] == 4 and s["on_time_chunk_pct"] == pytest.approx(75.0)
    assert s["stall_free_pct"] == pytest.approx(50.0) and s["stall_free_frac"] == pytest.approx(0.5)
    # audio 2.0 + 0.4 + 2.0 + 1.5 + 1.0 = 6.9 s over wall 0.0 -> 6.0 s
    assert s["audio_s"] == pytest.approx(6.9)
    assert s["wall_s"] == pytest.approx(6.0)
    assert s["x_real_time"] == pytest.approx(1.15)
    assert s["percentile_method"] == "numpy linear"


def test_summarize_explicit_wall_and_empty():
    assert summarize(summary_set(), wall_s=3.0)["x_real_time"] == pytest.approx(2.3)
    e = summarize([])
    assert e["count"] == 0 and e["ttfa_p90_s"] is None and e["stall_free_pct"] is None


def test_timeline_roundtrip():
    t = tl(1.0, [(1.25, 0.4)], end=1.3)
    assert StreamTimeline.from_dict(t.to_dict()) == t


def S(p90, free, count=100):
    return {"count": count, "ttfa_p90_s": p90, "stall_free_frac": free}


def test_goodput_search():
    res = {0.5: S(0.2, 1.0), 1.0: S(0.5, 0.99), 2.0: S(0.9, 1.0), 4.0: S(0.3, 0.95)}
    # 1.0 sits exactly on both targets and passes; 2.0 misses TTFA, 4.0 misses stall-free
    assert goodput(res, ttfa_p90_target_s=0.5) == 1.0
    assert goodput(res, ttfa_p90_target_s=1.0) == 2.0
    assert goodput(res, ttfa_p90_target_s=1.0, stall_free_target=0.9) == 4.0
    assert goodput(res, ttfa_p90_target_s=0.1) is None
    assert not meets_targets(S(None, 1.0), 1.0)
    assert not meets_targets(S(0.1, 1.0, count=0), 1.0)
    assert goodput({}, 1.0) is None
    assert goodput_label(0.5, 0.99) == "p90 TTFA <= 0.5 s, stall-free >= 99%"


def test_goodput_is_highest_qualifying_rate():
    # the definition takes the highest qualifying rate, even above a missed one
    res = {1.0: S(0.2, 1.0), 2.0: S(2.0, 1.0), 4.0: S(0.3, 1.0)}
    assert goodput(res, 1.0) == 4.0


def test_markdown_table():
    md = markdown_table({2.0: summarize(summary_set()), 1.0: summarize([])})
    lines = md.splitlines()
    assert (len(lines) == 4 and lines[2].startswith("| 1 | 0 |")
            and lines[3].startswith("| 2 | 6 | 2 | 300 | 300 | 460 |"))



def test_a_startup_buffer_moves_playback_to_the_chunk_that_fills_it():
    t = tl(0.0, [(0.0, 0.1), (0.05, 0.1), (0.15, 0.1), (0.4, 0.1)])
    # at once: chunk1 0.1 > 0.05, chunk2 0.2 > 0.15, chunk3 0.3 > 0.4 is false -> late
    assert on_time_flags(t) == [True, True, False] and not stall_free(t)
    # 0.2 s first: plays from chunk1 (t0 0.05): chunk2 0.2 > 0.1; chunk3 0.3 > 0.35 is false -> late
    assert on_time_flags(t, startup_s=0.2) == [True, False]
    # 0.3 s first: plays from chunk2 (t0 0.15): chunk3 0.3 > 0.25 -> on time
    assert on_time_flags(t, startup_s=0.3) == [True] and stall_free(t, startup_s=0.3)
    # more than the whole stream: it plays from the last chunk, nothing is judged
    assert on_time_flags(t, startup_s=5.0) == [] and stall_free(t, startup_s=5.0)
    assert summarize([t], startup_s=0.3)["stall_free_pct"] == 100.0
