"""The qwen3_tts deployment end to end: the committed qwen3_tts_preprocess, qwen3_tts_engine and qwen3_tts folders
unchanged, on the run's shared committed-repository server (tests/conftest.py; SIGTERM with qwen3_tts streams
open: tests/test_triton_committed_drain.py).

No checkpoint is configured, so the engine model builds the tiny default Qwen3-TTS (CustomVoice, tagged 0.6B:
INSTRUCT is refused) in the test run's VOXBACKEND_CACHE; the reference engine in this process loads the same folder.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tritonclient.grpc as tritonclient  # noqa: E402

from voxbackend.stream_client import make_inputs, stream_request  # noqa: E402
from tests.triton_util import COMMITTED, assert_matches, run_concurrently  # noqa: E402

MAX_TOKENS = 12  # frames of 80 ms
RATE = 24000


def _text(name: str, value: str):
    t = tritonclient.InferInput(name, [1], "BYTES")
    t.set_data_from_numpy(np.array([value.encode()], dtype=np.object_))
    return t


@dataclasses.dataclass
class Case:
    text: str
    voice: str | None = None
    language: str | None = None
    fmt: str = "fp32"
    seed: int = 0
    max_tokens: int = MAX_TOKENS

    def inputs(self) -> list:
        inputs = make_inputs(self.text, self.voice, self.fmt, MAX_TOKENS=self.max_tokens, SEED=self.seed)
        return inputs + ([_text("LANGUAGE", self.language)] if self.language else [])


CASES = [
    Case("Hello there, how are you doing today?", seed=100, fmt="pcm16"),
    Case("The quick brown fox jumps over the lazy dog.", voice="Vivian", seed=101),
    Case("Good morning! Good evening!", voice="eric", seed=102),  # a dialect speaker
    Case("See you tomorrow, my friend.", voice="ryan", language="English", seed=103, fmt="pcm16"),
    Case("Speech models turn text into sound.", voice="ryan", language="german", seed=104),
    Case("Can you tell me the way to the library?", voice="vivian", language="auto", seed=105),
    Case("The children laughed and played in the garden.", voice="RYAN", language="japanese", seed=106),
    Case("It is important to test every part of a system.", language="chinese", seed=107, fmt="pcm16"),
]


pytestmark = pytest.mark.xdist_group(COMMITTED)


@pytest.fixture(scope="module")
def server(committed_server):
    return committed_server


@contextlib.contextmanager
def reference_engine():
    """Engine.synthesize in this process, on the checkpoint the server built; the engine stops on exit."""
    import voxbackend
    from voxbackend.models.qwen3_tts.tiny import ensure_default_qwen3_tts

    model_dir, _ = ensure_default_qwen3_tts()  # the server's build (the run's cache)
    engine = voxbackend.load(model_dir)
    engine.start()

    def synthesize(case: Case) -> np.ndarray:
        sampling = dataclasses.replace(engine.model.default_sampling(), max_tokens=case.max_tokens, seed=case.seed)
        audio, rate = engine.synthesize(case.text, case.voice, sampling, language=case.language)
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


def assert_first_frame_match(out, expected: np.ndarray, fmt: str, what: str) -> None:
    assert expected.size > 0, f"{what}: the reference made no audio"
    assert_matches(out, expected, fmt, what, RATE)
    assert len(out.chunks) >= 2, f"{what}: the first frame is its own window"


def test_8_concurrent_qwen3_tts_streams_match_engine_synthesize(server, reference):
    jobs = [lambda c=c, i=i: stream_request(server.grpc_url, "qwen3_tts", c.inputs(), c.fmt, timeout=240,
                                            request_id=f"qwen{i}") for i, c in enumerate(CASES)]
    outs = run_concurrently(jobs)
    for i, (case, out) in enumerate(zip(CASES, outs)):
        assert_first_frame_match(out, reference(case), case.fmt, f"qwen3_tts stream {i}")


BAD_INPUTS = {
    "unknown speaker": (make_inputs("Hello.", "nobody"), "VOICE 'nobody' is not a speaker of this checkpoint"),
    "unknown language": (make_inputs("Hello.", "ryan") + [_text("LANGUAGE", "klingon")],
                         "LANGUAGE 'klingon' is not supported"),
    "instruct on a 0.6B CustomVoice checkpoint": (make_inputs("Hello.") + [_text("INSTRUCT", "Speak slowly.")],
                                                  "INSTRUCT is not taken by this checkpoint"),
    "empty text": (make_inputs("   "), "TEXT is empty"),
}


def test_bad_inputs_are_refused_naming_the_tensor(server):
    failures = []
    for model in ("qwen3_tts", "qwen3_tts_engine"):
        for name, (inputs, message) in BAD_INPUTS.items():
            out = stream_request(server.grpc_url, model, inputs, timeout=60, linger_s=0.2)
            if not (out.error and message in out.error and out.responses == 1 and not out.chunks):
                failures.append(f"{model} / {name}: error={out.error!r} responses={out.responses}")
    assert not failures, "\n".join(failures)
