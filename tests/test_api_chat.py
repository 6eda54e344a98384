"""/v1/chat/completions without a server: a chat request's messages as a conversation model's turn (chat_turns.py),
Triton's refusals named by the request's own paths (errors.from_triton with a chat request's map), and the reply's
event stream (chat.py) from a stand-in Triton stream, an error mid-way included. tests/test_api.py runs it end to end.
"""
from __future__ import annotations

import asyncio
import base64
import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from voxbackend.api.catalog import SpeechModel  # noqa: E402
from voxbackend.api.chat import ChatReply  # noqa: E402
from voxbackend.api.chat_request import ChatRequest  # noqa: E402
from voxbackend.api.chat_turns import conversation  # noqa: E402
from voxbackend.api.errors import ApiError, from_triton, unavailable  # noqa: E402
from voxbackend.api.replies import Transcripts  # noqa: E402
from voxbackend.api.requests import validation_error  # noqa: E402
from voxbackend.api.triton_stream import AudioChunk, TextPiece  # noqa: E402

TALKER = SpeechModel("talker", "talker", "talker_preprocess",
                     ("TEXT", "INPUT_AUDIO", "VOICE", "SPEAK", "SYSTEM_PROMPT", "HISTORY_ROLE", "HISTORY_TEXT",
                      "HISTORY_AUDIO", "SEED", "MAX_TOKENS"), ("AUDIO", "SAMPLE_RATE", "TEXT_OUT"), voices=("default",))
SPEAKER = SpeechModel("speaker", "speaker", "speaker_preprocess", ("TEXT", "VOICE"), ("AUDIO",))
ONE_TURN = SpeechModel("one_turn", "one_turn", None, ("TEXT", "INPUT_AUDIO"), ("AUDIO", "TEXT_OUT"))


def audio(data: bytes) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}


def test_messages_become_the_turn_its_history_and_system_prompt():
    transcripts = Transcripts()
    transcripts.add("audio_1", "It was a bird.")
    turn = conversation([
        {"role": "developer", "content": "Be brief."},
        {"role": "system", "content": [{"type": "text", "text": "Speak English."}]},
        {"role": "user", "content": [audio(b"clip one")]},
        {"role": "assistant", "content": None, "audio": {"id": "audio_1"}},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "audio": {"transcript": "You are welcome."}},
        {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "this?"},
                                     audio(b"clip two")], "name": "ann"},
    ], TALKER, transcripts)
    assert (turn.text, turn.audio, turn.system) == ("What is\nthis?", b"clip two", "Be brief.\n\nSpeak English.")
    assert turn.history == [{"role": "user", "text": None, "audio": b"clip one"},
                            {"role": "assistant", "text": "It was a bird.", "audio": None},
                            {"role": "user", "text": "Thanks!", "audio": None},
                            {"role": "assistant", "text": "You are welcome.", "audio": None}]
    assert turn.params["INPUT_AUDIO"] == "messages[6].content[2].input_audio"
    assert turn.params["HISTORY_AUDIO[0]"] == "messages[2].content[0].input_audio"
    assert turn.params["HISTORY_TEXT[3]"] == "messages[5].content"
    assert turn.params["SYSTEM_PROMPT"] == "messages[0].content"


@pytest.mark.parametrize("messages, model, param, says", [
    ([], TALKER, "messages", "empty"),
    ([{"role": "user", "content": "Hi"}, {"role": "system", "content": "Late."}, {"role": "user", "content": "Hi"}],
     TALKER, "messages[1].role", "after the conversation started"),
    ([{"role": "user", "content": [audio(b"a"), audio(b"b")]}], TALKER, "messages[0].content[1]", "one input_audio"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "aiff"}}]}],
     TALKER, "messages[0].content[0].input_audio.format", "'aiff'"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], TALKER, "messages[0].content[0].text", "string"),
    ([{"role": "user", "content": None}], TALKER, "messages[0].content", "a string or a list"),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "   "}, {"role": "user", "content": "Hi"}],
     TALKER, "messages[1].content", "given by its text"),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": [{"id": "1"}]},
      {"role": "user", "content": "Hi"}], TALKER, "messages[1].tool_calls", "tool calls"),
    (["Hi"], TALKER, "messages[0]", "an object"),
    ([{"role": "user", "content": [audio(b"a")]}], SPEAKER, "messages[0].content[0].input_audio", "no audio input"),
    ([{"role": "system", "content": "Hi"}, {"role": "user", "content": "Hi"}], ONE_TURN, "messages[0].content",
     "no system prompt"),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}, {"role": "user", "content": "Hi"}],
     ONE_TURN, "messages", "one turn"),
])
def test_messages_the_model_cannot_take_are_refused_naming_the_path(messages, model, param, says):
    with pytest.raises(ApiError) as e:
        conversation(messages, model, Transcripts())
    assert (e.value.status, e.value.param) == (400, param) and says in e.value.message, e.value.body()


def test_triton_refusals_name_the_chat_requests_paths():
    turn = conversation([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"},
                         {"role": "user", "content": [audio(b"old")]}, {"role": "assistant", "content": "Hm"},
                         {"role": "user", "content": [{"type": "text", "text": "Now"}, audio(b"new")]}],
                        TALKER, Transcripts())
    request = ChatRequest(model="talker", messages=[], max_completion_tokens=0)
    params = {**request.params(), **turn.params}
    cases = {
        "InvalidRequest: HISTORY_AUDIO[2] is not a readable audio file (WAV, FLAC, OGG): Format not recognised.":
            ("messages[2].content[0].input_audio", "messages[2].content[0].input_audio is not a readable"),
        "InvalidRequest: INPUT_AUDIO is 61.00 s; the limit is 60 s":
            ("messages[4].content[1].input_audio", "messages[4].content[1].input_audio is 61.00 s"),
        "InvalidRequest: history has 33 turns; the limit is 32": ("messages", "history has 33 turns"),
        "InvalidRequest: VOICE: unknown voice 'x'; choose one of default": ("audio.voice", "audio.voice: unknown"),
        "InvalidRequest: MAX_TOKENS must be >= 1, got 0": ("max_completion_tokens", "max_completion_tokens must be"),
        "InvalidRequest: HISTORY_TEXT[1] is empty": ("messages[1].content", "messages[1].content is empty"),
    }
    for message, (param, starts) in cases.items():
        error = from_triton(message, params)
        assert (error.status, error.param) == (400, param) and error.message.startswith(starts), error.body()
    # the speech endpoint's mapping is as it was: the engine's "prompt" is the request's input
    error = from_triton("InvalidRequest: prompt is 2205 positions; the model's context is 2048")
    assert error.param == "input" and error.message.startswith("input is 2205 positions")


def test_chat_request_fields_are_checked_with_their_paths():
    with pytest.raises(Exception) as e:
        ChatRequest.model_validate({"model": "talker", "messages": [], "audio": {"voice": "x", "speed": 2}})
    error = validation_error(e.value, nested=True)
    assert (error.param, error.code) == ("audio.speed", "unknown_parameter")
    body = ChatRequest(model="talker", messages=[], audio={"voice": {"id": "default"}})
    assert body.voice(TALKER) is None and body.speaks(TALKER) and body.audio_format() == "wav"
    assert ChatRequest(model="talker", messages=[], stream=True, modalities=["text", "audio"]).audio_format() == "pcm16"
    assert not ChatRequest(model="talker", messages=[]).speaks(TALKER)  # OpenAI's default: text
    with pytest.raises(ApiError) as e:
        ChatRequest(model="talker", messages=[], audio={"voice": "alloy"}).voice(TALKER)
    assert e.value.param == "audio.voice" and "choose one of default" in e.value.message
    with pytest.raises(ApiError) as e:
        ChatRequest(model="speaker", messages=[]).resolve({"speaker": SPEAKER, "talker": TALKER})
    assert e.value.param == "model" and "conversation models here: talker" in e.value.message
    assert ChatRequest(model="t", messages=[], max_tokens=5, seed=3).sampling() == {"MAX_TOKENS": 5, "SEED": 3}


class StandIn:
    """A SpeechStream's reading side: the given events, then the end or an error."""

    def __init__(self, events: list, error: ApiError | None = None):
        self.events, self.error = list(events), error
        self.finish_reason, self.seed, self.sample_rate, self.closed = "stop", 11, 24000, False

    async def next_event(self):
        if self.events:
            return self.events.pop(0)
        if self.error:
            raise self.error
        return None

    async def close(self) -> None:
        self.closed = True


def sse(reply: ChatReply) -> list:
    async def read():
        return [piece async for piece in reply.events()]

    frames = b"".join(asyncio.run(read())).decode().split("\n\n")
    assert frames[-1] == "" and all(f.startswith("data: ") for f in frames[:-1])
    return [f[6:] if f == "data: [DONE]" else json.loads(f[6:]) for f in frames[:-1]]


def test_events_keep_triton_order_and_an_error_mid_way_ends_the_stream():
    pcm = b"\x01\x00\x02\x00"
    transcripts = Transcripts()
    stream = StandIn([TextPiece(" lk", 1), AudioChunk(pcm, 24000, 1), TextPiece("wa", 2)])
    reply = ChatReply(TALKER, stream, AudioChunk(pcm, 24000, 0), True, "pcm16", transcripts)
    events = sse(reply)
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert deltas[0]["role"] == "assistant" and base64.b64decode(deltas[0]["audio"]["data"]) == pcm
    assert [d["audio"].get("transcript") for d in deltas[1:4]] == [" lk", None, "wa"]
    assert deltas[4]["audio"]["expires_at"] > 0 and deltas[5] == {}
    assert events[5]["choices"][0]["finish_reason"] == "stop" and events[5]["seed"] == 11 and events[-1] == "[DONE]"
    assert stream.closed and transcripts.get(reply.audio_id) == " lkwa"
    # a text reply: content deltas; an engine failure after the first event: an error event, no [DONE]
    stream = StandIn([TextPiece("b", 0)], unavailable("engine stopped: boom", "engine_error"))
    events = sse(ChatReply(TALKER, stream, TextPiece("a", 0), False, "wav", Transcripts()))
    assert [e["choices"][0]["delta"] for e in events[:2]] == [{"role": "assistant", "content": "a"}, {"content": "b"}]
    assert events[-1] == {"error": {"message": "engine stopped: boom", "type": "server_error", "param": None,
                                    "code": "engine_error"}} and stream.closed


def test_transcripts_expire_and_are_bounded(monkeypatch):
    transcripts = Transcripts(ttl_s=10, limit=2)
    for n in range(3):
        transcripts.add(f"audio_{n}", f"reply {n}")
    assert [transcripts.get(f"audio_{n}") for n in range(3)] == [None, "reply 1", "reply 2"]
    monkeypatch.setattr("voxbackend.api.replies.time.time", lambda: 2e10)
    assert transcripts.get("audio_2") is None


def test_a_22_khz_reply_streams_as_24_khz_pcm16_equal_to_the_whole_resampled():
    """GLM-4-Voice speaks at 22.05 kHz; OpenAI's pcm16 is 24 kHz: the streamed deltas, joined, are the whole reply
    resampled (audio_io.StreamResampler holds each chunk's last fraction of a millisecond for the next), and a
    whole reply in pcm16 is the same samples."""
    from voxbackend.audio_io import StreamResampler, resample
    from voxbackend.triton.audio_encoding import decode, encode

    rng = np.random.default_rng(0)
    audio = (0.3 * rng.standard_normal(22050)).astype(np.float32)
    cuts = [0, 5000, 5001, 13000, 22050]
    chunks = [AudioChunk(encode(audio[a:b], "pcm16"), 22050, i) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))]
    want = decode(encode(resample(decode(encode(audio, "pcm16"), "pcm16"), 22050, 24000), "pcm16"), "pcm16")
    events = sse(ChatReply(TALKER, StandIn(chunks[1:]), chunks[0], True, "pcm16", Transcripts()))
    data = [e["choices"][0]["delta"].get("audio", {}).get("data") for e in events[:-1]]
    streamed = decode(b"".join(base64.b64decode(d) for d in data if d), "pcm16")
    np.testing.assert_array_equal(streamed, want)
    stream = StandIn(chunks[1:])
    stream.sample_rate = 22050
    whole = asyncio.run(ChatReply(TALKER, stream, chunks[0], True, "pcm16", Transcripts()).complete())
    np.testing.assert_array_equal(decode(base64.b64decode(whole["choices"][0]["message"]["audio"]["data"]), "pcm16"),
                                  want)
    # the resampler alone: chunks of any size give the whole stream's samples
    resampler, parts, at = StreamResampler(22050, 24000), [], 0
    for n in rng.integers(1, 3000, size=20):
        parts.append(resampler.push(audio[at:at + n]))
        at += n
    parts += [resampler.push(audio[at:]), resampler.flush()]
    np.testing.assert_allclose(np.concatenate(parts), resample(audio, 22050, 24000), atol=1e-6, rtol=0)
