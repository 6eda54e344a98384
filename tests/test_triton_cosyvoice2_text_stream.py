"""CosyVoice2 text input streaming through tritonserver: `cosyvoice2_text_stream` as the generator renders it, on
the tiny checkpoint with the fill token reachable (tests/test_cosyvoice2_bistream.py: the engine's bistream gives
upstream inference_bistream's tokens for the same pieces). Greedy, the same text pieces sent back to back and
0.3 s apart give the same audio: the positions depend on the pieces only, not on when they arrive. Audio is
compared up to 4 PCM16 steps, as in the other Triton tests.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from voxbackend.stream_client import make_inputs, stream_text_pieces  # noqa: E402
from tests.test_cosyvoice2_bistream import write_bistream_checkpoint  # noqa: E402
from tests.triton_util import serve  # noqa: E402
from voxbackend.deploy import configs  # noqa: E402

MODEL = "cosyvoice2_text_stream"
GREEDY = {"TEMPERATURE": 0.0, "SEED": 3, "MAX_TOKENS": 400}
PIECES = ["Hel", "lo the", "re, how", " are you do", "ing today? The qu", "ick brown fox jumps", " over the dog."]
PCM16_STEPS = 4 / 32767


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = write_bistream_checkpoint(tmp_path_factory.mktemp("ckpt"))
    repo = configs.write_repository(tmp_path_factory.mktemp("repo") / "model_repository",
                                    {"checkpoint": str(ckpt), "kv_pages": "512", "max_batch": "4"},
                                    models=["cosyvoice2"])
    assert (repo / MODEL / "config.pbtxt").is_file(), "cosyvoice2 has text_streaming: the generator renders it"
    yield from serve(repo, tmp_path_factory.mktemp("triton"), stop_within_s=30)


def test_pieces_back_to_back_and_with_delays_give_the_same_audio(server):
    inputs = make_inputs(None, batched=True, **GREEDY)
    fast = stream_text_pieces(server.grpc_url, MODEL, PIECES, inputs, piece_delay=0.0, timeout=240)
    slow = stream_text_pieces(server.grpc_url, MODEL, PIECES, inputs, piece_delay=0.3, timeout=240)
    for out in (fast, slow):
        assert out.error is None and not out.piece_errors, (out.error, out.piece_errors)
        assert out.finish_reason == "stop"  # the end id came after the text ended, not MAX_TOKENS
    assert fast.audio.size == slow.audio.size and 0.01 < np.std(fast.audio)
    np.testing.assert_allclose(slow.audio, fast.audio, atol=PCM16_STEPS)


def test_a_bad_voice_is_refused_naming_the_field(server):
    out = stream_text_pieces(server.grpc_url, MODEL, ["Hello ", "there."],
                             make_inputs(None, "nobody", batched=True, **GREEDY), timeout=60)
    assert out.error and out.error.startswith("InvalidRequest: VOICE"), out.error
