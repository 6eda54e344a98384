"""Text streaming with the real tiny Qwen3-TTS through tritonserver: the committed qwen3_tts_text_stream folder, on
the run's shared committed-repository server (tests/conftest.py).

Greedy (temperature 0, repetition penalty 1: the talker and its code predictor), the same text sent whole through
the `qwen3_tts` model and in pieces with delays through `qwen3_tts_text_stream` gives the same audio: the
request waits, without tts_eos, whenever the pieces run behind. Audio is compared up to 4 PCM16 steps (float
rounding of differently batched codec windows, as in the API tests) and must have the same length.
"""
from __future__ import annotations

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
from tests.triton_util import COMMITTED  # noqa: E402
from tests import triton_util  # noqa: E402
from voxbackend.deploy import configs  # noqa: E402

MODEL = "qwen3_tts_text_stream"
GREEDY = {"TEMPERATURE": 0.0, "REPETITION_PENALTY": 1.0, "SEED": 3, "MAX_TOKENS": 60}
TEXT = "Hello there, how are you doing today? I'm fine, thanks."
PIECES = ["Hel", "lo the", "re, how", " are you do", "ing today? I'", "m fine, th", "anks."]
PCM16_STEPS = 4 / 32767


pytestmark = pytest.mark.xdist_group(COMMITTED)


@pytest.fixture(scope="module")
def server(committed_server):
    assert (configs.DEFAULT_REPOSITORY / MODEL / "config.pbtxt").is_file(), "qwen3_tts has text_streaming"
    return committed_server


def batched_string(name: str, value: str):
    import tritonclient.grpc as grpcclient

    t = grpcclient.InferInput(name, [1, 1], "BYTES")
    t.set_data_from_numpy(np.array([[value.encode()]], dtype=np.object_))
    return t


def metric(server, name: str) -> float:
    return triton_util.metric(server, name, model=MODEL)


def test_pieces_with_delays_give_the_whole_texts_audio(server):
    whole = stream_request(server.grpc_url, "qwen3_tts", make_inputs(TEXT, **GREEDY), timeout=120)
    assert whole.error is None and whole.chunks, whole.error
    pieces = stream_text_pieces(server.grpc_url, MODEL, PIECES, make_inputs(None, batched=True, **GREEDY),
                                piece_delay=0.4, timeout=120)
    assert pieces.error is None, pieces.error
    # a random-weight model may stop (EOS or MAX_TOKENS) before the text ends, then at the same step both ways;
    # pieces sent after that are refused, naming TEXT
    assert all("InvalidRequest: TEXT" in e and "finished" in e for e in pieces.piece_errors), pieces.piece_errors
    assert pieces.finish_reason == whole.finish_reason and pieces.audio.size == whole.audio.size
    np.testing.assert_allclose(pieces.audio, whole.audio, atol=PCM16_STEPS)
    # a piece (2-3 ids) lasts the tiny model well under 0.4 s: the request really waited for text, mid-stream
    assert np.diff(pieces.arrivals).max() > 0.25


def test_bad_inputs_are_refused_naming_the_field(server):
    bad_voice = stream_text_pieces(server.grpc_url, MODEL, ["Hello ", "there."],
                                   make_inputs(None, "nobody", batched=True, **GREEDY), timeout=60)
    assert bad_voice.error and bad_voice.error.startswith("InvalidRequest: VOICE"), bad_voice.error
    bad_language = stream_text_pieces(server.grpc_url, MODEL, ["Hello ", "there."],
                                      [*make_inputs(None, batched=True, **GREEDY),
                                       batched_string("LANGUAGE", "klingon")], timeout=60)
    assert bad_language.error and bad_language.error.startswith("InvalidRequest: LANGUAGE"), bad_language.error


CLIENT_THEN_DIE = """
import sys, time
sys.path.insert(0, {root!r})
import tritonclient.grpc as g
from voxbackend.stream_client import make_inputs
c = g.InferenceServerClient({url!r})
c.start_stream(callback=lambda r, e: None)
c.async_stream_infer({model!r}, make_inputs("Hello there, how are you ", batched=True, TEMPERATURE=0.0, MAX_TOKENS=400),
                     request_id="gone", sequence_id=77, sequence_start=True, enable_empty_final_response=True)
print("sent", flush=True)
time.sleep(600)
"""


def test_a_killed_client_without_end_frees_its_pages_while_another_stream_plays(server):
    proc = subprocess.Popen([sys.executable, "-c", CLIENT_THEN_DIE.format(root=str(ROOT), url=server.grpc_url,
                                                                          model=MODEL)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "sent"
        deadline = time.monotonic() + 30
        while metric(server, "voxbackend_kv_pages_used") == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metric(server, "voxbackend_kv_pages_used") > 0
        os.kill(proc.pid, signal.SIGKILL)
        other = stream_text_pieces(server.grpc_url, MODEL, ["Hello ", "there, ", "how are you?"],
                                   make_inputs(None, batched=True, **GREEDY), piece_delay=0.1, timeout=120)
        assert other.error is None and other.chunks
        deadline = time.monotonic() + 10
        while metric(server, "voxbackend_kv_pages_used") > 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metric(server, "voxbackend_kv_pages_used") == 0
    finally:
        proc.kill()
        proc.wait()


def test_the_client_script_with_pieces(server, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "clients.tts_stream", "--url", server.grpc_url, "--model", MODEL,
         "--text-pieces", "|".join(PIECES), "--piece-delay", "0.1", "--temperature", "0", "--repetition-penalty", "1",
         "--seed", "3", "--max-tokens", "40", "--out", str(tmp_path / "p.wav")],
        cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert re.search(r"TTFA \d+ ms .* TTFA from the first piece", done.stdout), done.stdout
    assert (tmp_path / "p.wav").stat().st_size > 44
