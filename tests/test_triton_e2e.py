"""End to end against a real tritonserver on loopback, serving the committed model_repository unchanged.

The server is started the way Triton users start it (the committed configs, no checkpoint configured), so
the engine model builds the tiny default checkpoint itself (into the test run's VOXBACKEND_CACHE); the reference
engine in this process then loads that same checkpoint. The server is the run's shared committed-repository
server (tests/conftest.py), which the csm, qwen3_tts, cosyvoice2 and Qwen3-TTS text-stream modules use too.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import soundfile as sf
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tritonclient.grpc as tritonclient  # noqa: E402

from voxbackend.stream_client import StreamOutcome, make_inputs, stream_request  # noqa: E402
from tests.triton_util import COMMITTED, assert_matches, metric, metric_values, run_concurrently  # noqa: E402


MAX_TOKENS = 63  # 9 Orpheus frames: a handful of chunks per stream keeps 2-core runs quick
# The tiny random model's next-token distribution is nearly flat over 4096 codes, so with the default top_p
# a float-rounding difference between batch compositions flips a sampled token about once in 4000 (seen
# in-process, without Triton). top_k=8 keeps real sampling, seeded per request, without near-ties.
TOP_K = 8
TEXTS = [
    "Hello there, how are you doing today?", "The quick brown fox jumps over the lazy dog.",
    "A streaming server sends the first audio chunk as soon as it is ready.", "Good morning! Good evening!",
    "Please read this sentence slowly and clearly.", "Numbers like one, two, three are easy to say.",
    "The weather this morning was cold and grey.", "She said that the train would arrive at seven.",
    "When the music stopped, everyone turned around.", "It is important to test every part of a system.",
    "I think that we should go for a walk in the park.", "The children laughed and played in the garden.",
    "Can you tell me the way to the library?", "Speech models turn text into sound.",
    "Thank you for asking, I am doing well.", "See you tomorrow, my friend.",
]
VOICES = ["tara", "leo", None, "mia"]


pytestmark = pytest.mark.xdist_group(COMMITTED)


@pytest.fixture(scope="module")
def server(committed_server):
    return committed_server


@pytest.fixture(scope="module")
def reference(server):
    """An in-process engine on the checkpoint the server built: Engine.synthesize, memoised."""
    import voxbackend
    from voxbackend.models.orpheus.tiny import ensure_default_checkpoint

    model_dir, codec_dir = ensure_default_checkpoint()  # the server's build (the run's cache)
    engine = voxbackend.load(model_dir, codec_dir)
    engine.start()
    memo: dict[tuple, np.ndarray] = {}

    def synthesize(text: str, voice: str | None, seed: int, max_tokens: int = MAX_TOKENS) -> np.ndarray:
        key = (text, voice, seed, max_tokens)
        if key not in memo:
            sampling = dataclasses.replace(engine.model.default_sampling(), max_tokens=max_tokens, seed=seed,
                                           top_k=TOP_K)
            audio, rate = engine.synthesize(text, voice, sampling)
            assert rate == 24000
            memo[key] = audio
        return memo[key]

    yield synthesize
    engine.shutdown()


def wait_for(predicate, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


# ---------------------------------------------------------------- streams match the engine


@pytest.mark.parametrize("model", ["orpheus", "orpheus_engine"])
def test_16_concurrent_streams_match_engine_synthesize(server, reference, model):
    formats = ["pcm16", "fp32"] if model == "orpheus" else ["fp32"]  # the engine sends float samples
    jobs = []
    for i, text in enumerate(TEXTS):
        fmt = formats[i % len(formats)]
        inputs = make_inputs(text, VOICES[i % 4], fmt, MAX_TOKENS=MAX_TOKENS, SEED=100 + i, TOP_K=TOP_K)
        jobs.append(lambda inputs=inputs, fmt=fmt, i=i: stream_request(
            server.grpc_url, model, inputs, fmt, timeout=240, request_id=f"s{i}"))
    outs = run_concurrently(jobs)
    for i, out in enumerate(outs):
        assert_matches(out, reference(TEXTS[i], VOICES[i % 4], 100 + i), formats[i % len(formats)],
                       f"{model} stream {i}")


@pytest.mark.parametrize("model", ["orpheus", "orpheus_engine"])
def test_an_unseeded_request_returns_the_seed_that_reproduces_its_audio(server, model):
    inputs = dict(MAX_TOKENS=MAX_TOKENS, TEMPERATURE=0.0)  # greedy LM: only the codec noise needs the seed
    first = stream_request(server.grpc_url, model, make_inputs(TEXTS[5], None, "fp32", **inputs), "fp32", timeout=240)
    assert first.error is None and first.chunks, first.error
    assert isinstance(first.seed, int) and 0 <= first.seed < 2**31, first.seed
    again = stream_request(server.grpc_url, model, make_inputs(TEXTS[5], None, "fp32", SEED=first.seed, **inputs),
                           "fp32", timeout=240)
    assert again.error is None and again.seed == first.seed
    # equal up to float rounding: the codec may batch this stream's windows differently in the two runs (the
    # online policy lets windows pile up until the listener needs them); a wrong seed changes the noise by ~0.1
    np.testing.assert_allclose(again.audio, first.audio, rtol=0, atol=1e-5)


# ---------------------------------------------------------------- bad input


BAD_INPUTS = {
    "missing TEXT": (dict(text=None), "TEXT is required"),
    "empty TEXT": (dict(text="   "), "TEXT is empty"),
    "non-UTF-8 TEXT": (dict(text=b"\xff\xfe\xfd"), "not valid UTF-8"),
    "text over the limit": (dict(text="word " * 2000), "limit"),
    "unknown voice": (dict(text="hello", voice="nobody"), "unknown voice"),
    "temperature < 0": (dict(text="hello", TEMPERATURE=-0.5), "TEMPERATURE must be >= 0"),
    "top_p = 0": (dict(text="hello", TOP_P=0.0), "TOP_P must be in"),
    "top_k < 0": (dict(text="hello", TOP_K=-1), "TOP_K must be >= 0"),
    "min_p > 1": (dict(text="hello", MIN_P=1.5), "MIN_P must be in"),
    "repetition_penalty = 0": (dict(text="hello", REPETITION_PENALTY=0.0), "REPETITION_PENALTY must be in"),
    "max_tokens = 0": (dict(text="hello", MAX_TOKENS=0), "MAX_TOKENS must be >= 1"),
    "negative seed": (dict(text="hello", SEED=-1), "SEED must be in"),
    "unknown audio format": (dict(text="hello", audio_format="mp3"), "AUDIO_FORMAT must be one of"),
}


def bad_cases():
    for name, (kw, message) in BAD_INPUTS.items():
        kw = dict(kw)
        yield name, make_inputs(kw.pop("text"), kw.pop("voice", None), kw.pop("audio_format", None), **kw), message


def _raw_inputs(kind: str) -> list:
    """Inputs a typed client could not build: wrong dtype or shape (Triton itself rejects these)."""
    text = tritonclient.InferInput("TEXT", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"hello"], dtype=np.object_))
    if kind == "dtype":
        bad = tritonclient.InferInput("TEMPERATURE", [1], "FP64")
        bad.set_data_from_numpy(np.array([0.5], np.float64))
    else:
        bad = tritonclient.InferInput("TEXT", [2], "BYTES")
        bad.set_data_from_numpy(np.array([b"a", b"b"], dtype=np.object_))
        return [bad]
    return [text, bad]


def test_bad_inputs_get_one_final_error_while_a_long_stream_finishes_intact(server, reference):
    long_text, long_seed, long_tokens = TEXTS[2], 7, 420
    expected = reference(long_text, None, long_seed, long_tokens)
    long_out: list[StreamOutcome] = []
    t = threading.Thread(target=lambda: long_out.append(stream_request(
        server.grpc_url, "orpheus",
        make_inputs(long_text, None, "fp32", MAX_TOKENS=long_tokens, SEED=long_seed, TOP_K=TOP_K),
        "fp32", timeout=240)))
    t.start()
    time.sleep(0.5)
    failures = []
    for model in ("orpheus", "orpheus_engine"):
        cases = list(bad_cases()) + [("wrong dtype", _raw_inputs("dtype"), "data-type is 'FP64'"),
                  ("wrong shape", _raw_inputs("shape"), "unexpected shape")]
        for name, inputs, message in cases:
            out = stream_request(server.grpc_url, model, inputs, timeout=30, linger_s=0.2)
            if not (out.error and message in out.error and out.responses == 1 and out.late_responses == 0
                    and not out.chunks):
                failures.append(f"{model} / {name}: error={out.error!r} responses={out.responses} "
                                f"late={out.late_responses}")
    t.join(240)
    assert not failures, "\n".join(failures)
    assert long_out and long_out[0].arrivals[-1] > long_out[0].send_time + 0.5, "the long stream overlapped"
    assert_matches(long_out[0], expected, "fp32", "long stream")


# ---------------------------------------------------------------- cancellation


def finished_by_reason(server) -> dict[str, float]:
    return {k: v for k, v in metric_values(server, "voxbackend_requests_finished_total").items()
            if "orpheus" in k and v}


def test_cancelling_half_of_16_streams_leaves_the_rest_intact_and_frees_kv(server, reference):
    tokens = 1200  # Orpheus's most: a cancel that reaches the engine late (a loaded machine) still finds it running
    before = metric(server, "voxbackend_requests_finished_total", reason="cancelled")
    jobs = []
    for i in range(16):
        model = "orpheus" if i < 12 else "orpheus_engine"  # the front model path needs cancel_channel
        inputs = make_inputs(TEXTS[i], None, "fp32", MAX_TOKENS=tokens if i % 2 else MAX_TOKENS, SEED=300 + i,
                             TOP_K=TOP_K)
        jobs.append(lambda inputs=inputs, i=i, model=model: stream_request(
            server.grpc_url, model, inputs, "fp32", timeout=240, cancel_after_chunks=2 if i % 2 else None))
    outs = run_concurrently(jobs)
    for i, out in enumerate(outs):
        if i % 2:
            assert out.error is None and out.finish_reason == "client-cancelled", (i, out.error)
        else:
            assert_matches(out, reference(TEXTS[i], None, 300 + i), "fp32", f"kept stream {i}")
    # the cancelled streams end as "cancelled" in the engine (with top_k=8 the tiny model practically never picks
    # end-of-speech, so none of them finishes its 1200 tokens first), and every KV page comes back. One of the 8
    # may run to its length instead: in about 1 run of 5 on a loaded 2-core machine one hang-up never showed in
    # the model's is_cancelled() (docs/reliability.md, "Cancellation")
    assert wait_for(lambda: metric(server, "voxbackend_requests_finished_total", reason="cancelled") - before
                    >= 7, timeout=45.0), f"cancellations lost: {finished_by_reason(server)}"
    assert wait_for(lambda: metric(server, "voxbackend_kv_pages_used") == 0
                    and metric(server, "voxbackend_active_streams") == 0, timeout=60.0), "KV pages or streams left"


def test_a_client_that_times_out_writes_what_it_got_and_the_server_frees_the_stream(server, tmp_path):
    """clients.tts_stream --timeout: the audio received is written and called partial, the exit is 1, and the
    hang-up frees the stream's pages within about a second (the model polls is_cancelled() every 0.1 s; the gauges
    are sampled every 0.25 s). 1200 tokens take 5.8 s in-process on an idle machine: a 3 s timeout cuts the
    stream after its first audio and before its end."""
    from clients.tts_stream import main as tts_stream_main

    out = tmp_path / "partial.wav"
    code = tts_stream_main(["--url", server.grpc_url, "--model", "orpheus", "--text", TEXTS[2], "--seed", "3",
                            "--top-k", str(TOP_K), "--max-tokens", "1200", "--timeout", "3", "--out", str(out)])
    left = time.monotonic()
    assert code == 1
    audio, rate = sf.read(out, dtype="float32")
    assert rate == 24000 and 0 < audio.size < 1200 / 7 * 2048  # some of the 1200 tokens' audio, not all
    assert wait_for(lambda: metric(server, "voxbackend_active_streams", model="orpheus") == 0
                    and metric(server, "voxbackend_kv_pages_used", model="orpheus") == 0, timeout=10.0)
    assert time.monotonic() - left < 3.0, "the stream outlived its client by more than the poll intervals"


# ---------------------------------------------------------------- metrics and perf_analyzer


def test_metrics_port_shows_the_custom_metrics(server):
    stream_request(server.grpc_url, "orpheus", make_inputs(TEXTS[0], MAX_TOKENS=MAX_TOKENS, SEED=1))
    labels = {"model": "orpheus_engine"}
    assert metric(server, "voxbackend_ttfa_seconds_count", **labels) >= 1
    ttfa_sum = metric(server, "voxbackend_ttfa_seconds_sum", **labels)
    assert 0 < ttfa_sum / metric(server, "voxbackend_ttfa_seconds_count", **labels) < 30
    assert metric_values(server, "voxbackend_late_chunks_total"), "late-chunk counter missing"
    assert metric(server, "voxbackend_requests_finished_total", reason="length") \
        + metric(server, "voxbackend_requests_finished_total", reason="stop") >= 1
    assert metric(server, "voxbackend_kv_pages_total", **labels) == 1024
    # gauges are sampled every 0.25 s: one sample may predate the request's admission (queued 1, pages 0)
    assert wait_for(lambda: metric(server, "voxbackend_kv_pages_used") == 0
                    and metric(server, "voxbackend_queued_requests") == 0)
    assert metric(server, "nv_inference_request_success", model="orpheus") >= 1  # Triton's own, alongside


def test_perf_analyzer_streams_against_the_front_model(server, tmp_path):
    from perf.perf_analyzer.parse import first_response_latencies, load_profile
    from voxbackend.cli import perf_analyzer_command

    pa, env = perf_analyzer_command()  # what `voxbackend perf-analyzer` runs
    probe = subprocess.run([pa], env=env, capture_output=True, text=True)
    assert "error while loading shared libraries" not in probe.stderr, (
        f"perf_analyzer cannot run: {probe.stderr.strip()} (apt-get install libb64-0d; "
        "pip install nvidia-cuda-runtime-cu12)")
    data = tmp_path / "input.json"
    # seeded: an unseeded random-weight stream can sample the stop token before its first window (no audio)
    data.write_text(json.dumps({"data": [{"TEXT": {"content": [t], "shape": [1]},
                                          "MAX_TOKENS": {"content": [MAX_TOKENS], "shape": [1]},
                                          "SEED": {"content": [11 + i], "shape": [1]}}
                                         for i, t in enumerate(TEXTS[:4])]}))
    csv, export = tmp_path / "pa.csv", tmp_path / "profile.json"
    requests = 6
    # --request-count: exactly that many requests, one measurement, no stability search (which made the run
    # depend on the machine's load: it failed 1 run in 5 on a busy 2-core machine)
    cmd = [sys.executable, "-m", "voxbackend.cli", "perf-analyzer", "-m", "orpheus", "-u", server.grpc_url,
           "-i", "grpc", "--streaming", "--input-data", str(data), "--concurrency-range", "2",
           "--request-count", str(requests), "-f", str(csv), "--profile-export-file", str(export)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Throughput" in done.stdout and "Avg latency" in done.stdout
    assert csv.is_file() and "Concurrency" in csv.read_text()
    profile = load_profile(export)
    sent = [r for e in profile["experiments"] for r in e["requests"]]
    assert len(sent) >= requests
    for r in sent:  # every stream: several responses (chunks, then the final one), in time order
        times = r["response_timestamps"]
        assert len(times) >= 2 and times == sorted(times) and times[0] > r["timestamp"], r
    ttfa = first_response_latencies(profile)[2.0]  # the docs' recipe for first-response latency
    assert len(ttfa) == len(sent) and all(0 < t < 240 for t in ttfa)
