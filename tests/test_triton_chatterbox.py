"""The chatterbox deployment end to end: the committed chatterbox_preprocess, chatterbox_engine and chatterbox folders
unchanged, on the run's shared committed-repository server (tests/conftest.py; SIGTERM with chatterbox streams open:
tests/test_triton_committed_drain.py).

No checkpoint is configured, so the engine model builds the tiny default Chatterbox itself (in the test run's
VOXBACKEND_CACHE); the reference engine in this process loads that same checkpoint. A cloned voice's arrays (speaker
embedding, conditioning tokens, S3Gen prompt) are computed in the preprocess and reach the engine as tensors; the
engine turns them into the LM's conditioning prefix.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import soundfile as sf  # noqa: E402
import tritonclient.grpc as tritonclient  # noqa: E402

from voxbackend.models.cosyvoice2.tiny import voice_clip  # noqa: E402
from voxbackend.stream_client import make_inputs, stream_request  # noqa: E402
from tests.triton_util import COMMITTED, assert_matches, run_concurrently  # noqa: E402

MAX_TOKENS = 60  # up to 2.4 s of audio, two S3Gen windows
RATE = 24000


def wav(seconds: float, rate: int, seed: int) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, voice_clip(seconds, rate, seed), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


@dataclasses.dataclass
class Case:
    text: str
    voice: str | None = None
    audio: bytes | None = None  # a clip to clone
    exaggeration: float | None = None
    cfg_weight: float | None = None  # None: the model's default (0.5)
    fmt: str = "fp32"
    seed: int = 0
    max_tokens: int = MAX_TOKENS

    def inputs(self) -> list:
        sampling = {"MAX_TOKENS": self.max_tokens, "SEED": self.seed}
        if self.cfg_weight is not None:
            sampling["CFG_WEIGHT"] = self.cfg_weight
        inputs = make_inputs(self.text, self.voice, self.fmt, reference_audio=self.audio, **sampling)
        if self.exaggeration is not None:
            inputs.append(_tensor("EXAGGERATION", np.array([self.exaggeration], np.float32), "FP32"))
        return inputs


CASES = [
    Case("Hello there, how are you doing today?", seed=100, fmt="pcm16"),
    Case("The quick brown fox jumps over the lazy dog.", seed=101, exaggeration=0.9),
    Case("Good morning! Good evening!", audio=wav(2.0, 24000, 1), seed=102),
    Case("See you tomorrow, my friend.", audio=wav(1.5, 16000, 2), seed=103, fmt="pcm16", cfg_weight=0.0),
    Case("Speech models turn text into sound.", audio=wav(3.0, 44100, 3), seed=104, exaggeration=0.3),
    Case("Can you tell me the way to the library?", seed=105, cfg_weight=1.5),
    Case("The children laughed and played in the garden.", audio=wav(2.5, 22050, 4), seed=106, fmt="pcm16"),
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
    from voxbackend.models.chatterbox.tiny import ensure_default_chatterbox

    model_dir, _ = ensure_default_chatterbox()  # the server's build (the run's cache)
    engine = voxbackend.load(model_dir)
    engine.start()

    def synthesize(case: Case) -> np.ndarray:
        sampling = dataclasses.replace(engine.model.default_sampling(), max_tokens=case.max_tokens, seed=case.seed)
        if case.cfg_weight is not None:
            sampling.cfg_weight = case.cfg_weight
        audio, rate = engine.synthesize(case.text, case.voice, sampling, reference_audio=case.audio,
                                        exaggeration=case.exaggeration)
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
    # the flow's batched matmuls round differently with the batch's make-up; a wrong voice, seed or window is ~0.1 off
    assert_matches(out, expected, fmt, what, RATE, atol=5e-4, rtol=1e-4)


def test_8_concurrent_streams_match_engine_synthesize(server, reference):
    jobs = [lambda c=c, i=i: stream_request(server.grpc_url, "chatterbox", c.inputs(), c.fmt, timeout=240,
                                            request_id=f"cb{i}") for i, c in enumerate(CASES)]
    outs = run_concurrently(jobs)
    for i, (case, out) in enumerate(zip(CASES, outs)):
        assert_nonempty_match(out, reference(case), case.fmt, f"chatterbox stream {i}")
    assert len({out.audio.size for out in outs}) > 1


def test_a_clone_sent_with_a_name_and_the_engine_model_taking_a_clip_directly(server, reference):
    """A clip sent with VOICE is cloned (and kept under that name in the preprocess instance that saw it); a clip
    sent to the engine model itself is cloned there."""
    first = Case("Nice to meet you.", voice="caller_9", audio=wav(2.0, 16000, 9), seed=300)
    out = stream_request(server.grpc_url, "chatterbox", first.inputs(), "fp32", timeout=240)
    assert_nonempty_match(out, reference(dataclasses.replace(first, voice=None)), "fp32", "clone by name")
    direct = dataclasses.replace(CASES[2], seed=301)
    out = stream_request(server.grpc_url, "chatterbox_engine", direct.inputs(), "fp32", timeout=240)
    assert_nonempty_match(out, reference(direct), "fp32", "chatterbox_engine stream")


def _tensor(name: str, value: np.ndarray, dtype: str):
    t = tritonclient.InferInput(name, list(value.shape), dtype)
    t.set_data_from_numpy(value)
    return t


BAD_INPUTS = {
    "negative guidance weight": (Case("Hello there.", cfg_weight=-0.5), "CFG_WEIGHT must be in [0, 10]"),
    "NaN guidance weight": (Case("Hello there.", cfg_weight=float("nan")), "CFG_WEIGHT must not be NaN"),
    "exaggeration out of range": (Case("Hello there.", exaggeration=2.5), "EXAGGERATION must be in [0, 2]"),
    "NaN exaggeration": (Case("Hello there.", exaggeration=float("nan")), "EXAGGERATION must be in [0, 2]"),
    "reference clip too short": (Case("Hello there.", audio=wav(0.5, 16000, 5)), "REFERENCE_AUDIO is 0.50 s"),
    "reference clip too long": (Case("Hello there.", audio=wav(31, 8000, 6)), "REFERENCE_AUDIO is 31.00 s"),
    "unknown voice": (Case("Hello there.", voice="nobody"), "VOICE 'nobody' is not known"),
}


# the engine model checks what reaches it itself (its own prepare when TEXT comes instead of PROMPT_IDS)
ENGINE_BAD_INPUTS = ("negative guidance weight", "exaggeration out of range", "reference clip too short")


def test_bad_inputs_are_refused_naming_the_tensor_while_another_stream_plays(server, reference):
    playing = dataclasses.replace(CASES[0], max_tokens=80, seed=400)
    result = {}
    thread = threading.Thread(target=lambda: result.update(out=stream_request(
        server.grpc_url, "chatterbox", playing.inputs(), playing.fmt, timeout=240)))
    thread.start()
    failures = []
    for model, names in (("chatterbox", BAD_INPUTS), ("chatterbox_engine", ENGINE_BAD_INPUTS)):
        for name in names:
            case, message = BAD_INPUTS[name]
            out = stream_request(server.grpc_url, model, case.inputs(), timeout=60, linger_s=0.2)
            if not (out.error and message in out.error and out.responses == 1 and not out.chunks):
                failures.append(f"{model} / {name}: error={out.error!r} responses={out.responses}")
    thread.join()
    assert not failures, "\n".join(failures)
    assert_nonempty_match(result["out"], reference(playing), playing.fmt, "the stream beside the refusals")
