"""The csm deployment end to end: the committed csm_preprocess, csm_engine and csm folders unchanged, on the
run's shared committed-repository server (tests/conftest.py).

No checkpoint is configured, so the engine model builds the tiny default CSM itself (in the test run's
VOXBACKEND_CACHE); the reference engine in this process loads that same checkpoint. SIGTERM with csm streams
open: tests/test_triton_committed_drain.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import soundfile as sf  # noqa: E402
import tritonclient.grpc as tritonclient  # noqa: E402

from voxbackend.stream_client import StreamOutcome, context_fields, make_inputs, stream_request  # noqa: E402
from tests.triton_util import COMMITTED, assert_matches, run_concurrently  # noqa: E402


MAX_TOKENS = 12  # frames (80 ms each): ~1 s of audio per stream keeps 2-core runs quick
RATE = 24000


def wav(seconds: float, rate: int, seed: int) -> bytes:
    """A reference clip: seeded noise under a tone, as a 16-bit WAV file."""
    t = np.arange(int(seconds * rate)) / rate
    x = 0.3 * np.sin(2 * np.pi * 220 * t) + 0.1 * np.random.default_rng(seed).standard_normal(t.size)
    buf = io.BytesIO()
    sf.write(buf, x.astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def raw_clip(seconds: float, rate: int, seed: int) -> np.ndarray:
    return (0.2 * np.random.default_rng(seed).standard_normal(int(seconds * rate))).astype(np.float32)


@dataclasses.dataclass
class Case:
    """One request: what the client sends and what Engine.synthesize gets for the same request."""

    text: str
    speaker: int | None = None
    context: list[dict] = dataclasses.field(default_factory=list)  # {"text", "speaker", "audio"[, "sample_rate"]}
    raw_rate: int | None = None  # context audio sent as raw float32 samples at this rate
    fmt: str = "fp32"
    seed: int = 0
    max_tokens: int = MAX_TOKENS

    def inputs(self) -> list:
        # context audio: WAV bytes, or float32 arrays sent as raw samples at raw_rate
        ctx = context_fields([c["text"] for c in self.context], [c["audio"] for c in self.context],
                             [c["speaker"] for c in self.context])
        return make_inputs(self.text, None, self.fmt, speaker=self.speaker, context=ctx,
                           context_sample_rate=self.raw_rate, MAX_TOKENS=self.max_tokens, SEED=self.seed)

    def reference_context(self) -> list[dict]:
        return [dict(c, sample_rate=self.raw_rate) if self.raw_rate else c for c in self.context]


CASES = [
    Case("Hello there, how are you doing today?", seed=100, fmt="pcm16"),
    Case("The quick brown fox jumps over the lazy dog.", speaker=3, seed=101),
    Case("Good morning! Good evening!", speaker=1, seed=102,
         context=[{"text": "I am calling about the flat.", "speaker": 1, "audio": wav(0.8, 24000, 1)}]),
    Case("See you tomorrow, my friend.", speaker=1, seed=103, fmt="pcm16",
         context=[{"text": "Hello, who is this?", "speaker": 0, "audio": wav(0.6, 24000, 2)},
                  {"text": "It is me, your neighbour.", "speaker": 1, "audio": wav(0.7, 16000, 3)}]),  # resampled
    Case("Speech models turn text into sound.", speaker=2, seed=104, raw_rate=22050,
         context=[{"text": "Numbers like one, two, three.", "speaker": 2, "audio": raw_clip(0.5, 22050, 4)}]),
    Case("Can you tell me the way to the library?", speaker=9, seed=105),
    Case("The children laughed and played in the garden.", speaker=0, seed=106,
         context=[{"text": "When the music stopped, everyone turned around.", "speaker": 4,
                   "audio": wav(1.0, 44100, 5)}]),
    Case("It is important to test every part of a system.", seed=107, fmt="pcm16"),
]


pytestmark = pytest.mark.xdist_group(COMMITTED)


@pytest.fixture(scope="module")
def server(committed_server):
    return committed_server


@contextlib.contextmanager
def reference_engine():
    """Engine.synthesize in this process, on the checkpoint the server built; the engine stops on exit."""
    import voxbackend
    from voxbackend.models.csm.tiny import ensure_default_csm

    model_dir, _ = ensure_default_csm()  # the server's build (the run's cache)
    engine = voxbackend.load(model_dir)
    engine.start()

    def synthesize(case: Case) -> np.ndarray:
        sampling = dataclasses.replace(engine.model.default_sampling(), max_tokens=case.max_tokens, seed=case.seed)
        audio, rate = engine.synthesize(case.text, case.speaker, sampling, context=case.reference_context())
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


# ---------------------------------------------------------------- streams match the engine


def test_8_concurrent_csm_streams_match_engine_synthesize(server, reference):
    jobs = [lambda c=c, i=i: stream_request(server.grpc_url, "csm", c.inputs(), c.fmt, timeout=240,
                                            request_id=f"csm{i}") for i, c in enumerate(CASES)]
    outs = run_concurrently(jobs)
    for i, (case, out) in enumerate(zip(CASES, outs)):
        assert_matches(out, reference(case), case.fmt, f"csm stream {i}")


def test_csm_engine_directly_with_context(server, reference):
    case = dataclasses.replace(CASES[3], fmt="fp32", seed=200)  # the engine model sends float samples
    out = stream_request(server.grpc_url, "csm_engine", case.inputs(), "fp32", timeout=240)
    assert_matches(out, reference(case), "fp32", "csm_engine stream")


# ---------------------------------------------------------------- bad input


def _tensor(name: str, value: np.ndarray, dtype: str):
    t = tritonclient.InferInput(name, list(value.shape), dtype)
    t.set_data_from_numpy(value)
    return t


def _bytes(*items) -> np.ndarray:
    return np.array(list(items), dtype=np.object_)


def _context(texts, speakers, audio, rate=None) -> list:
    out = [_tensor("TEXT", _bytes(b"Hello there."), "BYTES"),
           _tensor("CONTEXT_TEXT", _bytes(*[t.encode() for t in texts]), "BYTES"),
           _tensor("CONTEXT_AUDIO", _bytes(*audio), "BYTES")]
    if speakers is not None:
        out.append(_tensor("CONTEXT_SPEAKER", np.array(speakers, np.int32), "INT32"))
    if rate is not None:
        out.append(_tensor("CONTEXT_SAMPLE_RATE", np.array([rate], np.int32), "INT32"))
    return out


CLIP = wav(0.3, 24000, 9)
BAD_INPUTS = {
    "speaker out of range": (make_inputs("Hello.", speaker=10), "SPEAKER must be in [0, 10), got 10"),
    "negative speaker": (make_inputs("Hello.", speaker=-1), "SPEAKER must be in [0, 10)"),
    "empty text": (make_inputs("   "), "TEXT is empty"),
    "context speaker out of range": (_context(["Before."], [12], [CLIP]), "CONTEXT_SPEAKER[0] must be in [0, 10)"),
    "empty context text": (_context([""], [0], [CLIP]), "CONTEXT_TEXT[0] is empty"),
    "context audio that is not audio": (_context(["Before."], [0], [b"this is not a wav file"]),
                                        "CONTEXT_AUDIO[0] is not a readable audio file"),
    "raw context audio at an impossible rate": (_context(["Before."], [0], [raw_clip(0.1, 100, 1).tobytes()], 100),
                                                "CONTEXT_AUDIO[0] sample_rate must be an integer in [1000, 384000]"),
    "raw context audio not float32": (_context(["Before."], [0], [b"\x00" * 7], 16000),
                                      "raw float32 samples need a multiple of 4 bytes"),
    "context audio too long for the context": (_context(["Before."], [0], [wav(170, 8000, 3)]),
                                               "CONTEXT_AUDIO[0] is 170.00 s; the limit is 163.84 s"),
    "context too long for the model": (_context(["zq" * 1999], [0], [CLIP]), "the model's context is 2048"),
    "mismatched context lists": (_context(["One.", "Two."], [0], [CLIP, CLIP]),
                                 "CONTEXT_SPEAKER has 1 element(s) but CONTEXT_TEXT has 2"),
    "context audio missing": ([_tensor("TEXT", _bytes(b"Hi."), "BYTES"),
                               _tensor("CONTEXT_TEXT", _bytes(b"A."), "BYTES"),
                               _tensor("CONTEXT_SPEAKER", np.array([0], np.int32), "INT32")],
                              "CONTEXT_AUDIO is missing"),
    "rate list of the wrong length": (_context(["One.", "Two."], [0, 1], [b"\x00" * 8] * 2)
                                      + [_tensor("CONTEXT_SAMPLE_RATE", np.array([16000, 8000, 8000], np.int32),
                                                 "INT32")], "CONTEXT_SAMPLE_RATE needs 1 or 2 element(s)"),
}


def test_bad_inputs_get_one_clear_error_while_another_stream_finishes_intact(server, reference):
    long_case = dataclasses.replace(CASES[2], seed=300, max_tokens=60)
    expected = reference(long_case)
    long_out: list[StreamOutcome] = []
    t = threading.Thread(target=lambda: long_out.append(stream_request(
        server.grpc_url, "csm", long_case.inputs(), long_case.fmt, timeout=240)))
    t.start()
    time.sleep(0.5)
    failures = []
    for model in ("csm", "csm_engine"):
        for name, (inputs, message) in BAD_INPUTS.items():
            out = stream_request(server.grpc_url, model, inputs, timeout=60, linger_s=0.2)
            if not (out.error and message in out.error and out.responses == 1 and out.late_responses == 0
                    and not out.chunks):
                failures.append(f"{model} / {name}: error={out.error!r} responses={out.responses} "
                                f"late={out.late_responses}")
    t.join(240)
    assert not failures, "\n".join(failures)
    assert long_out and long_out[0].arrivals[-1] > long_out[0].send_time + 0.5, "the long stream overlapped"
    assert_matches(long_out[0], expected, long_case.fmt, "long stream")
