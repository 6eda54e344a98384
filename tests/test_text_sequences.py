"""Text streaming glue without a server: pieces of one sequence -> one engine request, with the weights-free fake."""
from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from voxbackend.errors import InvalidRequest
from voxbackend.models.registry import get_kind
from voxbackend.sampling_params import SamplingParams
from voxbackend.testing.fake_engine import FakeEngine, FakeModel, FakeStreamingModel
from voxbackend.triton.streams import ResponseLoop
from voxbackend.triton.text_sequences import Piece, TextSequences
from tests.util_responder import Recorder

TEXT = "Hello there, how are you doing today? I'm fine, thanks; we'll see you tomorrow."


@pytest.fixture
def rig():
    engine = FakeEngine(kv_pages=4096, step_s=0.004, model=FakeStreamingModel())
    engine.start()
    loop = ResponseLoop(engine, cancel_check_s=0.02)
    loop.start()
    seqs = TextSequences(engine, loop, get_kind("orpheus").request_inputs, idle_s=0.3)  # as the fake is served
    yield engine, loop, seqs
    loop.stop()
    engine.shutdown()


def piece(seqs, corrid, text, start=False, end=False, **inputs) -> Recorder:
    rec = Recorder()
    tensors = {"TEXT": np.array([text.encode() if isinstance(text, str) else text], dtype=np.object_), **inputs}
    seqs.piece(Piece(corrid, start, end, tensors.get, tuple(tensors), rec, f"p{corrid}", time.monotonic()))
    return rec


def sampling_inputs(seed=3, max_tokens=7000):
    return {"SEED": np.array([seed], np.int64), "MAX_TOKENS": np.array([max_tokens], np.int32)}


def pages_used(engine) -> int:
    return engine.stats().kv_pages_used


def wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_pieces_with_delays_give_the_whole_texts_audio(rig):
    engine, _, seqs = rig
    whole, _ = engine.synthesize(TEXT, sampling=SamplingParams(seed=3, max_tokens=7000))
    rng = random.Random(5)
    for trial in range(4):
        cuts = sorted(rng.sample(range(1, len(TEXT)), 8))
        parts = [TEXT[a:b] for a, b in zip([0, *cuts], [*cuts, len(TEXT)])]
        stream = piece(seqs, 10 + trial, parts[0], start=True, **sampling_inputs())
        acks = []
        for i, p in enumerate(parts[1:]):
            time.sleep(0.03)  # the engine catches up with the text and waits for more
            acks.append(piece(seqs, 10 + trial, p, end=i == len(parts) - 2))
        out, err, _ = stream.final
        assert err is None and out["FINISH_REASON"][0] == b"stop", (err, parts)
        np.testing.assert_array_equal(stream.audio, whole)
        assert all(a.sent == [(None, None, True)] for a in acks)  # each later piece: a bare final flag
    assert wait_for(lambda: pages_used(engine) == 0) and seqs.open_count == 0


def test_a_first_piece_inside_a_word_starts_nothing_until_the_next(rig):
    engine, _, seqs = rig
    stream = piece(seqs, 1, "Hel", start=True, **sampling_inputs())
    time.sleep(0.05)
    assert engine.stats().running == 0 and engine.stats().queued == 0 and not stream.sent
    piece(seqs, 1, "lo there")  # "Hello" is complete now: the request starts
    assert wait_for(lambda: len(stream.sent) >= 2)
    piece(seqs, 1, "", end=True)
    assert stream.final[1] is None
    whole, _ = engine.synthesize("Hello there", sampling=SamplingParams(seed=3, max_tokens=7000))
    np.testing.assert_array_equal(stream.audio, whole)


def test_a_bad_later_piece_is_refused_naming_the_field_and_the_utterance_goes_on(rig):
    engine, _, seqs = rig
    stream = piece(seqs, 2, "Hello there, ", start=True, **sampling_inputs())
    voice = piece(seqs, 2, "how are", VOICE=np.array([b"leo"], dtype=np.object_))
    assert voice.final[1].startswith("[request id: p2] InvalidRequest: VOICE is read from the first piece")
    utf8 = piece(seqs, 2, b"\xff\xfe")
    assert "TEXT is not valid UTF-8" in utf8.final[1]
    piece(seqs, 2, "how are you?", end=True)
    assert stream.final[1] is None
    whole, _ = engine.synthesize("Hello there, how are you?", sampling=SamplingParams(seed=3, max_tokens=7000))
    np.testing.assert_array_equal(stream.audio, whole)


def test_pieces_of_no_open_sequence_and_a_second_end_are_refused(rig):
    _, _, seqs = rig
    assert "sequence 99 has no open utterance" in piece(seqs, 99, "stray").final[1]
    stream = piece(seqs, 3, "Hi there.", start=True, end=True, **sampling_inputs())
    assert stream.final[1] is None
    assert "sequence 3 has no open utterance" in piece(seqs, 3, "after the end").final[1]


def test_first_piece_errors_end_the_stream_naming_the_field(rig):
    engine, _, seqs = rig
    bad_voice = piece(seqs, 4, "Hello there ", start=True, VOICE=np.array([b"nobody"], dtype=np.object_))
    assert bad_voice.final[1].startswith("InvalidRequest: VOICE") and "unknown voice" in bad_voice.final[1]
    bad_top_p = piece(seqs, 5, "Hello there ", start=True, TOP_P=np.array([0.0], np.float32))
    assert bad_top_p.final[1].startswith("InvalidRequest: TOP_P must be in")
    empty = piece(seqs, 6, "  ", start=True)
    assert piece(seqs, 6, "", end=True).final[1] == "[request id: p6] " + empty.final[1]
    assert "TEXT is empty" in empty.final[1]
    assert seqs.open_count == 0 and wait_for(lambda: pages_used(engine) == 0)


def test_an_idle_sequence_is_cancelled_and_frees_its_pages_while_another_plays_on(rig):
    engine, _, seqs = rig
    idle = piece(seqs, 7, "Hello there, how ", start=True, **sampling_inputs(seed=1))
    assert wait_for(lambda: pages_used(engine) > 0)
    idle_pages = pages_used(engine)
    busy = piece(seqs, 8, "The quick brown fox ", start=True, **sampling_inputs(seed=2))
    assert wait_for(lambda: pages_used(engine) > idle_pages)
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:  # only sequence 8 keeps sending pieces
        piece(seqs, 8, "jumps over ")
        seqs.expire_idle()
        time.sleep(0.05)
    out, err, _ = idle.final
    assert err is None and out["FINISH_REASON"][0] == b"cancelled"
    # the idle one is retired (its pages are free: the fake frees them on retire); the busy one plays on
    assert not busy.done.is_set() and engine.stats().running == 1
    piece(seqs, 8, "the dog.", end=True)
    assert busy.final[0]["FINISH_REASON"][0] == b"stop"
    assert wait_for(lambda: pages_used(engine) == 0) and seqs.open_count == 0


def test_a_client_gone_before_its_request_started_ends_its_stream(rig):
    engine, _, seqs = rig
    stream = piece(seqs, 9, "Hel", start=True)
    stream.cancelled = True  # the response loop sees is_cancelled() and marks the stream
    assert wait_for(lambda: (seqs.expire_idle(), stream.done.is_set())[1], timeout=3)
    assert stream.final[0]["FINISH_REASON"][0] == b"cancelled" and seqs.open_count == 0


def test_text_open_on_a_model_without_text_streaming_is_refused():
    engine = FakeEngine(model=FakeModel())
    with pytest.raises(InvalidRequest) as e:
        engine.submit(FakeModel().prepare("hi"), SamplingParams(), lambda ev: None, text_open=True)
    assert e.value.field == "text"


def test_append_text_after_the_end_is_refused():
    engine = FakeEngine(model=FakeStreamingModel(), step_s=0.002, kv_pages=4096)
    engine.start()
    try:
        done = threading.Event()
        rid = engine.submit(engine.model.prepare("Hello"), SamplingParams(seed=1), lambda ev: ev.final and done.set(),
                            text_open=True)
        engine.append_text(rid, engine.model.text_piece_ids(" there"), final=True)
        with pytest.raises(InvalidRequest, match="its text is already closed") as e:
            engine.append_text(rid, [1], final=True)
        assert e.value.field == "text"
        assert done.wait(5)
        with pytest.raises(InvalidRequest, match="unknown, finished"):
            engine.append_text(rid, [1], final=True)
    finally:
        engine.shutdown()


def test_an_internal_error_ends_the_stream_and_leaves_nothing_open(rig, monkeypatch):
    engine, _, seqs = rig
    stream = piece(seqs, 11, "Hello there, ", start=True, **sampling_inputs())
    assert wait_for(lambda: len(stream.sent) >= 1)

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "append_text", broken)
    later = piece(seqs, 11, "how are you? ")
    assert later.final[1] == "[request id: p11] internal error: RuntimeError: boom"
    monkeypatch.setattr(seqs.model, "text_tokenizer", None)  # a START that cannot even build its committer
    broken_start = piece(seqs, 12, "Hello ", start=True)
    assert broken_start.final[1].startswith("internal error: AttributeError")
    assert 12 not in seqs._open


def test_pieces_adding_up_past_the_text_limit_end_the_utterance(rig):
    engine, _, seqs = rig
    limit = engine.model.max_text_chars
    stream = piece(seqs, 40, "Hello there, ", start=True, **sampling_inputs())
    piece(seqs, 40, "word " * (limit // 10))  # still within the limit
    over = piece(seqs, 40, "word " * (limit // 5))
    assert "TEXT: the pieces add up to" in over.final[1] and f"the limit is {limit}" in over.final[1]
    assert "TEXT: the pieces add up to" in stream.final[1]  # the utterance's stream ends with the same error
    assert seqs.open_count == 0 and wait_for(lambda: pages_used(engine) == 0)
