"""A Qwen3-TTS Base (voice cloning) deployment end to end: a real tritonserver on loopback serving the qwen3_tts
folders that the generator writes with `qwen3_tts.checkpoint` set to a tiny Base checkpoint. Streams cloned from
REFERENCE_AUDIO (WAV bytes at several rates) + REFERENCE_TEXT, concurrently, equal Engine.synthesize with the same
inputs in this process; the reference's codes and x-vector are computed in the preprocess and reach the engine as
the tensors X_VECTOR and REFERENCE_CODES. Bad inputs are refused naming the tensor.
"""
from __future__ import annotations

import dataclasses
import io
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import soundfile as sf  # noqa: E402
import tritonclient.grpc as tritonclient  # noqa: E402

from clients.tts_stream import main as tts_stream_main  # noqa: E402
from voxbackend.stream_client import make_inputs, stream_request, stream_text_pieces  # noqa: E402
from voxbackend.models.cosyvoice2.tiny import voice_clip  # noqa: E402
from voxbackend.models.qwen3_tts.tiny import write_tiny_qwen3_tts  # noqa: E402
from voxbackend.deploy import configs  # noqa: E402
from tests.triton_util import assert_matches, run_concurrently, serve  # noqa: E402

MAX_TOKENS = 10  # frames of 80 ms
RATE = 24000


def wav(seconds: float, rate: int, seed: int) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, voice_clip(seconds, rate, seed), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def _bytes_input(name: str, value: bytes):
    t = tritonclient.InferInput(name, [1], "BYTES")
    t.set_data_from_numpy(np.array([value], dtype=np.object_))
    return t


@dataclasses.dataclass
class Case:
    text: str
    audio: bytes | None = None
    transcript: str | None = None
    voice: str | None = None
    language: str | None = None
    fmt: str = "fp32"
    seed: int = 0

    def inputs(self) -> list:
        inputs = make_inputs(self.text, self.voice, self.fmt, reference_audio=self.audio,
                             reference_text=self.transcript, MAX_TOKENS=MAX_TOKENS, SEED=self.seed)
        if self.language is not None:
            inputs.append(_bytes_input("LANGUAGE", self.language.encode()))
        return inputs


CASES = [
    Case("Hello there, how are you doing today?", wav(1.0, 24000, 1), "I am calling about the flat.", seed=100),
    Case("The quick brown fox jumps over the lazy dog.", wav(0.6, 16000, 2), "Hello, who is this?",
         language="english", seed=101, fmt="pcm16"),  # resampled to 24 kHz
    Case("Good morning!", wav(2.5, 44100, 3), "Numbers like one, two and three are read aloud.", seed=102),
    Case("See you tomorrow, my friend.", wav(1.0, 24000, 1), "I am calling about the flat.", seed=103),
]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return write_tiny_qwen3_tts(tmp_path_factory.mktemp("qwen3_tts_base"), variant="base", seed=2)


@pytest.fixture(scope="module")
def server(tmp_path_factory, base):
    repo = configs.write_repository(tmp_path_factory.mktemp("repo") / "models", {"qwen3_tts.checkpoint": str(base)},
                                    models=["qwen3_tts"])
    yield from serve(repo, tmp_path_factory.mktemp("triton"))


@pytest.fixture(scope="module")
def reference(server, base):
    import voxbackend

    engine = voxbackend.load(base).start()

    def synthesize(case: Case) -> np.ndarray:
        sampling = dataclasses.replace(engine.model.default_sampling(), max_tokens=MAX_TOKENS, seed=case.seed)
        audio, rate = engine.synthesize(case.text, None, sampling, language=case.language,
                                        reference_audio=case.audio, reference_text=case.transcript)
        assert rate == RATE
        return audio

    yield synthesize
    engine.shutdown()


def test_cloned_streams_match_engine_synthesize(server, reference):
    jobs = [lambda c=c, i=i: stream_request(server.grpc_url, "qwen3_tts", c.inputs(), c.fmt, timeout=240,
                                            request_id=f"base{i}") for i, c in enumerate(CASES)]
    outs = run_concurrently(jobs, stagger_s=0.1)
    for i, (case, out) in enumerate(zip(CASES, outs)):
        expected = reference(case)
        assert expected.size > 0
        assert_matches(out, expected, case.fmt, f"qwen3_tts Base stream {i}", RATE)
    assert all(len(out.chunks) >= 2 for out in outs)  # the first frame is its own window


def test_the_engine_model_clones_from_text_too(server, reference):
    case = CASES[1]
    out = stream_request(server.grpc_url, "qwen3_tts_engine", case.inputs(), case.fmt, timeout=240)
    assert_matches(out, reference(case), case.fmt, "qwen3_tts_engine Base stream", RATE)


def test_the_client_clones_from_a_file(server, reference, tmp_path):
    """clients.tts_stream --reference-audio FILE --reference-text TEXT: the WAV it writes is the engine's audio."""
    case = CASES[0]
    clip, out = tmp_path / "me.wav", tmp_path / "out.wav"
    clip.write_bytes(case.audio)
    code = tts_stream_main(["--url", server.grpc_url, "--model", "qwen3_tts", "--text", case.text,
                            "--reference-audio", str(clip), "--reference-text", case.transcript,
                            "--seed", str(case.seed), "--max-tokens", str(MAX_TOKENS), "--out", str(out)])
    assert code == 0
    audio, rate = sf.read(str(out), dtype="float32")
    expected = reference(case)
    assert rate == RATE and len(audio) == len(expected)
    assert np.abs(audio - expected).max() < 2 / 32768  # the WAV is 16-bit


def test_text_streaming_with_a_reference_is_refused_clearly(server):
    """The in-context prompt needs the whole text: qwen3_tts_text_stream on a Base checkpoint refuses, naming
    TEXT, and a whole-text request still clones."""
    case = CASES[0]
    options = make_inputs(None, None, "fp32", reference_audio=case.audio, reference_text=case.transcript,
                          batched=True, MAX_TOKENS=MAX_TOKENS, SEED=case.seed)
    out = stream_text_pieces(server.grpc_url, "qwen3_tts_text_stream", ["Hello ", "there."], options, "fp32",
                             timeout=60)
    assert out.error and out.error.startswith("InvalidRequest: TEXT: voice cloning takes the whole text"), out.error
    assert not out.chunks
    after = stream_request(server.grpc_url, "qwen3_tts", case.inputs(), case.fmt, timeout=240)
    assert after.error is None and after.chunks


BAD_INPUTS = {
    "no reference": (Case("Hello."), "REFERENCE_AUDIO"),
    "transcript without reference audio": (Case("Hello.", transcript="Hello."), "REFERENCE_AUDIO"),
    "reference audio without transcript": (Case("Hello.", wav(1.0, 16000, 5)), "REFERENCE_TEXT"),
    "unreadable reference audio": (Case("Hello.", b"this is not a wav file", "Hello."), "REFERENCE_AUDIO"),
    "reference audio too long": (Case("Hello.", wav(31, 8000, 6), "Hello."), "REFERENCE_AUDIO"),
    "a speaker on a Base checkpoint": (Case("Hello.", wav(1.0, 16000, 5), "Hello.", voice="ryan"),
                                       "VOICE is not taken by Base checkpoints"),
    "empty text": (Case("   ", wav(1.0, 16000, 5), "Hello."), "TEXT is empty"),
}


def test_bad_inputs_are_refused_naming_the_tensor(server):
    failures = []
    for model in ("qwen3_tts", "qwen3_tts_engine"):
        for name, (case, message) in BAD_INPUTS.items():
            out = stream_request(server.grpc_url, model, case.inputs(), timeout=60, linger_s=0.2)
            if not (out.error and message in out.error and out.responses == 1 and not out.chunks):
                failures.append(f"{model} / {name}: error={out.error!r} responses={out.responses}")
    assert not failures, "\n".join(failures)
