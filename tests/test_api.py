"""The speech API (voxbackend/api) end to end: `voxbackend serve --api-port` on loopback with the tiny Orpheus and
Step-Audio 2 checkpoints, called with the official `openai` client, a WebSocket client and headless Chromium.

One server for the module (the CLI as users start it: tritonserver + the API, ready when GET /health answers
200, SIGINT stops both). Reference audio comes from the project's Triton client (clients/tts_stream.py) on the
same server with the same seed: the API must hand over exactly the engine's samples (PCM16, +-1 step), and a
conversation model's reply text exactly the Triton client's.
"""
from __future__ import annotations

import base64
import io
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import openai  # noqa: E402
from websockets.exceptions import ConnectionClosed  # noqa: E402
from websockets.sync.client import connect as ws_connect  # noqa: E402

from voxbackend.stream_client import make_inputs, stream_request  # noqa: E402
from voxbackend.api import errors as api_errors, gauges  # noqa: E402
from voxbackend.api.sentences import SentenceBuffer  # noqa: E402
from voxbackend.models.orpheus.model import VOICES  # noqa: E402
from voxbackend.deploy.server import free_port  # noqa: E402
from tests.util_http import get_json, http_status  # noqa: E402

MAX_TOKENS = 63  # 9 Orpheus frames: a few chunks per stream keeps 2-core runs quick
TOP_K = 8  # no near-ties in the tiny model's flat distribution (see test_triton_e2e.py)
RATE = 24000


@pytest.fixture(scope="module")
def service(tiny_orpheus, tmp_path_factory):
    """`voxbackend serve --models orpheus,step_audio2 --api-port N` (Step-Audio 2 on its tiny default checkpoint):
    yields the ports; stops it with SIGINT at the end."""
    model_dir, codec_dir = tiny_orpheus
    work = tmp_path_factory.mktemp("api_serve")
    ports = {name: free_port() for name in ("http", "grpc", "metrics", "api")}
    log = open(work / "serve.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "voxbackend.cli", "serve", "--models", "orpheus,step_audio2",
         "--set", f"orpheus.checkpoint={model_dir}", "--set", f"orpheus.codec={codec_dir}",
         "--host", "127.0.0.1", "--http-port", str(ports["http"]),
         "--grpc-port", str(ports["grpc"]), "--metrics-port", str(ports["metrics"]), "--api-port", str(ports["api"]),
         "--work-dir", str(work)],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    api = f"http://127.0.0.1:{ports['api']}"
    try:
        deadline = time.monotonic() + 420
        while http_status(f"{api}/health") != 200:
            assert proc.poll() is None, f"voxbackend serve exited {proc.returncode}:\n{_tail(work / 'serve.log')}"
            assert time.monotonic() < deadline, f"/health never answered 200:\n{_tail(work / 'serve.log')}"
            time.sleep(0.5)
        yield {"api": api, "grpc": f"127.0.0.1:{ports['grpc']}", "proc": proc, "log": work / "serve.log"}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        log.close()
    assert proc.returncode == 0, f"voxbackend serve exited {proc.returncode} on SIGINT:\n{_tail(work / 'serve.log')}"
    assert http_status(f"{api}/health") is None, "the API still answers after SIGINT"






def _tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture(scope="module")
def client(service):
    return openai.OpenAI(base_url=service["api"] + "/v1", api_key="not-needed", max_retries=0, timeout=120)


def reference_pcm16(service, text: str, voice: str | None, seed: int, max_tokens: int = MAX_TOKENS) -> np.ndarray:
    """The Triton client's audio for the same request, as int16 samples."""
    out = stream_request(service["grpc"], "orpheus", make_inputs(text, voice, "pcm16", MAX_TOKENS=max_tokens,
                                                                 SEED=seed, TOP_K=TOP_K), "pcm16", timeout=120)
    assert out.error is None, out.error
    assert out.sample_rate == RATE
    return np.round(out.audio * 32767.0).astype(np.int32)


PCM16_TOLERANCE = 4  # steps of 1/32768: 1e-4 plus the rounding to PCM16


def assert_same_audio(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.size == want.size and got.size > 0, f"{what}: {got.size} samples, the Triton client got {want.size}"
    worst = int(np.max(np.abs(got.astype(np.int32) - want.astype(np.int32))))
    # float rounding only: the codec batches a stream's windows differently from run to run (the e2e tests'
    # 1e-4 is about 3 PCM16 steps); a wrong seed or request differs by thousands
    assert worst <= PCM16_TOLERANCE, f"{what}: samples differ by up to {worst} PCM16 steps"


def speak(client, text: str, seed: int, voice: str = "tara", response_format: str = "wav", **extra):
    """Stream one request with the openai client: (body bytes, pieces, time of first audio byte, time of end)."""
    t0 = time.monotonic()
    pieces, first_audio = [], None
    header = 44 if response_format == "wav" else 0
    with client.audio.speech.with_streaming_response.create(
            model="orpheus", voice=voice, input=text, response_format=response_format,
            extra_body={"seed": seed, "max_tokens": MAX_TOKENS, "top_k": TOP_K, **extra}) as response:
        assert response.headers["content-type"].startswith("audio/")
        for piece in response.iter_bytes():
            pieces.append(piece)
            if first_audio is None and sum(map(len, pieces)) > header:
                first_audio = time.monotonic() - t0
    return b"".join(pieces), pieces, first_audio, time.monotonic() - t0


def test_speech_streams_a_wav_equal_to_the_triton_client(service, client):
    body, pieces, first_audio, end = speak(client, "Hello there, how are you doing today?", seed=7)
    assert body[:4] == b"RIFF" and body[8:16] == b"WAVEfmt "
    audio, rate = sf.read(io.BytesIO(body), dtype="int16")
    assert rate == RATE and audio.ndim == 1
    assert_same_audio(audio, reference_pcm16(service, "Hello there, how are you doing today?", "tara", 7), "wav")
    assert len(pieces) >= 3, f"the body came in {len(pieces)} piece(s)"  # one per engine chunk, not one file


def test_first_bytes_leave_before_generation_ends(service, client):
    """With a long generation the first audio must arrive long before the last (TTFA, not total time). A body
    sent whole arrives within milliseconds; a stream keeps arriving while the rest is generated. On a busy
    2-core host the first audio can take most of a short total (seen: 0.87 s of 1.17 s, the other test worker
    loading 16 streams), so either half the total or a quarter second of generation after it will do."""
    _, pieces, first_audio, end = speak(client, "A streaming server sends the first chunk at once.", seed=3,
                                        response_format="pcm", max_tokens=280)
    assert first_audio < 0.5 * end or end - first_audio > 0.25, f"first audio after {first_audio:.2f} s of {end:.2f} s"
    assert len(pieces) >= 5


def test_eight_concurrent_requests_equal_the_triton_client(service, client):
    texts = ["The quick brown fox jumps over the lazy dog.", "Good morning! Good evening!",
             "Speech models turn text into sound.", "See you tomorrow, my friend.",
             "Numbers like one, two, three are easy to say.", "The weather this morning was cold and grey.",
             "Can you tell me the way to the library?", "Thank you for asking, I am doing well."]
    voices = ["tara", "leo", "mia", "zac"]
    results: dict[int, bytes] = {}
    failures: list[BaseException] = []

    def one(i: int) -> None:
        try:
            results[i] = speak(client, texts[i], seed=100 + i, voice=voices[i % 4], response_format="pcm")[0]
        except BaseException as e:  # reported below, on the test's thread
            failures.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not failures, failures
    for i, text in enumerate(texts):
        got = np.frombuffer(results[i], dtype="<i2")
        assert_same_audio(got, reference_pcm16(service, text, voices[i % 4], 100 + i), f"request {i}")


@pytest.mark.parametrize("response_format", ["opus", "flac", "mp3"])
def test_compressed_formats_decode_to_the_same_length(service, client, response_format):
    body = speak(client, "Speech models turn text into sound.", seed=11, response_format=response_format)[0]
    audio, rate = sf.read(io.BytesIO(body), dtype="float32")
    want = reference_pcm16(service, "Speech models turn text into sound.", "tara", 11)
    assert rate == RATE
    if response_format == "flac":  # lossless
        assert audio.size == want.size
        assert np.max(np.abs(np.round(audio * 32768).astype(np.int32) - want)) <= PCM16_TOLERANCE
    else:  # lossy codecs may pad to their frame size
        assert abs(audio.size - want.size) <= 0.05 * want.size, (audio.size, want.size)


@pytest.mark.parametrize("fields, param", [
    ({"extra_body": {"temperature": -1.0}}, "temperature"),
    ({"extra_body": {"top_p": 0.0}}, "top_p"),
    ({"extra_body": {"max_tokens": 0}}, "max_tokens"),
    ({"extra_body": {"seed": -5}}, "seed"),
    ({"extra_body": {"top_k": "many"}}, "top_k"),
    ({"extra_body": {"temprature": 0.5}}, "temprature"),
    ({"voice": "nobody"}, "voice"),
    ({"input": "   "}, "input"),
    ({"input": "x" * 4100}, "input"),
    ({"speed": 1.5}, "speed"),
    ({"response_format": "aac"}, "response_format"),
    ({"instructions": "whisper"}, "instructions"),
    ({"extra_body": {"cfg_weight": 0.5}}, "cfg_weight"),  # Orpheus has no guidance: the engine refuses it
    ({"extra_body": {"exaggeration": 0.7}}, "exaggeration"),  # no EXAGGERATION input: the API refuses it
])
def test_bad_input_gets_an_openai_error_naming_the_field(service, client, fields, param):
    request = {"model": "orpheus", "voice": "tara", "input": "Hello there.", **fields}
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.speech.create(**request)
    assert e.value.status_code == 400
    assert e.value.param == param and e.value.type == "invalid_request_error", e.value.body
    assert param.split("_")[0] in e.value.message.lower()


def test_unknown_model_is_not_found(service, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.audio.speech.create(model="tts-1", voice="tara", input="Hello.")
    assert e.value.param == "model" and e.value.code == "model_not_found"


def test_models_and_voices_come_from_the_server(service, client):
    models = {m.id: m for m in client.models.list().data}
    assert list(models) == ["orpheus", "step_audio2"]  # the front models; the preprocesses they call are not listed
    info = models["orpheus"].model_dump()
    assert info["engine"] == "orpheus" and info["sample_rate"] == RATE and info["voices"] == list(VOICES)
    assert info["guidance"] is False  # no cfg_weight but 0
    assert info["conversation"] is False and models["step_audio2"].model_dump()["conversation"] is True  # TEXT_OUT
    voices = get_json(service["api"] + "/v1/audio/voices")
    assert [v["voice_id"] for v in voices["voices"] if v["model"] == "orpheus"] == list(VOICES)


def test_health_and_gauges(service):
    health = get_json(service["api"] + "/health")
    assert health["status"] == "ok" and health["triton"] == "ready"
    assert health["engines"] == {"orpheus": {"alive": True}, "step_audio2": {"alive": True}}  # each hosts its own
    stats = get_json(service["api"] + "/v1/stats")["models"]["orpheus"]
    assert stats["engine"] == "orpheus" and stats["engine_alive"] is True
    assert stats["kv_pages_total"] > 0 and stats["active_streams"] >= 0


def wait_idle(service, timeout: float = 10.0, model: str = "orpheus") -> float:
    """Seconds until the engine's active-streams gauge reads 0 (fails after timeout)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        stats = get_json(service["api"] + "/v1/stats")["models"][model]
        if stats["active_streams"] == 0 and stats["kv_pages_used"] == 0:
            return time.monotonic() - t0
        time.sleep(0.2)
    raise AssertionError(f"the engine still has {stats} {timeout} s after the client left")


def wait_active(service, timeout: float = 30.0, model: str = "orpheus") -> None:
    t0 = time.monotonic()
    while get_json(service["api"] + "/v1/stats")["models"][model]["active_streams"] == 0:
        assert time.monotonic() - t0 < timeout, "the request never became active"
        time.sleep(0.05)


def test_http_disconnect_cancels_the_generation(service, client):
    wait_idle(service)
    with client.audio.speech.with_streaming_response.create(
            model="orpheus", voice="tara", input="A long sentence that would take a while to say.",
            response_format="pcm", extra_body={"seed": 5, "max_tokens": 1200}) as response:
        stream = response.iter_bytes()
        next(stream)
        wait_active(service)
    wait_idle(service)


def ws_session(service, pieces: list[str], start: dict, stop_after_frames: int | None = None):
    """Send text pieces over the WebSocket; collect (messages, audio per sentence index)."""
    messages, audio, current = [], {}, None
    with ws_connect(service["api"].replace("http", "ws") + "/v1/audio/speech/stream", open_timeout=30) as ws:
        sends = [{"type": "start", **start}, *({"type": "text", "text": p} for p in pieces)]
        try:
            for message in sends + ([{"type": "end"}] if stop_after_frames is None else []):
                ws.send(json.dumps(message))
        except ConnectionClosed:  # the server refused the start and closed: read its error below
            pass
        frames = 0
        while True:
            try:
                message = ws.recv(timeout=120)
            except Exception:  # closed by the server after "done" or "error"
                break
            if isinstance(message, bytes):
                assert current is not None, "audio before its sentence message"
                audio[current] = audio.get(current, b"") + message
                frames += 1
                if stop_after_frames is not None and frames >= stop_after_frames:
                    return messages, audio  # leaving the with block drops the connection mid-stream
                continue
            messages.append(json.loads(message))
            if messages[-1]["type"] == "sentence":
                current = messages[-1]["index"]
    return messages, audio


def test_websocket_text_pieces_become_sentences_in_order(service):
    text = "Hello there, how are you? The quick brown fox jumps over the lazy dog. See you tomorrow"
    pieces = [text[i:i + 7] for i in range(0, len(text), 7)]  # cut mid-word, as an LLM streams tokens
    messages, audio = ws_session(service, pieces, {"model": "orpheus", "voice": "leo", "seed": 21,
                                                    "max_tokens": MAX_TOKENS, "top_k": TOP_K})
    sentences = [m for m in messages if m["type"] == "sentence"]
    assert [m["text"] for m in sentences] == ["Hello there, how are you?",
                                              "The quick brown fox jumps over the lazy dog.", "See you tomorrow"]
    assert [m["index"] for m in sentences] == [0, 1, 2] and all(m["sample_rate"] == RATE for m in sentences)
    ends = [m for m in messages if m["type"] == "sentence_end"]
    assert [m["index"] for m in ends] == [0, 1, 2]
    done = messages[-1]
    assert done["type"] == "done" and done["stats"]["sentences"] == 3
    assert done["stats"]["chunks"] == sum(m["chunks"] for m in ends) and done["stats"]["ttfa_s"] > 0
    for m in sentences:  # each sentence's audio is that sentence's, in its place
        assert_same_audio(np.frombuffer(audio[m["index"]], dtype="<i2"),
                          reference_pcm16(service, m["text"], "leo", 21), f"sentence {m['index']}")


def test_websocket_bad_start_gets_an_error_naming_the_field(service):
    messages, _ = ws_session(service, ["Hello."], {"model": "orpheus", "voice": "nobody", "top_p": 0.0})
    errors = [m for m in messages if m["type"] == "error"]
    assert len(errors) == 1 and errors[0]["error"]["param"] in ("voice", "top_p"), messages
    messages, _ = ws_session(service, ["Hello."], {"model": "nope"})
    assert messages[-1]["type"] == "error" and messages[-1]["error"]["code"] == "model_not_found"


def test_websocket_disconnect_frees_the_engine(service):
    wait_idle(service)
    ws_session(service, ["One long sentence here. ", "And another long one after it. "],
               {"model": "orpheus", "seed": 9, "max_tokens": 1200}, stop_after_frames=2)
    assert wait_idle(service) < 10.0


# --- /v1/chat/completions: the conversation model (Step-Audio 2's tiny random checkpoint) ---------------------------

CHAT_MODEL = "step_audio2"
CHAT_TOKENS = 64  # text and audio ids together: a piece of text and one chunk of audio
SYSTEM = "You are a friendly voice assistant. Answer briefly."


def clip_wav(seconds: float, rate: int, seed: int) -> bytes:
    """A tone with a little noise: a spoken turn's stand-in, as a 16-bit WAV file."""
    t = np.arange(int(seconds * rate)) / rate
    noise = np.random.default_rng(seed).standard_normal(t.size)
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * (150 + 40 * seed) * t) + 0.05 * noise).astype(np.float32), rate,
             format="WAV", subtype="PCM_16")
    return buf.getvalue()


CLIP = clip_wav(1.0, 16000, 1)


def audio_part(clip: bytes) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(clip).decode(), "format": "wav"}}


def chat_reference(service, seed: int, max_tokens: int = CHAT_TOKENS, text: str | None = None,
                   clip: bytes | None = None, **fields):
    """The Triton client's reply to the same turn (make_inputs' fields: system_prompt, history, speak)."""
    out = stream_request(service["grpc"], CHAT_MODEL, make_inputs(text, None, "pcm16", input_audio=clip,
                                                                  MAX_TOKENS=max_tokens, SEED=seed, **fields),
                         "pcm16", timeout=120)
    assert out.error is None, out.error
    return out


def talkative(service, seeds: range, speaks: bool = True, **turn):
    """(seed, the Triton client's reply) for the first seed whose reply to `turn` holds text (and audio when it
    speaks): the tiny random model often answers in audio alone, and which seeds do depends on float rounding
    (threads, machine), so the tests look for one rather than name it."""
    for seed in seeds:
        out = chat_reference(service, seed, **turn, **({} if speaks else {"speak": False}))
        if out.text and (out.chunks or not speaks):
            return seed, out
    raise AssertionError(f"no seed in {seeds} gives a reply with text to {list(turn)}")


@pytest.fixture(scope="module")
def talk(service) -> dict:
    """A seed whose reply to CLIP (CHAT_TOKENS steps) holds text and audio, and that reply."""
    seed, reply = talkative(service, range(1, 40), clip=CLIP)
    return {"seed": seed, "reply": reply}


def chat_stream(client, messages: list, **fields) -> tuple[list, list, bytes]:
    """Stream one chat request: (its chunks, its events in order: ("text", piece) / ("audio", samples), its PCM16)."""
    chunks = list(client.chat.completions.create(model=CHAT_MODEL, messages=messages, stream=True, **fields))
    events, pcm = [], b""
    for chunk in chunks:
        assert chunk.object == "chat.completion.chunk" and chunk.id == chunks[0].id and len(chunk.choices) == 1
        delta = chunk.choices[0].delta
        if delta.audio and delta.audio.transcript:
            events.append(("text", delta.audio.transcript))
        if delta.content:
            events.append(("text", delta.content))
        if delta.audio and delta.audio.data:
            data = base64.b64decode(delta.audio.data)
            events.append(("audio", len(data) // 2))
            pcm += data
    return chunks, events, pcm


def assert_same_pieces(events: list, want, what: str) -> None:
    """The same text pieces and the same audio chunks as the Triton client got. How they interleave is paced by the
    server's clock (two runs of one request may swap a piece and a chunk), so the order is checked against a
    stand-in stream in tests/test_api_chat.py."""
    assert [p for kind, p in events if kind == "text"] == [p for _, _, p in want.text_pieces], f"{what}: text"
    assert [n for kind, n in events if kind == "audio"] == [c.size for c in want.chunks], f"{what}: audio chunks"


def pcm16(out) -> np.ndarray:
    return np.round(out.audio * 32767.0).astype(np.int32)


def test_chat_streams_the_text_and_audio_pieces_triton_sends(service, client, talk):
    want = chat_reference(service, talk["seed"], 400, clip=CLIP)  # a longer reply: several audio chunks
    assert len(want.chunks) >= 2 and want.text
    chunks, events, pcm = chat_stream(client, [{"role": "user", "content": [audio_part(CLIP)]}],
                                      modalities=["text", "audio"], audio={"voice": "default", "format": "pcm16"},
                                      seed=talk["seed"], extra_body={"max_tokens": 400})
    assert_same_pieces(events, want, "streamed reply")
    assert_same_audio(np.frombuffer(pcm, "<i2"), pcm16(want), "streamed reply")
    assert chunks[0].choices[0].delta.role == "assistant"
    audio_ids = {c.choices[0].delta.audio.id for c in chunks if c.choices[0].delta.audio}
    assert len(audio_ids) == 1 and audio_ids.pop().startswith("audio_")
    assert chunks[-2].choices[0].delta.audio.expires_at > time.time()  # OpenAI's last audio delta: its expiry
    assert chunks[-1].choices[0].finish_reason == want.finish_reason in ("stop", "length")
    assert chunks[-1].model_extra["seed"] == talk["seed"]


def test_chat_whole_reply_equals_the_triton_client(service, client, talk):
    want = talk["reply"]
    for fmt, tokens in (("wav", {"extra_body": {"max_tokens": CHAT_TOKENS}}),
                        ("pcm16", {"max_completion_tokens": CHAT_TOKENS})):
        reply = client.chat.completions.create(model=CHAT_MODEL, modalities=["text", "audio"], seed=talk["seed"],
                                               audio={"voice": "default", "format": fmt},
                                               messages=[{"role": "user", "content": [audio_part(CLIP)]}], **tokens)
        message = reply.choices[0].message
        assert reply.object == "chat.completion" and message.role == "assistant" and message.content is None
        assert message.audio.transcript == want.text and message.audio.expires_at > time.time()
        data = base64.b64decode(message.audio.data)
        if fmt == "wav":
            assert struct.unpack("<I", data[40:44])[0] == len(data) - 44  # a whole file: its real size
            audio, rate = sf.read(io.BytesIO(data), dtype="int16")
            assert rate == RATE
        else:
            audio = np.frombuffer(data, "<i2")
        assert_same_audio(audio, pcm16(want), fmt)
        assert reply.choices[0].finish_reason == want.finish_reason


def test_chat_conversation_with_system_and_history_equals_the_triton_client(service, client, talk):
    """An earlier spoken reply comes back by its audio id (OpenAI's multi-turn form) as its transcript; the system
    message, the earlier turns and the last one reach the model as the Triton client sends them."""
    first = client.chat.completions.create(model=CHAT_MODEL, modalities=["text", "audio"], seed=talk["seed"],
                                           audio={"voice": "default", "format": "wav"},
                                           messages=[{"role": "user", "content": [audio_part(CLIP)]}],
                                           extra_body={"max_tokens": CHAT_TOKENS})
    said = first.choices[0].message.audio
    assert said.transcript == talk["reply"].text
    last = clip_wav(1.2, 22050, 3)
    earlier = [{"role": "system", "content": SYSTEM},
               {"role": "user", "content": [audio_part(CLIP)]},
               {"role": "assistant", "audio": {"id": said.id}},
               {"role": "user", "content": "And a text turn."},
               {"role": "assistant", "content": [{"type": "text", "text": "A text answer."}]}]
    history = [{"role": "user", "text": "", "audio": CLIP}, {"role": "assistant", "text": said.transcript},
               {"role": "user", "text": "And a text turn."}, {"role": "assistant", "text": "A text answer."}]
    seed, want = talkative(service, range(5, 40), text="What is this sound?", clip=last, system_prompt=SYSTEM,
                           history=history)
    _, events, pcm = chat_stream(client, [*earlier, {"role": "user", "content": [
        {"type": "text", "text": "What is this sound?"}, audio_part(last)]}], modalities=["text", "audio"],
        audio={"voice": "default", "format": "pcm16"}, seed=seed, extra_body={"max_tokens": CHAT_TOKENS})
    assert_same_pieces(events, want, "a reply to the conversation")
    assert_same_audio(np.frombuffer(pcm, "<i2"), pcm16(want), "a reply to the conversation")
    # a text reply (SPEAK false), whole and streamed
    seed, want = talkative(service, range(5, 40), speaks=False, text="In text, please.", system_prompt=SYSTEM,
                           history=history)
    assert not want.chunks
    turn = [*earlier, {"role": "user", "content": "In text, please."}]
    reply = client.chat.completions.create(model=CHAT_MODEL, modalities=["text"], messages=turn, seed=seed,
                                           extra_body={"max_tokens": CHAT_TOKENS})
    assert reply.choices[0].message.content == want.text and reply.choices[0].message.audio is None
    _, events, pcm = chat_stream(client, turn, seed=seed, extra_body={"max_tokens": CHAT_TOKENS})  # text: default
    assert_same_pieces(events, want, "a text reply")
    assert pcm == b""


def _user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


@pytest.mark.parametrize("fields, param, says", [
    ({"audio": {"voice": "nobody", "format": "wav"}}, "audio.voice", "unknown voice 'nobody'"),
    ({"audio": {"voice": "default", "format": "aac"}}, "audio.format", "'aac' is not supported"),
    ({"stream": True, "audio": {"voice": "default", "format": "wav"}}, "audio.format", "pcm16"),
    ({"model": "orpheus"}, "model", "text-to-speech model"),
    ({"messages": _user({"type": "text", "text": "  "})}, "messages[0].content", "is empty"),
    ({"messages": [{"role": "system", "content": SYSTEM}]}, "messages", "the last message must be the user's"),
    ({"messages": _user({"type": "input_audio", "input_audio": {"data": "no base64!", "format": "wav"}})},
     "messages[0].content[0].input_audio.data", "not valid base64"),
    ({"messages": _user(audio_part(b"RIFF and then nothing"))},  # Triton reads the clip
     "messages[0].content[0].input_audio", "messages[0].content[0].input_audio is not a readable audio file"),
    ({"messages": _user({"type": "text", "text": "Hi"}, audio_part(clip_wav(61, 8000, 0)))},
     "messages[0].content[1].input_audio", "is 61.00 s; the limit is 60 s"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}] * 17
      + [{"role": "user", "content": "Hi"}]}, "messages", "history has 34 turns; the limit is 32"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "audio": {"id": "audio_gone"}},
                   {"role": "user", "content": "Hi"}]}, "messages[1].audio.id", "'audio_gone' is no spoken reply"),
    ({"messages": _user({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}})},
     "messages[0].content[0].type", "'image_url' is not supported"),
    ({"messages": [{"role": "tool", "content": "42", "tool_call_id": "1"}, {"role": "user", "content": "Hi"}]},
     "messages[0].role", "'tool' is not supported"),
    ({"temperature": -1.0}, "temperature", "temperature must be >= 0"),
    ({"top_p": 0.0}, "top_p", "top_p must be in (0, 1]"),
    ({"max_completion_tokens": 0, "extra_body": {}}, "max_completion_tokens", "max_completion_tokens must be"),
    ({"max_completion_tokens": 9}, "max_completion_tokens", "not both"),  # and max_tokens 8 (extra_body)
    ({"n": 2}, "n", "not supported"),
    ({"modalities": ["image"]}, "modalities", "modalities must be"),
    ({"extra_body": {"temprature": 0.5}}, "temprature", "unknown field"),
])
def test_chat_bad_input_gets_an_openai_error_naming_the_field(service, client, fields, param, says):
    request = {"model": CHAT_MODEL, "modalities": ["text", "audio"], "audio": {"voice": "default", "format": "wav"},
               "messages": [{"role": "user", "content": "Hi"}], "seed": 1, "extra_body": {"max_tokens": 8}, **fields}
    with pytest.raises(openai.BadRequestError) as e:
        reply = client.chat.completions.create(**request)
        list(reply) if request.get("stream") else None
    assert e.value.status_code == 400 and e.value.type == "invalid_request_error", e.value.body
    assert e.value.param == param and says in e.value.message, e.value.body


def test_chat_disconnect_cancels_the_reply(service, client):
    """A client that leaves, mid-stream or waiting for a whole reply (its timeout), stops the generation."""
    wait_idle(service, model=CHAT_MODEL)
    long = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "modalities": ["text", "audio"], "seed": 2, "extra_body": {"max_tokens": 3000}}
    with client.chat.completions.create(stream=True, audio={"voice": "default", "format": "pcm16"}, **long) as stream:
        next(iter(stream))
        wait_active(service, model=CHAT_MODEL)
    wait_idle(service, model=CHAT_MODEL)
    impatient = client.with_options(timeout=1.5)
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(audio={"voice": "default", "format": "wav"}, **long)
    wait_idle(service, model=CHAT_MODEL)


def test_server_down_is_503(tmp_path):
    """An API whose Triton does not answer: /health and speech say 503 in OpenAI's shape."""
    from voxbackend.api.server import ApiServer

    with ApiServer(f"127.0.0.1:{free_port()}", None, prefetch_voices=False).start(30, wait_healthy=False) as api:
        assert http_status(api.url + "/health") == 503
        down = openai.OpenAI(base_url=api.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            down.audio.speech.create(model="orpheus", voice="tara", input="Hello.")
        assert e.value.status_code == 503 and e.value.code == "server_unavailable"


@pytest.mark.parametrize("message, status, param, code", [
    ("in ensemble 'orpheus', InvalidRequest: TOP_P must be in (0, 1], got 0.0", 400, "top_p", "invalid_value"),
    ("InvalidRequest: unknown voice 'bob'; choose one of tara, leo", 400, "voice", "invalid_value"),
    ("InvalidRequest: SPEAKER must be in [0, 10), got 12", 400, "voice", "invalid_value"),
    ("InvalidRequest: CFG_WEIGHT must be in [0, 10] (0 = no guidance), got -0.5", 400, "cfg_weight", "invalid_value"),
    ("InvalidRequest: EXAGGERATION must be in [0, 2], got 2.5", 400, "exaggeration", "invalid_value"),
    ("InvalidRequest: prompt is 2205 positions (text and context audio); the model's context is 2048", 400, "input",
     "invalid_value"),
    ("EngineOverloaded: overloaded: 257 requests are queued (max_queue)", 429, None, "engine_overloaded"),
    ("EngineDead: the engine loop died", 503, None, "engine_dead"),
    ("engine stopped: 3 engine steps failed in a row; last: boom", 503, None, "engine_error"),
    ("in ensemble 'orpheus', engine step failed: CUDA error", 503, None, "engine_error"),
    ("[StatusCode.UNAVAILABLE] failed to connect to all addresses", 503, None, "server_unavailable"),
    ("draining: the server is stopping and takes no new streams; retry on another instance", 503, None,
     "server_draining"),
    ("Server is stopping, scheduler for model has stopped accepting new inference requests", 503, None,
     "server_draining"),
    ("Request for unknown model: 'orpheus' has no available versions", 503, None, "server_draining"),
])
def test_triton_messages_map_to_http_errors(message, status, param, code):
    error = api_errors.from_triton(message)
    assert (error.status, error.param, error.code) == (status, param, code)
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}


def test_voice_goes_to_the_models_own_voice_input():
    """A named-voice model gets VOICE; a speaker-id model (CSM's SPEAKER) gets the voice as an integer id."""
    from voxbackend.api.catalog import SpeechModel
    from voxbackend.api.requests import SynthesisOptions
    from voxbackend.api.triton_stream import speech_inputs

    models = {"orpheus": SpeechModel("orpheus", "orpheus_engine", "orpheus_preprocess", ("TEXT", "VOICE", "SEED")),
              "csm": SpeechModel("csm", "csm_engine", "csm_preprocess", ("TEXT", "SPEAKER", "CONTEXT_TEXT"))}
    model, voice = SynthesisOptions(model="csm", voice="3").resolve(models)
    tensors = {t.name(): t for t in speech_inputs("Hi.", model.voice_input, voice, {"SEED": 1})}
    assert set(tensors) == {"TEXT", "SPEAKER", "AUDIO_FORMAT", "SEED"} and tensors["SPEAKER"].datatype() == "INT32"
    with pytest.raises(api_errors.ApiError) as e:
        SynthesisOptions(model="csm", voice="tara").resolve(models)
    assert e.value.param == "voice"
    model, voice = SynthesisOptions(model="orpheus", voice={"id": "leo"}).resolve(models)
    assert {t.name() for t in speech_inputs("Hi.", model.voice_input, voice, {})} == {"TEXT", "VOICE", "AUDIO_FORMAT"}
    assert SynthesisOptions().resolve(models)[0].name == "csm"  # the WebSocket's default: the first by name


def test_chatterbox_fields_go_to_its_tensors():
    """cfg_weight is a sampling tensor (CFG_WEIGHT); exaggeration goes to the models whose config lists EXAGGERATION
    and is refused for the others; no voice sends no VOICE (Chatterbox's built-in voice)."""
    from voxbackend.api.catalog import SpeechModel
    from voxbackend.api.requests import SynthesisOptions
    from voxbackend.api.triton_stream import speech_inputs

    models = {"chatterbox": SpeechModel("chatterbox", "chatterbox", "chatterbox_preprocess",
                                        ("TEXT", "VOICE", "REFERENCE_AUDIO", "EXAGGERATION", "CFG_WEIGHT")),
              "orpheus": SpeechModel("orpheus", "orpheus", "orpheus_preprocess", ("TEXT", "VOICE", "CFG_WEIGHT"))}
    options = SynthesisOptions(model="chatterbox", exaggeration=0.9, cfg_weight=0.0)
    model, voice = options.resolve(models)
    assert voice is None
    tensors = {t.name(): t for t in speech_inputs("Hi.", model.voice_input, voice, options.sampling(),
                                                  options.model_inputs(model))}
    assert set(tensors) == {"TEXT", "AUDIO_FORMAT", "CFG_WEIGHT", "EXAGGERATION"}
    assert tensors["EXAGGERATION"].datatype() == "FP32"
    assert np.frombuffer(tensors["EXAGGERATION"]._get_content(), "<f4").tolist() == [np.float32(0.9)]
    model, voice = SynthesisOptions(model="chatterbox", voice="narrator").resolve(models)
    assert voice == "narrator" and model.voice_input == "VOICE"
    with pytest.raises(api_errors.ApiError) as e:
        SynthesisOptions(model="orpheus", exaggeration=0.9).resolve(models)
    assert (e.value.param, e.value.code) == ("exaggeration", "unsupported_value")


def test_chatterbox_front_end_lists_its_stored_voices(tmp_path):
    """/v1/models' voices, rate and guidance come from the front end: the tiny checkpoint with one stored voice."""
    from voxbackend.api.catalog import SpeechModel, ask_frontends
    from voxbackend.models.chatterbox.tiny import ensure_default_chatterbox
    from voxbackend.models.chatterbox.voice import ChatterboxVoice

    built, _ = ensure_default_chatterbox()  # the run's cached build
    folder = tmp_path / "chatterbox"
    folder.mkdir()
    for f in built.iterdir():
        (folder / f.name).symlink_to(f)
    (folder / "voices").mkdir()
    ChatterboxVoice.from_conds(built / "conds.pt").save(folder / "voices" / "narrator.safetensors")
    info = ask_frontends({"chatterbox": {"checkpoint": str(folder)}}, timeout=300)
    assert info == {"chatterbox": {"voices": ["narrator"], "sample_rate": RATE, "guidance": True}}
    model = SpeechModel("chatterbox", "chatterbox", "chatterbox_preprocess", ("TEXT", "VOICE", "EXAGGERATION"),
                        voices=tuple(info["chatterbox"]["voices"]), guidance=True)
    assert model.describe()["voices"] == ["narrator"] and model.describe()["voice_kind"] == "name"


def test_front_end_query_does_not_queue_behind_triton_stubs():
    """The API's voice query finds the default checkpoint in its own interpreter, without the machine-wide lock that
    Triton stubs take in turn to build theirs (a CI run's player screenshot waited past 120 s behind other servers'
    loads): it answers while this test holds that lock."""
    import fcntl

    from voxbackend.api.catalog import ask_frontends
    from voxbackend.triton import loading

    held = open(Path(loading.tempfile.gettempdir()) / f"voxbackend-default-checkpoint-{os.getuid()}.lock", "w")
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        info = ask_frontends({"orpheus": {"checkpoint": "", "default_checkpoint":
                                          "voxbackend.models.orpheus.tiny:ensure_default_checkpoint"}}, timeout=60)
    finally:
        held.close()
    assert info["orpheus"]["sample_rate"] == 24000 and "tara" in info["orpheus"]["voices"], info


def test_health_is_503_when_an_engine_died(monkeypatch):
    import asyncio

    from voxbackend.api import app as api_app
    from voxbackend.api.catalog import SpeechModel

    class Catalog:
        url = "unused:1"

        async def models(self):
            return {"orpheus": SpeechModel("orpheus", "orpheus_engine", "orpheus_preprocess", ("TEXT", "VOICE"))}

    monkeypatch.setattr(api_app, "_triton_ready", lambda url: True)  # Triton's readiness stays green (docs/triton.md)
    for alive, want in ((1, True), (0, False)):
        text = f'voxbackend_engine_alive{{instance="0",model="orpheus_engine"}} {alive}\n'
        monkeypatch.setattr(gauges, "read", lambda url, text=text: gauges.parse(text))
        report, ok = asyncio.run(api_app._health(Catalog(), "http://metrics"))
        assert ok is want and report["engines"]["orpheus_engine"]["alive"] is want, report


def test_gauges_sum_instances_and_one_dead_engine_is_dead():
    text = """# TYPE voxbackend_active_streams gauge
voxbackend_active_streams{instance="a",model="orpheus_engine"} 2
voxbackend_active_streams{instance="b",model="orpheus_engine"} 3
voxbackend_kv_pages_total{instance="a",model="orpheus_engine"} 1024
voxbackend_engine_alive{instance="a",model="orpheus_engine"} 1
voxbackend_engine_alive{instance="b",model="orpheus_engine"} 0
voxbackend_engine_alive{instance="0",model="csm_engine"} 1
nv_inference_count{model="orpheus",version="1"} 7
"""
    parsed = gauges.parse(text)
    assert parsed["orpheus_engine"] == {"active_streams": 5, "kv_pages_total": 1024, "engine_alive": False,
                                        "instances": 2}
    assert parsed["csm_engine"] == {"engine_alive": True, "instances": 1}


def test_sentence_buffer_cuts_at_boundaries_only():
    buf = SentenceBuffer(max_chars=40)
    assert buf.add("Pi is 3.") == [] and buf.add("14, right? Yes") == ["Pi is 3.14, right?"]
    assert buf.add("! And a line\nbreak") == ["Yes!", "And a line"]
    # no boundary within max_chars: cut at the last space before it
    assert buf.add(" " + "word " * 12) == ["break word word word word word word"]
    assert buf.flush() == ["word word word word word word"] and buf.flush() == []


@pytest.fixture(scope="module")
def page():
    """Headless Chromium (Selenium), one for the module's page tests; its microphone is Chromium's fake device (a
    beep), granted without asking."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert browser and driver, "Debian's chromium and chromium-driver are needed (scripts/setup_env.sh installs them)"
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1100,760",
                "--autoplay-policy=no-user-gesture-required", "--use-fake-device-for-media-stream",
                "--use-fake-ui-for-media-stream"):
        options.add_argument(arg)
    page = webdriver.Chrome(service=Service(driver), options=options)
    try:
        yield page
    finally:
        page.quit()


def test_page_plays_a_stream_in_headless_chromium(service, page, tmp_path):
    from selenium.webdriver.common.by import By

    page.get(service["api"] + "/")
    until(lambda: page.execute_script("return document.getElementById('model').options.length") > 0, 30)
    assert page.execute_script(
        "return [...document.getElementById('voice').options].map(o => o.value)") == ["", *VOICES]
    assert not page.find_element(By.ID, "exaggeration").is_displayed()  # Orpheus takes neither
    assert not page.find_element(By.ID, "cfg-weight").is_displayed()
    max_tokens = page.find_element(By.ID, "max-tokens")
    max_tokens.clear()
    max_tokens.send_keys("210")
    page.find_element(By.ID, "play").click()
    # sound is playing and a second of it has come in: the screenshot shows the stream mid-way
    until(lambda: page.execute_script("return window.voxPlayer.audibleFrames > 0 && window.voxPlayer.audioS > 1"),
          90)
    shot = tmp_path / "player.png"
    page.save_screenshot(str(shot))
    print(f"screenshot: {shot}")
    until(lambda: page.execute_script("return window.voxPlayer.done"), 90)
    state = page.execute_script("return window.voxPlayer")
    assert state["error"] is None, state["error"]
    assert state["samplesScheduled"] == state["samplesReceived"] > RATE // 2, state
    # (how many reads the bytes took is the browser's business: a starved one reads everything at once)
    assert state["chunks"] >= 1 and state["ttfaMs"] > 0
    assert page.find_element(By.ID, "ttfa").text.endswith(" ms")
    until(lambda: "orpheus (orpheus)" in page.find_element(By.ID, "gauges").text, 10)
    assert shot.stat().st_size > 10_000
    # a Chatterbox as /v1/models describes it: its built-in voice is "(default)", its own controls appear
    page.execute_script("""
        models.chatterbox = {id: "chatterbox", voices: ["narrator"], voice_kind: "name", guidance: true,
                             inputs: ["TEXT", "VOICE", "REFERENCE_AUDIO", "EXAGGERATION", "CFG_WEIGHT"]};
        $("model").insertAdjacentHTML("beforeend", "<option>chatterbox</option>");
        $("model").value = "chatterbox";
        $("model").dispatchEvent(new Event("change"));""")
    assert page.execute_script(
        "return [...document.getElementById('voice').options].map(o => o.value)") == ["", "narrator"]
    page.find_element(By.ID, "exaggeration").send_keys("0.8")
    page.find_element(By.ID, "cfg-weight").send_keys("0")
    assert page.execute_script("return requestFields()") == {
        "model": "chatterbox", "seed": 7, "max_tokens": 210, "exaggeration": 0.8, "cfg_weight": 0}


def test_page_talks_with_a_conversation_model_in_headless_chromium(service, page, tmp_path):
    """Record from the (fake) microphone, send, hear the reply stream and read its transcript; then a typed turn
    goes along with the first one as history. The reply is the Triton client's to the WAV the page sent."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    page.get(service["api"] + "/")
    until(lambda: page.execute_script("return document.getElementById('model').options.length") == 2, 30)
    Select(page.find_element(By.ID, "model")).select_by_visible_text(CHAT_MODEL)
    assert page.find_element(By.ID, "chat").is_displayed() and not page.find_element(By.ID, "play").is_displayed()
    max_tokens = page.find_element(By.ID, "max-tokens")
    max_tokens.clear()
    max_tokens.send_keys("160")  # audio and text with the page's seed 7
    page.find_element(By.ID, "record").click()
    until(lambda: page.execute_script("return voxChat.clipS") > 1.0, 30)
    page.find_element(By.ID, "record").click()
    assert page.execute_script("return voxChat.recording") is False
    page.find_element(By.ID, "send").click()
    until(lambda: page.execute_script("return voxChat.done"), 90)
    chat, player = page.execute_script("return [voxChat, voxPlayer]")
    assert chat["error"] is None, chat["error"]
    first = chat["lastRequest"]
    assert first["stream"] is True and first["audio"] == {"voice": "default", "format": "pcm16"}
    [turn] = first["messages"]
    clip = base64.b64decode(turn["content"][0]["input_audio"]["data"])
    info = sf.info(io.BytesIO(clip))
    assert info.subtype == "PCM_16" and info.channels == 1 and info.duration > 1.0  # encoded by the page
    want = chat_reference(service, seed=7, max_tokens=160, clip=clip)
    assert chat["transcript"] == want.text and chat["textPieces"] == len(want.text_pieces)
    assert page.execute_script("return document.querySelector('.turn.assistant .text').textContent") == want.text
    assert player["samplesScheduled"] == player["samplesReceived"] == want.audio.size > 0
    assert chat["audioPieces"] == len(want.chunks) and player["ttfaMs"] > 0  # a delta per chunk
    until(lambda: page.execute_script("return voxPlayer.audibleFrames > 0"), 30)  # the reply really played
    page.find_element(By.ID, "chat-text").send_keys("And what now?")
    page.find_element(By.ID, "send").click()
    until(lambda: page.execute_script("return voxChat.done && voxChat.turns === 2"), 90)
    chat = page.execute_script("return voxChat")
    assert chat["error"] is None, chat["error"]
    said = [{"role": "assistant", "content": want.text}] if want.text else []
    assert chat["lastRequest"]["messages"] == [turn, *said, {"role": "user", "content": [
        {"type": "text", "text": "And what now?"}]}]
    assert len(page.find_elements(By.CSS_SELECTOR, ".turn")) == 4
    shot = tmp_path / "conversation.png"
    page.save_screenshot(str(shot))
    print(f"screenshot: {shot}")


def until(check, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out waiting for the page"
        time.sleep(0.2)
