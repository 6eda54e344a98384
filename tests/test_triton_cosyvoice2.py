"""The cosyvoice2 deployment end to end: the committed cosyvoice2_preprocess, cosyvoice2_engine and cosyvoice2
folders unchanged, on the run's shared committed-repository server (tests/conftest.py; SIGTERM with cosyvoice2
streams open: tests/test_triton_committed_drain.py).

No checkpoint is configured, so the engine model builds the tiny default CosyVoice2 itself (in the test run's
VOXBACKEND_CACHE); the reference engine in this process loads that same checkpoint. The voice's prompt tokens,
mel and speaker embedding are computed in the preprocess and reach the engine as tensors.
"""
from __future__ import annotations

import contextlib
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

from voxbackend.stream_client import make_inputs, stream_request  # noqa: E402
from voxbackend.models.cosyvoice2.tiny import DEFAULT_VOICE, voice_clip  # noqa: E402
from tests.triton_util import COMMITTED, assert_matches, run_concurrently  # noqa: E402

MAX_TOKENS = 40  # 1.6 s of audio, two windows: keeps 2-core runs quick
RATE = 24000


def wav(seconds: float, rate: int, seed: int) -> bytes:
    clip = voice_clip(seconds, rate, seed)
    buf = io.BytesIO()
    sf.write(buf, clip, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


@dataclasses.dataclass
class Case:
    text: str
    voice: str | None = None
    audio: bytes | None = None  # a clip to clone, with its transcript
    transcript: str | None = None
    fmt: str = "fp32"
    seed: int = 0
    max_tokens: int = MAX_TOKENS

    def inputs(self) -> list:
        inputs = make_inputs(self.text, self.voice, self.fmt, MAX_TOKENS=self.max_tokens, SEED=self.seed)
        if self.audio is not None:
            inputs.append(_tensor("REFERENCE_AUDIO", _bytes(self.audio), "BYTES"))
        if self.transcript is not None:
            inputs.append(_tensor("REFERENCE_TEXT", _bytes(self.transcript.encode()), "BYTES"))
        return inputs


CASES = [
    Case("Hello there, how are you doing today?", DEFAULT_VOICE, seed=100, fmt="pcm16"),
    Case("The quick brown fox jumps over the lazy dog.", seed=101),  # the checkpoint's first stored voice
    Case("Good morning! Good evening!", audio=wav(1.2, 24000, 1), transcript="I am calling about the flat.",
         seed=102),
    Case("See you tomorrow, my friend.", audio=wav(0.8, 16000, 2), transcript="Hello, who is this?", seed=103,
         fmt="pcm16"),
    Case("Speech models turn text into sound.", audio=wav(1.5, 44100, 3), transcript="Numbers like one, two.",
         seed=104),  # resampled
    Case("Can you tell me the way to the library?", DEFAULT_VOICE, seed=105),
    Case("The children laughed and played in the garden.", audio=wav(1.0, 22050, 4),
         transcript="When the music stopped, everyone turned around.", seed=106, fmt="pcm16"),
    Case("It is important to test every part of a system.", seed=107),
]


pytestmark = pytest.mark.xdist_group(COMMITTED)


@pytest.fixture(scope="module")
def server(committed_server):
    return committed_server


@contextlib.contextmanager
def reference_engine():
    """Engine.synthesize in this process, on the checkpoint the server built; the engine stops on exit."""
    import voxbackend
    from voxbackend.models.cosyvoice2.tiny import ensure_default_cosyvoice2

    model_dir, _ = ensure_default_cosyvoice2()  # the server's build (the run's cache)
    engine = voxbackend.load(model_dir)
    engine.start()

    def synthesize(case: Case) -> np.ndarray:
        sampling = dataclasses.replace(engine.model.default_sampling(), max_tokens=case.max_tokens, seed=case.seed)
        audio, rate = engine.synthesize(case.text, case.voice, sampling, reference_audio=case.audio,
                                        reference_text=case.transcript)
        assert rate == RATE
        return audio

    try:
        yield synthesize
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def reference(server):
    with reference_engine() as synthesize:
        yield synthesize


def assert_nonempty_match(out, expected: np.ndarray, fmt: str, what: str) -> None:
    assert expected.size > 0, f"{what}: the reference made no audio"
    # the flow's batched matmuls round differently with the batch's make-up (measured up to 1.7e-4 on 2 of
    # 38,400 samples); a wrong voice, seed or window differs by ~0.1
    assert_matches(out, expected, fmt, what, RATE, atol=5e-4, rtol=1e-4)


def test_8_concurrent_streams_match_engine_synthesize(server, reference):
    jobs = [lambda c=c, i=i: stream_request(server.grpc_url, "cosyvoice2", c.inputs(), c.fmt, timeout=240,
                                            request_id=f"cv{i}") for i, c in enumerate(CASES)]
    outs = run_concurrently(jobs)
    for i, (case, out) in enumerate(zip(CASES, outs)):
        assert_nonempty_match(out, reference(case), case.fmt, f"cosyvoice2 stream {i}")
    assert len({out.audio.size for out in outs}) > 1


def test_engine_model_directly_clones_a_voice(server, reference):
    case = dataclasses.replace(CASES[2], seed=200)
    out = stream_request(server.grpc_url, "cosyvoice2_engine", case.inputs(), "fp32", timeout=240)
    assert_nonempty_match(out, reference(case), "fp32", "cosyvoice2_engine stream")


def _tensor(name: str, value: np.ndarray, dtype: str):
    t = tritonclient.InferInput(name, list(value.shape), dtype)
    t.set_data_from_numpy(value)
    return t


def _bytes(*items) -> np.ndarray:
    return np.array(list(items), dtype=np.object_)


def _request(audio: bytes | None = None, transcript: str | None = None, voice: str | None = None) -> list:
    return dataclasses.replace(Case("Hello there.", voice, audio, transcript)).inputs()


BAD_INPUTS = {
    "reference audio without transcript": (_request(wav(1.0, 16000, 5)), "REFERENCE_TEXT"),
    "transcript without reference audio": (_request(transcript="Hello."), "REFERENCE_AUDIO"),
    "unreadable reference audio": (_request(b"this is not a wav file", "Hello."),
                                   "REFERENCE_AUDIO is not a readable audio file"),
    "reference audio too long": (_request(wav(31, 8000, 6), "Hello."), "REFERENCE_AUDIO is 31.00 s; the limit is 30 s"),
    "reference audio too short": (_request(wav(0.2, 16000, 7), "Hello."), "REFERENCE_AUDIO is 0.20 s"),
    "unknown voice": (_request(voice="nobody"), "VOICE 'nobody' is not known"),
    "empty text": (make_inputs("   "), "TEXT is empty"),
}


def test_bad_inputs_are_refused_naming_the_tensor(server):
    failures = []
    for model in ("cosyvoice2", "cosyvoice2_engine"):
        for name, (inputs, message) in BAD_INPUTS.items():
            out = stream_request(server.grpc_url, model, inputs, timeout=60, linger_s=0.2)
            if not (out.error and message in out.error and out.responses == 1 and not out.chunks):
                failures.append(f"{model} / {name}: error={out.error!r} responses={out.responses}")
    assert not failures, "\n".join(failures)
