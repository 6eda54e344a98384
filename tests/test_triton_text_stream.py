"""Text streaming through a real tritonserver, with the weights-free fake engine (its text-streaming model).

`orpheus_text_stream` is rendered here by the project's generator for a kind that has no text streaming itself,
with the fake's loaders; everything between the client and the Engine API is the real thing: Triton's sequence
batcher, the controls, the null requests of empty slots, cancellation, the idle timeout.
"""
from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from voxbackend.stream_client import make_inputs, stream_request, stream_text_pieces  # noqa: E402
from tests.triton_util import serve  # noqa: E402
from tests import triton_util  # noqa: E402
from voxbackend.deploy import configs  # noqa: E402

MODEL = "orpheus_text_stream"
IDLE_S = 1.5
FAKE = {
    "checkpoint": "unused",
    "engine_loader": "voxbackend.testing.fake_engine:load_streaming",
    "frontend_loader": "voxbackend.testing.fake_engine:load_streaming_frontend",
    "kv_pages": "4096",
    "max_batch": "4",  # 4 sequence slots per instance
    "instances": "2",  # replicas: two engines per model, Triton spreading requests and keeping each sequence on one
}
TEXT = "Hello there, how are you doing today? I'm fine, thanks; we'll see you tomorrow."
PIECES = ["Hel", "lo the", "re, how", " are you do", "ing today? I'", "m fine, thanks;", " we'll see you", " tomorrow."]


@pytest.fixture(scope="module")
def server(tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setattr(configs, "TEXT_STREAM_IDLE_US", int(IDLE_S * 1e6))
    repo = configs.write_repository(tmp_path_factory.mktemp("repo") / "model_repository", FAKE, models=["orpheus"])
    served = dataclasses.replace(configs.select(["orpheus"])[0], text_streaming=True)
    (repo / MODEL / "1").mkdir(parents=True)
    (repo / MODEL / "config.pbtxt").write_text(configs.render_text_stream(served, served.params(FAKE)))
    for path, text in configs.text_stream_files(served).items():
        (repo / path).write_text(text)
    yield from serve(repo, tmp_path_factory.mktemp("triton"), stop_within_s=30)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def metric(server, name: str) -> float:
    return triton_util.metric(server, name, model=MODEL)


def options(seed=5, **more):
    return make_inputs(None, batched=True, SEED=seed, **more)


def test_pieces_with_delays_give_the_audio_of_the_whole_text_through_the_front_model(server):
    whole = stream_request(server.grpc_url, "orpheus", make_inputs(TEXT, SEED=5), timeout=60)
    assert whole.error is None and whole.finish_reason == "stop" and whole.chunks
    pieces = stream_text_pieces(server.grpc_url, MODEL, PIECES, options(), piece_delay=0.08, timeout=60)
    assert pieces.error is None and not pieces.piece_errors, (pieces.error, pieces.piece_errors)
    assert pieces.finish_reason == "stop" and pieces.seed == 5 and pieces.sample_rate == 24000
    np.testing.assert_array_equal(pieces.audio, whole.audio)
    # the first piece is inside a word: audio starts once the second piece completes "Hello"
    assert pieces.ttfa_s is not None and pieces.ttfa_s >= 0.08


def test_concurrent_sequences_on_one_stream_each_get_their_own_text(server):
    import concurrent.futures as cf

    texts = [f"Stream number {i} says hello to you, friend number {i}." for i in range(10)]  # > 2 x 4 slots: queue
    with cf.ThreadPoolExecutor(10) as pool:
        outs = list(pool.map(lambda t: stream_text_pieces(
            server.grpc_url, MODEL, re.findall(r".{1,7}", t), options(seed=9), piece_delay=0.03, timeout=60), texts))
    for t, out in zip(texts, outs):
        ref = stream_request(server.grpc_url, "orpheus", make_inputs(t, SEED=9), timeout=60)
        assert out.error is None and out.finish_reason == "stop"
        np.testing.assert_array_equal(out.audio, ref.audio)


def test_replicas_shared_the_sequences_and_the_streams(server):
    """After the concurrent test: both instances of the text-stream model and of the front model served (each
    piece of a sequence reached the engine holding it, or its audio above would differ), per-instance metrics."""
    for model in (MODEL, "orpheus"):
        served = {re.search(r'instance="([^"]+)"', labels)[1] for labels, value in
                  triton_util.metric_values(server, "voxbackend_requests_finished_total").items()
                  if f'model="{model}"' in labels and value > 0}
        assert served == {f"{model}_0_0", f"{model}_0_1"}, (model, served)


def test_bad_pieces_are_refused_naming_the_field(server):
    import tritonclient.grpc as grpcclient
    import queue

    got: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))

    def send(request_id, text, seq, start=False, end=False, extra=()):
        client.async_stream_infer(MODEL, [*make_inputs(text, batched=True), *extra], request_id=request_id,
                                  sequence_id=seq, sequence_start=start, sequence_end=end,
                                  enable_empty_final_response=True)

    def errors(n, timeout=10.0):
        out, deadline = [], time.monotonic() + timeout
        while len(out) < n and time.monotonic() < deadline:
            try:
                result, error = got.get(timeout=0.2)
            except queue.Empty:
                continue
            if error is not None:
                out.append(str(error))
        return out

    try:
        send("a0", "Hello there, ", 501, start=True, extra=options())
        send("a1", "how are", 501, extra=make_inputs(None, "leo", batched=True))  # VOICE on a later piece
        assert errors(1) == ["[request id: a1] InvalidRequest: VOICE is read from the first piece of a sequence "
                             "only (START); later pieces carry TEXT alone"]
        wrong = grpcclient.InferInput("TEXT", [1, 1], "FP32")
        wrong.set_data_from_numpy(np.array([[1.0]], np.float32))
        client.async_stream_infer(MODEL, [wrong], request_id="a2", sequence_id=501)
        assert re.match(r"\[request id: a2\] inference input 'TEXT' data-type is 'FP32', but model "
                        rf"'{MODEL}' expects 'BYTES'", errors(1)[0])
        send("a3", " you?", 501, end=True)
        send("a4", "after the end", 501)
        send("z0", "never started", 502)
        refused = errors(2)
        assert all("must specify the START flag on the first request of the sequence" in e for e in refused)
        assert {re.search(r"sequence (\d+)", e).group(1) for e in refused} == {"501", "502"}
    finally:
        client.stop_stream(cancel_requests=False)
        client.close()


CLIENT_THEN_HANG = """
import sys, time
sys.path.insert(0, {root!r})
import tritonclient.grpc as g
from voxbackend.stream_client import make_inputs
c = g.InferenceServerClient({url!r})
c.start_stream(callback=lambda r, e: None)
c.async_stream_infer({model!r}, make_inputs("Hello there, how are you ", batched=True, SEED=1, MAX_TOKENS=7000),
                     request_id="gone", sequence_id={seq}, sequence_start=True, enable_empty_final_response=True)
print("sent", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("how", ["killed", "silent"])
def test_a_sequence_without_end_is_cancelled_and_frees_its_pages_while_another_plays(server, how):
    """killed: the client process dies (its gRPC stream breaks, Triton cancels); silent: it lives on but sends
    nothing for longer than max_sequence_idle_microseconds."""
    script = CLIENT_THEN_HANG.format(root=str(ROOT), url=server.grpc_url, model=MODEL, seq=700 + (how == "silent"))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "sent"
        deadline = time.monotonic() + 10
        while metric(server, "voxbackend_kv_pages_used") == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        held = metric(server, "voxbackend_kv_pages_used")
        assert held > 0
        if how == "killed":
            os.kill(proc.pid, signal.SIGKILL)
        # another utterance keeps streaming meanwhile, across the idle limit
        words = (TEXT + " ") * 2
        other = stream_text_pieces(server.grpc_url, MODEL, re.findall(r"\S+\s*", words), options(seed=2),
                                   piece_delay=(IDLE_S + 1.0) / 30, timeout=60)
        assert other.error is None and other.finish_reason == "stop" and other.chunks
        deadline = time.monotonic() + IDLE_S + 5
        while metric(server, "voxbackend_kv_pages_used") > 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metric(server, "voxbackend_kv_pages_used") == 0
        assert metric(server, "voxbackend_active_streams") == 0
    finally:
        proc.kill()
        proc.wait()


def test_the_client_script_end_to_end(server, tmp_path):
    import soundfile as sf

    run = lambda *args, **kw: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "clients.tts_stream", "--url", server.grpc_url, "--model", MODEL, "--seed", "5",
         *args], cwd=ROOT, capture_output=True, text=True, timeout=120, **kw)
    pieces = run("--text-pieces", "|".join(PIECES), "--piece-delay", "0.05", "--out", str(tmp_path / "p.wav"))
    assert pieces.returncode == 0, pieces.stderr
    assert re.search(r"TTFA \d+ ms .*finish stop .*seed 5 \| TTFA from the first piece", pieces.stdout)
    lines = run("--stdin", "--out", str(tmp_path / "s.wav"), input="Hello there,\nhow are you doing today?\n")
    assert lines.returncode == 0, lines.stderr
    whole = stream_request(server.grpc_url, "orpheus", make_inputs(TEXT, SEED=5), timeout=60)
    audio, rate = sf.read(tmp_path / "p.wav", dtype="float32")
    assert rate == 24000 and audio.size == whole.audio.size
    np.testing.assert_allclose(audio, whole.audio, atol=1.5 / 32767)  # the WAV is PCM16 too
    lined = stream_request(server.grpc_url, "orpheus", make_inputs("Hello there,\nhow are you doing today?\n",
                                                                   SEED=5), timeout=60)
    assert sf.read(tmp_path / "s.wav", dtype="float32")[0].size == lined.audio.size
