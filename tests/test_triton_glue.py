"""The Triton glue without a server: request parsing, encodings, the response thread, settings, launcher helpers."""
from __future__ import annotations

import os
import random
import re
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from voxbackend.errors import InvalidRequest
from voxbackend.events import Event, EventKind
from voxbackend.models.csm.model import CsmFrontend
from voxbackend.models.orpheus.model import OrpheusFrontend
from voxbackend.sampling_params import SamplingParams
from voxbackend.triton import audio_encoding, fields, schema
from voxbackend.triton.cancel_channel import CancelListener, send_cancel, send_shutdown, server_listeners
from voxbackend.testing.fake_engine import FakeEngine, fake_audio
from voxbackend.triton.loading import instance_settings
from voxbackend.triton.drain import DRAINING, DrainWatch, grace_expired, server_http_address
from voxbackend.triton.streams import ERROR_PREFIX, ResponseLoop, Stream, _Add
from tests.util_responder import Recorder


def getter(**tensors):
    return lambda name: tensors.get(name)


def text(value) -> np.ndarray:
    return np.array([value], dtype=np.object_)


# ---------------------------------------------------------------- fields


@pytest.mark.parametrize("inputs, message", [
    ({}, "TEXT is required"),
    ({"TEXT": text(b"   ")}, "TEXT is empty"),
    ({"TEXT": text(b"\xff\xfeabc")}, "not valid UTF-8"),
    ({"TEXT": np.array([b"a", b"b"], dtype=np.object_)}, "exactly one element"),
    ({"TEXT": np.array([1.0], dtype=np.float32)}, "must be a UTF-8 string"),
])
def test_text_errors_name_the_field(inputs, message):
    with pytest.raises(InvalidRequest, match=message):
        fields.text_and_voice(getter(**inputs))


def test_text_and_voice():
    assert fields.text_and_voice(getter(TEXT=text("héllo".encode()), VOICE=text(b"leo"))) == ("héllo", "leo")
    assert fields.text_and_voice(getter(TEXT=text(b"hi"), VOICE=text(b""))) == ("hi", None)


@pytest.mark.parametrize("name, value, message", [
    ("TEMPERATURE", np.float32(-1), "TEMPERATURE must be >= 0"),
    ("TOP_P", np.float32(0), "TOP_P must be in"),
    ("TOP_K", np.int32(-3), "TOP_K must be >= 0"),
    ("MIN_P", np.float32(2), "MIN_P must be in"),
    ("REPETITION_PENALTY", np.float32(0), "REPETITION_PENALTY must be in"),
    ("MAX_TOKENS", np.int32(0), "MAX_TOKENS must be >= 1"),
    ("SEED", np.int64(-5), "SEED must be in"),
    ("TEMPERATURE", np.float32("nan"), "TEMPERATURE must not be NaN"),
    ("TEMPERATURE", np.float32("inf"), "TEMPERATURE must be finite, got inf"),
    ("TOP_P", np.float32("-inf"), "TOP_P must be finite"),
    ("MIN_P", np.float32("inf"), "MIN_P must be finite"),
    ("REPETITION_PENALTY", np.float32("inf"), "REPETITION_PENALTY must be finite"),
])
def test_sampling_errors_use_tensor_names(name, value, message):
    with pytest.raises(InvalidRequest, match=re.escape(message)) as e:
        fields.sampling(getter(**{name: np.array([value])}), SamplingParams())
    assert e.value.field == schema.SAMPLING_FIELDS[name]  # the engine-side name travels with the error


def test_sampling_defaults_overrides_and_fp32_rounding():
    defaults = SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3, max_tokens=1200)
    p = fields.sampling(getter(TEMPERATURE=np.array([0.7], np.float32), MAX_TOKENS=np.array([64], np.int32),
                               SEED=np.array([9], np.int64)), defaults)
    # FP32 on the wire reads back as the decimal the client meant (0.7, not 0.699999988)
    assert (p.temperature, p.top_p, p.max_tokens, p.seed) == (0.7, 0.8, 64, 9)
    assert isinstance(fields.sampling(getter(), defaults).seed, int)  # drawn when absent
    round_trip = fields.sampling(getter(**fields.sampling_tensors(p)), SamplingParams())
    assert round_trip == p


def test_audio_format_and_prompt_ids():
    assert fields.audio_format(getter()) == "pcm16"
    assert fields.audio_format(getter(AUDIO_FORMAT=text(b"FP32"))) == "fp32"
    with pytest.raises(InvalidRequest, match="AUDIO_FORMAT must be one of"):
        fields.audio_format(getter(AUDIO_FORMAT=text(b"mp3")))
    assert fields.prompt_ids(getter(PROMPT_IDS=np.array([1, 2, 3], np.int64))) == [1, 2, 3]
    with pytest.raises(InvalidRequest, match="PROMPT_IDS"):
        fields.prompt_ids(getter(PROMPT_IDS=np.zeros(0, np.int64)))


CSM_INPUTS = CsmFrontend.request_inputs


def test_model_inputs_become_prepare_keywords():
    voice = OrpheusFrontend.request_inputs
    assert fields.prepare_kwargs(getter(VOICE=text(b"leo")), voice) == {"voice": "leo"}
    assert fields.prepare_kwargs(getter(VOICE=text(b"")), voice) == {}  # empty: the model's default
    raw = np.arange(3, dtype="<f4")
    kw = fields.prepare_kwargs(getter(
        SPEAKER=np.array([2], np.int32), CONTEXT_TEXT=np.array([b"one", "twö".encode()], dtype=np.object_),
        CONTEXT_SPEAKER=np.array([0, 1], np.int32), CONTEXT_AUDIO=np.array([raw.tobytes(), b""], dtype=np.object_),
        CONTEXT_SAMPLE_RATE=np.array([16000], np.int32)), CSM_INPUTS)
    assert kw["speaker"] == 2 and [(c["text"], c["speaker"], c["sample_rate"]) for c in kw["context"]] == [
        ("one", 0, 16000), ("twö", 1, 16000)]  # one rate for every segment
    np.testing.assert_array_equal(kw["context"][0]["audio"], raw)
    files = fields.prepare_kwargs(getter(CONTEXT_TEXT=text(b"a"), CONTEXT_SPEAKER=np.array([3], np.int32),
                                         CONTEXT_AUDIO=text(b"RIFF...")), CSM_INPUTS)
    assert files == {"context": [{"text": "a", "speaker": 3, "audio": b"RIFF..."}]}  # files go to the model as bytes


@pytest.mark.parametrize("tensors, message", [
    (dict(SPEAKER=np.array([1.5], np.float32)), "SPEAKER must be an integer"),
    (dict(SPEAKER=np.array([1, 2], np.int32)), "SPEAKER must hold exactly one element"),
    (dict(CONTEXT_TEXT=text(b"a")), "CONTEXT_SPEAKER is missing"),
    (dict(CONTEXT_TEXT=np.array([b"a", b"b"], dtype=np.object_), CONTEXT_SPEAKER=np.array([0], np.int32),
          CONTEXT_AUDIO=np.array([b"x", b"y"], dtype=np.object_)),
     r"CONTEXT_SPEAKER has 1 element\(s\) but CONTEXT_TEXT has 2"),
    (dict(CONTEXT_TEXT=text(b"a"), CONTEXT_SPEAKER=np.array([0], np.int32), CONTEXT_AUDIO=text(b"abc"),
          CONTEXT_SAMPLE_RATE=np.array([8000], np.int32)), "multiple of 4 bytes"),
    (dict(CONTEXT_TEXT=text(b"a"), CONTEXT_SPEAKER=np.array([0], np.int32), CONTEXT_AUDIO=text(b"abcd"),
          CONTEXT_SAMPLE_RATE=np.array([8000, 8000], np.int32)), "CONTEXT_SAMPLE_RATE needs 1 or 1 element"),
    (dict(CONTEXT_TEXT=np.array([[b"a"]], dtype=np.object_)), "must be a 1-D tensor"),
    (dict(CONTEXT_TEXT=text(b"\xff"), CONTEXT_SPEAKER=np.array([0], np.int32), CONTEXT_AUDIO=text(b"x")),
     r"CONTEXT_TEXT\[0\] is not valid UTF-8"),
])
def test_model_input_errors_name_the_tensor(tensors, message):
    with pytest.raises(InvalidRequest, match=message):
        fields.prepare_kwargs(getter(**tensors), CSM_INPUTS)


def test_model_messages_are_translated_to_tensor_names():
    class Model:
        def __init__(self, message, field):
            self.message, self.field = message, field

        def prepare(self, text, **kwargs):
            raise InvalidRequest(self.message, field=self.field)

    for said, field, meant in [
            ("speaker must be in [0, 10), got 12", "speaker", "SPEAKER must be in [0, 10), got 12"),
            ("context[1].speaker must be in [0, 10)", "context[1].speaker", "CONTEXT_SPEAKER[1] must be in [0, 10)"),
            ("context[0].audio is 170.00 s; the limit is 163.84 s", "context[0].audio", "CONTEXT_AUDIO[0] is 170.00 s"),
            ("context[0].audio sample_rate must be an integer", "context[0].audio sample_rate",
             "CONTEXT_AUDIO[0] sample_rate must be an integer"),
            ("context[2].text is empty", "context[2].text", "CONTEXT_TEXT[2] is empty"),
            ("text is 5000 characters", "text", "TEXT is 5000 characters"),
            ("unknown speaker 'x'", "speaker", "SPEAKER: unknown speaker 'x'"),  # message not led by the field
            ("prompt is 3000 positions", None, "prompt is 3000 positions")]:  # no field: unchanged
        with pytest.raises(InvalidRequest, match=re.escape(meant)) as e:
            fields.prepare_request(getter(TEXT=text(b"hi")), Model(said, field), CSM_INPUTS)
        assert e.value.field == field


def test_glue_errors_carry_the_engine_side_field():
    cases = [(lambda: fields.text_field(getter()), "text"),
             (lambda: fields.audio_format(getter(AUDIO_FORMAT=text(b"mp3"))), "audio_format"),
             (lambda: fields.prepare_kwargs(getter(SPEAKER=np.array([1.5], np.float32)), CSM_INPUTS), "speaker"),
             (lambda: fields.prepare_kwargs(getter(CONTEXT_TEXT=text(b"\xff"), CONTEXT_SPEAKER=np.array([0], np.int32),
                                                   CONTEXT_AUDIO=text(b"x")), CSM_INPUTS), "context[0].text"),
             (lambda: fields.prompt_ids(getter(PROMPT_IDS=np.zeros(0, np.int64))), "prompt_ids")]
    for call, field in cases:
        with pytest.raises(InvalidRequest) as e:
            call()
        assert e.value.field == field, (str(e.value), field)


def test_encodings_round_trip_and_clip():
    audio = np.array([0.0, 0.5, -0.5, 1.2, -3.0], np.float32)
    pcm = audio_encoding.decode(audio_encoding.encode(audio, "pcm16"), "pcm16")
    np.testing.assert_allclose(pcm, np.clip(audio, -1, 1), atol=1 / 32767)
    assert audio_encoding.encode(audio, "pcm16")[:2] == b"\x00\x00" and len(audio_encoding.encode(audio, "pcm16")) == 10
    np.testing.assert_array_equal(audio_encoding.decode(audio_encoding.encode(audio, "fp32"), "fp32"), audio)


# ---------------------------------------------------------------- response thread


class Metrics:
    def __init__(self):
        self.ttfa, self.late, self.reasons, self.last = [], 0, [], None

    def first_audio(self, s):
        self.ttfa.append(s)

    def late_chunk(self):
        self.late += 1

    def finished(self, reason):
        self.reasons.append(reason)

    def gauges(self, active, queued, kv_used, kv_total, alive):
        self.last = (active, queued, kv_used, kv_total, alive)


@pytest.fixture
def engine():
    e = FakeEngine(kv_pages=4096, step_s=0.005)
    e.start()
    yield e
    e.shutdown()


def submit(loop: ResponseLoop, engine, rid: str, text_: str, responder: Recorder, max_tokens=70, seed=1):
    loop.add(Stream(rid, responder, "fp32", time.monotonic(), 24000, stream_id=f"sid-{rid}"))
    sampling = SamplingParams(max_tokens=max_tokens, seed=seed)
    engine.submit(engine.model.prepare(text_), sampling, loop.on_event, request_id=rid)
    return sampling


def test_loop_streams_chunks_then_exactly_one_final(engine):
    metrics = Metrics()
    loop = ResponseLoop(engine, metrics, gauge_s=0.01)
    loop.start()
    recs = {f"r{i}": Recorder() for i in range(6)}
    for i, (rid, rec) in enumerate(recs.items()):
        submit(loop, engine, rid, f"hello number {i}", rec, seed=i)
    for rec in recs.values():
        assert rec.done.wait(10)
    time.sleep(0.05)
    loop.stop()
    for i, rec in enumerate(recs.values()):
        finals = [s for s in rec.sent if s[2]]
        assert len(finals) == 1 and rec.sent[-1][2]
        out, err, _ = rec.sent[-1]
        assert err is None and out["FINAL"][0] and out["FINISH_REASON"][0] == b"length"
        assert out["AUDIO"].size == 0 and out["CHUNK_INDEX"][0] == len(rec.sent) - 1
        assert [o["CHUNK_INDEX"][0] for o, _, f in rec.sent if not f] == list(range(len(rec.sent) - 1))
        assert rec.sent[0][0]["STREAM_ID"][0] == f"sid-r{i}".encode()
        expected, _ = engine.synthesize(f"hello number {i}", sampling=SamplingParams(max_tokens=70, seed=i))
        np.testing.assert_array_equal(rec.audio, expected)
    assert len(metrics.ttfa) == 6 and metrics.reasons == ["length"] * 6
    assert metrics.last[0] == 0 and metrics.last[2] == 0  # no stream open, no KV page in use


def test_loop_cancels_when_the_client_is_gone_and_frees_pages(engine):
    loop = ResponseLoop(engine, gauge_s=0.01)
    loop.start()
    gone, kept, by_channel = Recorder(cancelled=True), Recorder(), Recorder()
    submit(loop, engine, "gone", "a long text " * 5, gone, max_tokens=7000)
    submit(loop, engine, "kept", "short", kept, max_tokens=21)
    submit(loop, engine, "chan", "a long text " * 5, by_channel, max_tokens=7000)
    loop.request_cancel("chan")  # what cancel_channel delivers for a front model client
    for rec in (gone, kept, by_channel):
        assert rec.done.wait(10)
    loop.stop()
    assert gone.sent[-1][0]["FINISH_REASON"][0] == b"cancelled"
    assert by_channel.sent[-1][0]["FINISH_REASON"][0] == b"cancelled"
    assert kept.sent[-1][0]["FINISH_REASON"][0] == b"length"
    deadline = time.monotonic() + 2
    while engine.stats().kv_pages_used and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats().kv_pages_used == 0


def test_loop_ends_every_stream_when_the_engine_dies(engine):
    loop = ResponseLoop(engine)
    loop.start()
    victims = [Recorder() for _ in range(3)]
    for i, rec in enumerate(victims):
        submit(loop, engine, f"v{i}", "long text " * 5, rec, max_tokens=7000)
    time.sleep(0.05)
    killer = Recorder()
    submit(loop, engine, "die", "__die__ now", killer)
    for rec in (*victims, killer):
        assert rec.done.wait(10)
        assert rec.sent[-1][1] and rec.sent[-1][2]  # an error, with the final flag
    loop.stop()
    assert not engine.alive


def test_loop_reject_sends_one_error_and_stop_closes_open_streams(engine):
    loop = ResponseLoop(engine)
    loop.start()
    bad, open_ = Recorder(), Recorder()
    loop.add(Stream("bad", bad, "pcm16", time.monotonic(), 24000))
    loop.reject("bad", "InvalidRequest: TEXT is empty")
    submit(loop, engine, "open", "long text " * 5, open_, max_tokens=7000)
    assert bad.done.wait(5)
    assert bad.sent == [(None, "InvalidRequest: TEXT is empty", True)]
    loop.stop("shutting down")
    assert open_.sent[-1][1] == "request aborted: shutting down" and open_.sent[-1][2]


def test_loop_probes_only_silent_streams_that_ask_for_it():
    now = [0.0]

    class QueuedEngine:  # everything waits in the queue: nothing is ever sent
        def cancel(self, request_id):
            pass

        def stats(self):
            return None

    loop = ResponseLoop(QueuedEngine(), clock=lambda: now[0], probe_s=0.4, cancel_check_s=1e9)
    front, direct = Recorder(), Recorder()
    loop._handle(_Add(Stream("e", front, "pcm16", 0.0, 24000, seed=7, probes=True)))
    loop._handle(_Add(Stream("d", direct, "pcm16", 0.0, 24000, probes=False)))
    for t in (0.1, 0.3, 0.45, 0.6, 0.9):
        now[0] = t
        loop._housekeeping()
    assert direct.sent == []  # a direct client sees cancellation itself (is_cancelled) and must not see probes
    assert len(front.sent) == 2  # at 0.45 s and 0.9 s: each 0.4 s after the last response
    for out, error, final in front.sent:
        assert error is None and not final and out["FINISH_REASON"][0] == b"probe" and out["AUDIO"].size == 0
        assert out["SEED_USED"][0] == 7


class IdleEngine:  # nothing generates: streams stay open until the loop ends them
    def __init__(self):
        self.cancelled: list[str] = []

    def cancel(self, request_id):
        self.cancelled.append(request_id)

    def stats(self):
        return None


class SlowRecorder(Recorder):
    def send(self, outputs, error, final):
        time.sleep(0.001)  # a response is an IPC round trip: on a loaded machine, slower than the engine makes chunks
        super().send(outputs, error, final)


def test_a_gone_client_is_seen_while_other_streams_keep_the_event_queue_full():
    """Housekeeping (is_cancelled, gauges, the drain deadline) ran only once the event queue was empty, so an engine
    that kept it full hid a client's cancellation: its request ran to max_tokens (seen in CI on a loaded machine)."""
    engine = IdleEngine()
    loop = ResponseLoop(engine)
    loop.add(Stream("busy", SlowRecorder(), "fp32", time.monotonic(), 24000))
    loop.add(Stream("gone", Recorder(cancelled=True), "fp32", time.monotonic(), 24000))
    chunk = np.zeros(240, np.float32)
    stop = threading.Event()

    def flood() -> None:  # the engine thread: always a backlog of the busy stream's chunks
        while not stop.is_set():
            if loop._queue.qsize() < 200:
                for _ in range(200):
                    loop.on_event(Event("busy", EventKind.AUDIO, audio=chunk))
            time.sleep(0.0005)

    feeder = threading.Thread(target=flood, daemon=True)
    feeder.start()
    loop.start()
    try:
        deadline = time.monotonic() + 3
        while "gone" not in engine.cancelled and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "gone" in engine.cancelled, "the cancellation was not seen while the queue stayed full"
    finally:
        stop.set()
        feeder.join(2)
        loop.stop()


def test_a_failed_stream_behind_the_front_model_ends_with_a_normal_final_carrying_the_error():
    """An error response after the first one does not reach a BLS caller (Triton 2.51): a stream that asked for
    probes (behind the front model) gets a final response whose FINISH_REASON carries the error; a direct
    client gets the error response itself."""
    loop = ResponseLoop(IdleEngine())
    front, direct = Recorder(), Recorder()
    loop._handle(_Add(Stream("f", front, "pcm16", 0.0, 24000, seed=7, probes=True)))
    loop._handle(_Add(Stream("d", direct, "pcm16", 0.0, 24000)))
    for request_id in ("f", "d"):
        loop._handle(Event(request_id, EventKind.ERROR, error="engine failed: boom"))
    [(out, error, final)] = front.sent
    assert error is None and final and out["FINAL"][0] and out["AUDIO"].size == 0
    assert out["FINISH_REASON"][0] == (ERROR_PREFIX + "engine failed: boom").encode()
    assert direct.sent == [(None, "engine failed: boom", True)]


def test_a_drain_refuses_new_streams_and_ends_open_ones_at_the_grace_period():
    now = [0.0]
    engine = IdleEngine()
    loop = ResponseLoop(engine, clock=lambda: now[0], cancel_check_s=1e9, probe_s=1e9)
    before = Recorder()
    loop._handle(_Add(Stream("open", before, "pcm16", 0.0, 24000)))
    loop.request_drain(5.0)
    loop._handle(loop._queue.get_nowait())
    assert loop.draining
    late = Recorder()
    loop._handle(_Add(Stream("late", late, "pcm16", 0.0, 24000)))
    assert late.sent == [(None, DRAINING, True)]  # refused at once
    now[0] = 4.9
    loop._housekeeping()
    assert before.sent == [] and engine.cancelled == []  # still inside the grace period: it may finish
    now[0] = 5.0
    loop._housekeeping()
    assert before.sent == [(None, grace_expired(5.0), True)] and engine.cancelled == ["open"]
    assert "drain grace period (5 s)" in grace_expired(5.0)


def test_the_drain_watch_fires_once_when_the_http_port_that_was_open_refuses():
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    address = listener.getsockname()
    fired: list[float] = []
    watch = DrainWatch(lambda: fired.append(time.monotonic()), address=address, poll_s=0.05)
    try:
        time.sleep(0.3)
        assert fired == []  # open: serving
        listener.close()  # what tritonserver does first on SIGTERM
        assert wait_until(lambda: fired, 5)
        time.sleep(0.2)
        assert len(fired) == 1
    finally:
        watch.close()


def test_the_drain_watch_finds_the_http_port_on_the_server_command_line(tmp_path):
    """The stub's parent is tritonserver: its --http-port / --http-address / --allow-http decide the address."""
    import subprocess

    def address(*args: str):
        proc = subprocess.Popen([sys.executable, "-c", "import time; print(1, flush=True); time.sleep(30)", *args],
                                stdout=subprocess.PIPE)
        try:
            proc.stdout.readline()  # exec'd: its command line is its own
            return server_http_address(proc.pid)
        finally:
            proc.kill()
            proc.wait()

    assert address("--http-port=8123", "--http-address=0.0.0.0") == ("127.0.0.1", 8123)
    assert address("--http-port", "9000", "--http-address", "10.1.2.3") == ("10.1.2.3", 9000)
    assert address() == ("127.0.0.1", 8000)  # Triton's defaults
    assert address("--allow-http=false", "--http-port=8123") is None


def test_shutdown_ends_open_and_new_streams_with_a_final_response(engine):
    loop = ResponseLoop(engine, gauge_s=0.01)
    loop.start()
    running, queued = Recorder(), Recorder()
    submit(loop, engine, "running", "long text " * 5, running, max_tokens=7000, seed=3)
    assert wait_until(lambda: running.sent)
    engine.max_batch = 1  # the next one stays queued
    submit(loop, engine, "queued", "queued text", queued, max_tokens=7000)
    loop.request_shutdown()
    late = Recorder()
    loop.add(Stream("late", late, "pcm16", time.monotonic(), 24000))  # arrives while the server stops
    for rec in (running, queued, late):
        assert rec.done.wait(5)
        out, error, final = rec.sent[-1]
        assert error is None and final and out["FINISH_REASON"][0] == b"shutdown"
        assert sum(f for _, _, f in rec.sent) == 1
    assert wait_until(lambda: engine.stats().kv_pages_used == 0 and engine.stats().queued == 0)
    loop.stop()


def wait_until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_a_text_models_reply_text_goes_in_responses_of_its_own_in_order_with_the_audio():
    """TEXT events become responses with TEXT_OUT and no audio, CHUNK_INDEX the next audio chunk's; every response
    of a text model carries TEXT_OUT (empty on audio) and the front model's encoding keeps it; a model without
    text output sends no TEXT_OUT at all."""
    now = [0.0]
    loop = ResponseLoop(engine=None, clock=lambda: now[0])
    rec, plain = Recorder(), Recorder()
    loop._handle(_Add(Stream("r", rec, "pcm16", 0.0, 1000, text_output=True)))
    loop._handle(_Add(Stream("p", plain, "pcm16", 0.0, 1000)))
    chunk = np.full(100, 0.25, np.float32)
    for event in (Event("r", EventKind.TEXT, text="Hel"), Event("r", EventKind.TEXT, text="lo "),
                  Event("r", EventKind.AUDIO, audio=chunk), Event("r", EventKind.TEXT, text="there"),
                  Event("r", EventKind.AUDIO, audio=chunk), Event("r", EventKind.FINISHED, finish_reason="stop"),
                  Event("p", EventKind.AUDIO, audio=chunk)):
        loop._handle(event)
    got = [(o["TEXT_OUT"][0], o["AUDIO"].size, int(o["CHUNK_INDEX"][0]), bool(o["FINAL"][0])) for o, _, _ in rec.sent]
    assert got == [(b"Hel", 0, 0, False), (b"lo ", 0, 0, False), (b"", 100, 0, False), (b"there", 0, 1, False),
                   (b"", 100, 1, False), (b"", 0, 2, True)]
    encoded = audio_encoding.client_outputs(rec.sent[0][0])
    assert encoded["TEXT_OUT"][0] == b"Hel" and encoded["AUDIO"][0] == b""
    assert "TEXT_OUT" not in plain.sent[0][0] and "TEXT_OUT" not in audio_encoding.client_outputs(plain.sent[0][0])


def test_late_chunks_follow_the_listener_model():
    now = [0.0]
    metrics = Metrics()
    loop = ResponseLoop(engine=None, metrics=metrics, clock=lambda: now[0])
    rec = Recorder()
    loop._handle(_Add(Stream("r", rec, "fp32", 0.0, 1000)))
    chunk = np.zeros(100, np.float32)  # 0.1 s each
    for t in (0.5, 0.55, 0.65, 0.9):  # first audio at 0.5 s; 0.1 s of audio per chunk
        now[0] = t
        loop._handle(Event("r", EventKind.AUDIO, audio=chunk))
    assert metrics.ttfa == [0.5]
    assert metrics.late == 1  # only the chunk at 0.9 s: 0.3 s audio sent, 0.4 s elapsed


def test_cancel_channel_round_trip():
    got = []
    listener = CancelListener(got.append)
    sid = listener.stream_id("req-1")
    assert send_cancel(sid)
    deadline = time.monotonic() + 2
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    listener.close()
    assert got == ["req-1"]
    assert not send_cancel(sid)  # instance gone: no exception
    assert not send_cancel("garbage")


def test_the_launcher_finds_its_servers_engine_instances_and_shuts_them_down():
    shutdowns = []
    listener = CancelListener(lambda rid: None, lambda: shutdowns.append(1))  # named after our parent process
    try:
        assert listener.address in server_listeners(os.getppid())
        assert listener.address not in server_listeners(os.getpid())
        assert send_shutdown(os.getppid()) >= 1
        assert wait_until(lambda: shutdowns)
    finally:
        listener.close()


# ---------------------------------------------------------------- settings and launcher


def test_instance_settings_split_glue_and_engine_options():
    params = {"checkpoint": "/ckpt", "codec": "", "default_checkpoint": "x:y", "engine_loader": "voxbackend:load",
              "device": "auto", "kv_pages": "128", "max_queue": ""}
    s = instance_settings(params)
    assert (s.checkpoint, s.codec) == ("/ckpt", None)
    assert s.engine_options == {"device": "cpu", "kv_pages": "128"}  # auto -> cpu here; empty -> engine default
    assert instance_settings(params, "GPU", 3).engine_options["device"] == "cuda:3"
    with pytest.raises(ValueError, match="unknown engine parameters"):
        instance_settings({**params, "kv_pagez": "1"})


def test_launcher_prepares_a_backend_dir_with_this_pythons_stub(tmp_path: Path):
    from voxbackend.deploy.server import find_tritonserver, prepare_backend_dir, server_env

    install = find_tritonserver()
    assert install.binary.is_file()
    backends = prepare_backend_dir(install, tmp_path / "backends")
    if install.stub is not None:
        assert (backends / "python" / "triton_python_backend_stub").is_file()
        assert (backends / "python" / "libtriton_python.so").exists()
    env = server_env(install, {"PATH": "/usr/bin"})
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)


def test_engine_errors_name_the_tensor_the_client_sent():
    e = fields.for_client(InvalidRequest("max_tokens is 100000; this server allows at most 1200 for orpheus",
                                         field="max_tokens"))
    assert str(e).startswith("MAX_TOKENS is 100000") and e.field == "max_tokens"
    untouched = InvalidRequest("prompt is empty", field="prompt_ids")
    assert fields.for_client(untouched) is untouched


def test_fake_engine_pages_grow_get_preempted_and_end_free():
    """The fake follows the real engine's page accounting: requests that together outgrow a small pool are preempted
    and resumed (their audio unchanged), cancellations reach queued and preempted ones, and every page comes back."""
    rng = random.Random(0)
    engine = FakeEngine(kv_pages=30, step_s=0.001)
    engine.start()
    audio: dict[str, list] = {}
    finals: dict[str, str] = {}
    lock = threading.Lock()

    def on_event(e):
        with lock:
            if e.kind is EventKind.AUDIO:
                audio.setdefault(e.request_id, []).append(e.audio)
            else:
                finals[e.request_id] = e.finish_reason or e.error

    requests = {}
    try:
        for i in range(40):
            prompt = [1000] + [rng.randrange(97, 120) for _ in range(rng.randrange(5, 200))]
            sampling = SamplingParams(max_tokens=rng.randrange(7, 200), seed=i)
            requests[engine.submit(prompt, sampling, on_event, request_id=f"r{i}")] = (prompt, sampling)
            if i % 7 == 3:
                engine.cancel(f"r{i - 1}")
        deadline = time.monotonic() + 30
        while len(finals) < len(requests) and time.monotonic() < deadline:
            time.sleep(0.02)
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert len(finals) == len(requests)
    assert stats.preemptions > 0 and stats.kv_pages_used == 0 and stats.running == 0 and stats.queued == 0
    assert sorted(set(finals.values())) == ["cancelled", "length"]
    for rid, reason in finals.items():
        if reason == "length":
            prompt, sampling = requests[rid]
            want = fake_audio(prompt, sampling.validated())
            assert len(audio.get(rid, [])) == len(want) and all(map(np.array_equal, audio[rid], want)), rid


def test_a_default_checkpoint_is_found_without_a_child_interpreter_once_built(tmp_path, monkeypatch):
    """Every stub resolves its model's default checkpoint; the child interpreter that builds or finds it runs once
    per cache, later stubs read the note it left (while the folders exist)."""
    from voxbackend.triton import loading

    built = tmp_path / "model"
    built.mkdir()
    calls = []
    monkeypatch.setenv("VOXBACKEND_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loading, "call_in_child", lambda spec: calls.append(spec) or (str(built), None))
    params = {"default_checkpoint": f"tests.nowhere:{tmp_path.name}"}
    assert loading.resolve_checkpoint(params) == (str(built), None)
    assert loading.resolve_checkpoint(params) == (str(built), None)
    assert len(calls) == 1
    monkeypatch.setenv("VOXBACKEND_CACHE", str(tmp_path / "another cache"))  # another cache: built again
    loading.resolve_checkpoint(params)
    built.rmdir()  # the folder went away: found again by the child
    monkeypatch.setenv("VOXBACKEND_CACHE", str(tmp_path / "cache"))
    loading.resolve_checkpoint(params)
    assert len(calls) == 3
