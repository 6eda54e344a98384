"""The conversation models through Triton end to end (Step-Audio 2, GLM-4-Voice): the committed `<model>`,
`<model>_engine` and `<model>_preprocess` folders unchanged, on the run's shared committed-repository server
(tests/conftest.py).

No checkpoint is configured, so the engine models build the tiny default checkpoints themselves (in the test run's
VOXBACKEND_CACHE); the reference engine in this process loads the same one. Each conversation's reply comes back as
TEXT_OUT pieces and audio chunks on one stream; both must be what the engine gives the same request alone.
"""
from __future__ import annotations

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

from voxbackend.events import EventKind  # noqa: E402
from voxbackend.stream_client import make_inputs, stream_request  # noqa: E402
from tests.triton_util import COMMITTED, assert_matches, run_concurrently  # noqa: E402

MAX_TOKENS = 40  # text and speech ids together: a chunk of audio or two (Step's token2wav chunks and GLM's first
# block take 25 speech ids; the rest comes with the reply's end)


@dataclasses.dataclass(frozen=True)
class Served:
    name: str
    checkpoint: str  # module:function() -> (model_dir, codec_dir), the server's default
    rate: int
    conditioning: tuple[str, ...]  # what the preprocess hands the engine beside the prompt ids


MODELS = {
    "step_audio2": Served("step_audio2", "voxbackend.models.step_audio2.tiny:ensure_default_step_audio2", 24000,
                          ("AUDIO_MELS", "AUDIO_MEL_FRAMES", "PROMPT_SPEECH_TOKENS", "PROMPT_FEAT",
                           "SPEAKER_EMBEDDING")),
    "glm4_voice": Served("glm4_voice", "voxbackend.models.glm4_voice.tiny:ensure_default_glm4_voice", 22050,
                         ("AUDIO_SAMPLES", "AUDIO_CLIP_SAMPLES", "SPEAK_REPLY")),
}
SYSTEM = "You are a friendly voice assistant. Answer briefly."


def wav(seconds: float, rate: int, seed: int, channels: int = 1) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    noise = np.random.default_rng(seed).standard_normal(t.size)
    audio = (0.3 * np.sin(2 * np.pi * (150 + 40 * seed) * t) + 0.05 * noise).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, np.stack([audio] * channels, axis=1) if channels > 1 else audio, rate, format="WAV",
             subtype="PCM_16")
    return buf.getvalue()


@dataclasses.dataclass
class Turn:
    text: str | None = None
    audio: bytes | None = None
    system: str | None = None
    history: list[dict] | None = None
    speak: bool | None = None
    fmt: str = "fp32"
    seed: int = 0
    max_tokens: int = MAX_TOKENS

    def inputs(self) -> list:
        return make_inputs(self.text, None, self.fmt, input_audio=self.audio, system_prompt=self.system,
                           history=self.history, speak=self.speak, MAX_TOKENS=self.max_tokens, SEED=self.seed)

    def prepare_options(self) -> dict:
        history = [{k: v for k, v in turn.items() if v is not None and v != ""} for turn in self.history or []]
        return {"audio": self.audio, "system": self.system, "history": history or None,
                "speak": self.speak if self.speak is not None else True}


HISTORY = [{"role": "user", "text": "Hi, can you hear me?", "audio": wav(0.8, 16000, 20)},
           {"role": "assistant", "text": "Yes, loud and clear."}]
CONVERSATIONS = [
    Turn(audio=wav(1.5, 16000, 1), seed=100, fmt="pcm16"),
    Turn("What is this sound?", wav(1.0, 24000, 2), seed=101),
    Turn("Tell me a short story.", seed=102),
    Turn(audio=wav(2.0, 44100, 3, channels=2), system=SYSTEM, seed=103, fmt="pcm16"),
    Turn("And what about tomorrow?", history=HISTORY, system=SYSTEM, seed=104),
    Turn(audio=wav(0.6, 8000, 4), history=[{"role": "user", "text": "Good morning."},
                                           {"role": "assistant", "text": "Good morning to you."}], seed=105),
    Turn("Please answer in text only.", speak=False, seed=106),
    Turn("One more question.", wav(1.2, 22050, 5), system=SYSTEM, seed=107, fmt="pcm16"),
]

pytestmark = pytest.mark.xdist_group(COMMITTED)


@dataclasses.dataclass
class Reply:
    audio: np.ndarray
    text_pieces: list[str]


@pytest.fixture(scope="module")
def server(committed_server):
    return committed_server


@pytest.fixture(scope="module", params=list(MODELS))
def served(request) -> Served:
    return MODELS[request.param]


@pytest.fixture(scope="module")
def reference(server, served):
    """The engine in this process, on the checkpoint the server built: each conversation alone."""
    import voxbackend
    from voxbackend.triton.loading import import_object

    model_dir, _ = import_object(served.checkpoint)()  # the server's build (the run's cache)
    engine = voxbackend.load(model_dir)
    engine.start()

    def replies(turns: list[Turn]) -> list[Reply]:
        """Submitted together: a request's reply does not depend on its batch (the engine's parity tests)."""
        events: list[list] = [[] for _ in turns]
        done = [threading.Event() for _ in turns]

        def on_event(i: int, e) -> None:
            events[i].append(e)
            if e.final:
                done[i].set()

        for i, turn in enumerate(turns):
            sampling = dataclasses.replace(engine.model.default_sampling(), max_tokens=turn.max_tokens,
                                           seed=turn.seed)
            engine.submit(engine.model.prepare(turn.text, **turn.prepare_options()), sampling,
                          lambda e, i=i: on_event(i, e))
        out = []
        for got, finished in zip(events, done):
            assert finished.wait(240), "the reference engine did not finish"
            assert got[-1].kind is EventKind.FINISHED, got[-1].error
            audio = [e.audio for e in got if e.kind is EventKind.AUDIO]
            out.append(Reply(np.concatenate(audio) if audio else np.zeros(0, np.float32),
                             [e.text for e in got if e.kind is EventKind.TEXT]))
        return out

    def reply(turn: Turn) -> Reply:
        return replies([turn])[0]

    reply.many = replies

    try:
        yield reply
    finally:
        engine.shutdown()


def assert_reply(out, expected: Reply, fmt: str, what: str, rate: int) -> None:
    assert [piece for _, _, piece in out.text_pieces] == expected.text_pieces, f"{what}: text pieces"
    # in order with the audio: a text piece says how many audio chunks came before it, and so many had
    before = [sum(t_chunk <= t for t_chunk in out.arrivals) for t, _, _ in out.text_pieces]
    assert [index for _, index, _ in out.text_pieces] == before, f"{what}: text out of order with the audio"
    if expected.audio.size:
        assert_matches(out, expected.audio, fmt, what, rate, atol=1e-4)
    else:
        assert out.error is None and out.finish_reason in ("stop", "length") and not out.chunks, what


def test_8_concurrent_conversations_match_the_engine(server, served, reference):
    jobs = [lambda c=c, i=i: stream_request(server.grpc_url, served.name, c.inputs(), c.fmt, timeout=240,
                                            request_id=f"conversation{i}") for i, c in enumerate(CONVERSATIONS)]
    outs = run_concurrently(jobs)
    spoken = 0
    for i, (turn, out, expected) in enumerate(zip(CONVERSATIONS, outs, reference.many(CONVERSATIONS))):
        assert_reply(out, expected, turn.fmt, f"{served.name} conversation {i}", served.rate)
        spoken += bool(expected.audio.size)
    assert spoken >= 6, "the tiny model's replies carry audio"
    assert sum(bool(out.text) for out in outs) >= 6, "and text"


def test_the_engine_model_and_the_preprocess_chained_to_it(server, served, reference):
    """`<model>_engine` prepares a turn itself; or takes the preprocess's prompt ids and clip arrays."""
    turn = dataclasses.replace(CONVERSATIONS[1], seed=200)
    expected = reference(turn)
    engine = f"{served.name}_engine"
    out = stream_request(server.grpc_url, engine, turn.inputs(), turn.fmt, timeout=240)
    assert_reply(out, expected, turn.fmt, engine, served.rate)
    client = tritonclient.InferenceServerClient(server.grpc_url)
    try:
        prepared = client.infer(f"{served.name}_preprocess", turn.inputs())
    finally:
        client.close()
    names = ("PROMPT_IDS", *served.conditioning, "MAX_TOKENS", "SEED", "TEMPERATURE", "TOP_P", "TOP_K",
             "REPETITION_PENALTY", "AUDIO_FORMAT")
    chained = []
    for name in names:
        value = prepared.as_numpy(name)
        assert value is not None and value.size, f"the preprocess sent no {name}"
        t = tritonclient.InferInput(name, list(value.shape), prepared.get_output(name).datatype)
        t.set_data_from_numpy(value)
        chained.append(t)
    out = stream_request(server.grpc_url, engine, chained, turn.fmt, timeout=240)
    assert_reply(out, expected, turn.fmt, "preprocess -> engine", served.rate)


def _tensor(name: str, value: np.ndarray, dtype: str):
    t = tritonclient.InferInput(name, list(value.shape), dtype)
    t.set_data_from_numpy(value)
    return t


BAD = {
    "no audio and no text": (make_inputs(None, MAX_TOKENS=8), "TEXT: give text, audio or both"),
    "unreadable clip": (make_inputs(None, input_audio=b"RIFF not really a wav"),
                        "INPUT_AUDIO is not a readable audio file"),
    "a clip with no samples": (make_inputs("Hi", input_audio=wav(0, 16000, 7)), "INPUT_AUDIO is empty"),
    "clip over the limit": (make_inputs("Hi", input_audio=wav(61, 8000, 6)),
                            "INPUT_AUDIO is 61.00 s; the limit is 60 s"),
    "history too long": (make_inputs("Hi", history=[{"role": "user", "text": "a"}] * 33),
                         "history has 33 turns; the limit is 32"),
    "a history turn with no role": (make_inputs("Hi", history=[{"role": "narrator", "text": "a"}]),
                                    "HISTORY_ROLE[0] must be user or assistant"),
    "history lists of different lengths": (
        [*make_inputs("Hi", history=[{"role": "user", "text": "a"}]),
         _tensor("HISTORY_TEXT", np.array([b"a", b"b"], dtype=np.object_), "BYTES")], "HISTORY_TEXT"),
    "unknown voice": (make_inputs("Hi", "nobody"), "unknown voice 'nobody'"),
    "SPEAK as a number": ([*make_inputs("Hi"), _tensor("SPEAK", np.array([1], np.int32), "INT32")],
                          "SPEAK"),
}


def test_bad_turns_are_refused_naming_the_field_while_a_conversation_plays(server, served, reference):
    playing = dataclasses.replace(CONVERSATIONS[0], seed=300)
    result = {}
    thread = threading.Thread(target=lambda: result.update(out=stream_request(
        server.grpc_url, served.name, playing.inputs(), playing.fmt, timeout=240)))
    thread.start()
    failures = []
    # the engine model parses a request as the front model does (front_model.FrontModel is an EngineModel): one case
    # shows it refuses too
    cases = [(served.name, name) for name in BAD] + [(f"{served.name}_engine", "no audio and no text")]
    for model, name in cases:
        inputs, message = BAD[name]
        out = stream_request(server.grpc_url, model, inputs, timeout=60, linger_s=0.2)
        if not (out.error and message in out.error and out.responses == 1 and not out.chunks):
            failures.append(f"{model} / {name}: error={out.error!r} responses={out.responses}")
    thread.join()
    assert not failures, "\n".join(failures)
    assert_reply(result["out"], reference(playing), playing.fmt, "the conversation beside the refusals", served.rate)


def test_the_voice_chat_client_prints_the_reply_text_and_writes_its_speech(server, served, reference, tmp_path,
                                                                            capsys):
    from clients import voice_chat

    if served.name != "step_audio2":
        pytest.skip("the client names no model's own input: Step-Audio 2 shows it")

    question, earlier = tmp_path / "question.wav", tmp_path / "earlier.wav"
    question.write_bytes(wav(1.1, 16000, 8))
    earlier.write_bytes(wav(0.7, 16000, 9))
    code = voice_chat.main(["--url", server.grpc_url, "--model", served.name, "--audio", str(question),
                            "--system", SYSTEM, "--history", f"user@{earlier}", "--history", "assistant: It is a tone.",
                            "--seed", "500", "--max-tokens", str(MAX_TOKENS), "--out", str(tmp_path / "reply.wav")])
    printed = capsys.readouterr().out
    assert code == 0, printed
    expected = reference(Turn(audio=question.read_bytes(), system=SYSTEM, seed=500, history=[
        {"role": "user", "audio": earlier.read_bytes()}, {"role": "assistant", "text": "It is a tone."}]))
    assert expected.audio.size and expected.text_pieces
    assert printed.startswith("reply: " + "".join(expected.text_pieces) + "\n"), printed
    audio, rate = sf.read(tmp_path / "reply.wav", dtype="float32")
    assert rate == served.rate and audio.size == expected.audio.size
    np.testing.assert_allclose(audio, np.clip(expected.audio, -1, 1), atol=1e-4 + 1 / 32767)


def test_the_chat_endpoint_gives_the_models_reply_at_24_khz(server, served, reference):
    """POST /v1/chat/completions (the speech API in this process, on the shared server): the transcript and the
    audio are the engine's, the audio resampled to OpenAI's 24 kHz (GLM-4-Voice speaks at 22.05 kHz)."""
    import base64

    from fastapi.testclient import TestClient

    if served.name != "glm4_voice":
        pytest.skip("tests/test_api.py holds Step-Audio 2's chat replies to the Triton client's with the openai client")

    from voxbackend.api.app import create_app
    from voxbackend.audio_io import resample

    clip = wav(1.3, 16000, 11)
    body = {"model": served.name, "modalities": ["text", "audio"], "audio": {"voice": "default", "format": "pcm16"},
            "seed": 600, "max_completion_tokens": MAX_TOKENS,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": [{"type": "input_audio", "input_audio": {
                             "data": base64.b64encode(clip).decode(), "format": "wav"}}]}]}
    with TestClient(create_app(server.grpc_url, prefetch_voices=False)) as api:
        response = api.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    said = response.json()["choices"][0]["message"]["audio"]
    expected = reference(Turn(audio=clip, system=SYSTEM, seed=600))
    assert expected.audio.size and said["transcript"] == "".join(expected.text_pieces)
    got = np.frombuffer(base64.b64decode(said["data"]), "<i2").astype(np.float32) / 32767
    want = resample(np.round(np.clip(expected.audio, -1, 1) * 32767) / 32767, served.rate, 24000)
    assert got.size == want.size
    np.testing.assert_allclose(got, want, atol=3e-4)
