"""Load generator pieces that need no server: seeded arrival processes, request building, response handling."""
import numpy as np
import pytest

from clients.loadgen import (RequestOptions, _Run, arrival_label, arrival_offsets, build_inputs, chunk_audio_seconds,
                             error_counts, format_errors, is_final, load_prompts, parse_rates, request_fields)
from clients.stream_metrics import StreamTimeline


def test_poisson_arrivals_statistics():
    t = arrival_offsets(rate=10.0, duration_s=2000.0, seed=7)
    gaps = np.diff(t)
    assert t.min() >= 0 and t.max() < 2000.0 and np.all(gaps > 0)
    # ~20000 arrivals: count within 3 sigma (sqrt(20000) ~ 141), mean gap 0.1 s, exponential CV 1
    assert abs(len(t) - 20000) < 450
    assert gaps.mean() == pytest.approx(0.1, rel=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)


def test_gamma_burstiness_statistics():
    gaps = np.diff(arrival_offsets(rate=5.0, duration_s=4000.0, seed=1, burstiness=0.25))
    # Gamma shape k: mean 1/rate, CV 1/sqrt(k) = 2
    assert gaps.mean() == pytest.approx(0.2, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.08)
    smooth = np.diff(arrival_offsets(rate=5.0, duration_s=4000.0, seed=1, burstiness=4.0))
    assert smooth.std() / smooth.mean() == pytest.approx(0.5, rel=0.05)


def test_arrivals_seeded_and_bounded():
    a = arrival_offsets(2.0, 30.0, seed=3)
    assert np.array_equal(a, arrival_offsets(2.0, 30.0, seed=3))
    assert not np.array_equal(a, arrival_offsets(2.0, 30.0, seed=4))
    assert len(arrival_offsets(50.0, 10.0, seed=0, max_requests=5)) == 5
    assert len(arrival_offsets(0.0, 10.0)) == 0
    # a rate so low that the first draw may not cover the window still ends inside it
    assert np.all(arrival_offsets(1000.0, 0.01, seed=0) < 0.01)


def test_labels_and_rates(tmp_path):
    assert arrival_label(1.0) == "Poisson (open loop)"
    assert arrival_label(0.5).startswith("Gamma shape 0.5")
    assert parse_rates("0.5, 1,2,") == [0.5, 1.0, 2.0]
    p = tmp_path / "p.txt"
    p.write_text("# comment\nHello there.\n\n  Second line.  \n")
    assert load_prompts(p) == ["Hello there.", "Second line."]


def test_request_fields_and_inputs():
    opts = RequestOptions(voice="tara", sampling={"TEMPERATURE": 0.6, "TOP_K": None}, max_tokens=256,
                          sampling_seed=100)
    f = request_fields("Hi.", opts, index=3)
    assert f == {"TEXT": "Hi.", "VOICE": "tara", "TEMPERATURE": 0.6, "MAX_TOKENS": 256, "SEED": 103}
    meta = {"TEXT": {"datatype": "BYTES", "shape": [1]}, "VOICE": {"datatype": "BYTES", "shape": [1]},
            "TEMPERATURE": {"datatype": "FP32", "shape": [1]}, "MAX_TOKENS": {"datatype": "INT32", "shape": [1]},
            "SEED": {"datatype": "INT64", "shape": [-1, 1]}}
    inputs = {i.name(): i for i in build_inputs(f, meta)}
    assert inputs["TEXT"].datatype() == "BYTES" and inputs["TEXT"].shape() == [1]
    assert inputs["MAX_TOKENS"].datatype() == "INT32"
    assert inputs["SEED"].shape() == [1, 1]  # batched models get a batch dimension of 1
    with pytest.raises(ValueError, match="no input 'VOICE'"):
        build_inputs(f, {k: v for k, v in meta.items() if k != "VOICE"})


class FakeParam:
    def __init__(self, v): self.bool_param = v


class FakeResponse:
    def __init__(self, final):
        self.parameters = {"triton_final_response": FakeParam(final)} if final is not None else {}


class FakeResult:
    def __init__(self, audio=None, sr=24000, final=False, final_out=None, reason=None):
        self._out = {"AUDIO": audio, "SAMPLE_RATE": None if sr is None else np.array([sr], np.int32),
                     "FINAL": None if final_out is None else np.array([final_out]),
                     "FINISH_REASON": None if reason is None else np.array([reason.encode()], dtype=object)}
        self._final = final

    def as_numpy(self, name): return self._out.get(name)
    def get_response(self): return FakeResponse(self._final)


def test_chunk_audio_and_final_flag():
    assert chunk_audio_seconds(FakeResult(np.zeros(12000, np.int16))) == pytest.approx(0.5)
    assert chunk_audio_seconds(FakeResult(np.zeros((1, 2400), np.float32))) == pytest.approx(0.1)
    assert chunk_audio_seconds(FakeResult(None, sr=None)) == 0.0
    with pytest.raises(ValueError):
        chunk_audio_seconds(FakeResult(np.zeros(10, np.int16), sr=None))
    # the front models send AUDIO as one BYTES element of encoded samples
    assert chunk_audio_seconds(FakeResult(np.array([b"\0" * 4800], dtype=object))) == pytest.approx(0.1)
    assert chunk_audio_seconds(FakeResult(np.array([b"\0" * 4800], dtype=object)), "fp32") == pytest.approx(0.05)
    assert chunk_audio_seconds(FakeResult(np.array([b""], dtype=object))) == 0.0
    assert is_final(FakeResult(final=True)) and not is_final(FakeResult(final=False))
    assert not is_final(FakeResult(final=None))
    assert is_final(FakeResult(final=None, final_out=True)) and not is_final(FakeResult(final=None, final_out=False))


class FakeConn:
    def __init__(self): self.current, self.broken = None, False


def bare_run():
    """A _Run without connections, to drive its response handler directly."""
    import queue
    import threading
    import time
    run = object.__new__(_Run)
    run.idle, run.all, run.lock, run.pending = queue.SimpleQueue(), [], threading.Lock(), 0
    run.all_done, run.t0 = threading.Condition(run.lock), time.perf_counter()
    run.audio_format = "pcm16"
    return run


def test_response_handling_records_chunks_and_finishes():
    run, conn = bare_run(), FakeConn()
    t = StreamTimeline(send_time=0.0)
    conn.current, run.pending = t, 1
    run._on_response(conn, FakeResult(np.zeros(2400, np.int16)), None)
    run._on_response(conn, FakeResult(np.zeros(4800, np.int16)), None)
    run._on_response(conn, FakeResult(np.array([b""], dtype=object), final=True, reason="stop"), None)
    assert [d for _, d in t.chunks] == pytest.approx([0.1, 0.2])
    assert t.error is None and t.end_time is not None and run.pending == 0 and t.finish_reason == "stop"
    assert run.idle.get_nowait() is conn  # a clean stream goes back to the pool
    run._on_response(conn, FakeResult(np.zeros(10, np.int16), final=True), None)  # stray: ignored
    assert len(t.chunks) == 2


def test_error_response_marks_request_and_retires_stream():
    run, conn = bare_run(), FakeConn()
    t = StreamTimeline(send_time=0.0)
    conn.current, run.pending = t, 1
    run._on_response(conn, None, RuntimeError("unknown voice"))
    assert t.error == "unknown voice" and conn.broken and run.pending == 0 and run.idle.empty()


def test_errors_are_reported_with_their_messages_and_counts():
    def tl(error):
        return StreamTimeline(send_time=0.0, error=error)

    overloaded = "EngineOverloaded: overloaded: 64 requests already queued; retry later"
    bad = "InvalidRequest: TOP_P must be in (0, 1], got 0.0"
    tls = [tl(overloaded), tl(None), tl(bad), tl(overloaded), tl(overloaded), tl(None), tl("timed out")]
    assert error_counts(tls) == [(overloaded, 3), (bad, 1), ("timed out", 1)]
    text = format_errors(tls)
    assert text.splitlines() == ["errors: 5 (3 distinct)", f"  3 x {overloaded}", f"  1 x {bad}", "  1 x timed out"]
    assert format_errors([tl(None)]) == "errors: 0"
