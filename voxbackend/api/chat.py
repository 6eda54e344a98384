"""POST /v1/chat/completions for conversation models: one Triton stream per request; its text pieces and audio
chunks, in the order Triton sent them, become a `chat.completion` (whole) or `chat.completion.chunk` events
(Server-Sent Events), in the shapes OpenAI gives audio replies.

    spoken reply, whole:     message.audio = {id, data: base64 file in audio.format, expires_at, transcript};
                             message.content null (OpenAI's audio replies carry their text as the transcript)
    spoken reply, streamed:  delta.audio {id, transcript: piece} | {id, data: base64 PCM16} as they come, then
                             delta.audio {id, expires_at}, then an empty delta with finish_reason, then [DONE]
    text reply:              message.content / delta.content

Audio is 24 kHz, as OpenAI's is (its pcm16 carries no rate): a model that speaks at another rate (GLM-4-Voice,
22.05 kHz) is resampled, chunk by chunk as it streams (audio_io.StreamResampler: the same samples as the whole).

`usage` is left out: this process holds no tokenizer to count the prompt. The request is sent before the response
starts and the first event awaited, so every error Triton reports before the reply (all input errors, overload) gets
its HTTP status; a later one ends the event stream with an `{"error": ...}` event (the openai client raises it).
"""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import uuid
from dataclasses import dataclass, field

from voxbackend.api.audio_out import encode_whole
from voxbackend.api.catalog import Catalog, SpeechModel
from voxbackend.api.chat_request import AUDIO_FORMATS, ChatRequest
from voxbackend.api.chat_turns import conversation
from voxbackend.api.errors import ApiError
from voxbackend.api.replies import Transcripts
from voxbackend.api.triton_stream import AudioChunk, SpeechStream, TextPiece
from voxbackend.audio_io import StreamResampler, resample
from voxbackend.triton.audio_encoding import decode, encode
from voxbackend.stream_client import make_inputs

log = logging.getLogger("voxbackend.api")
RATE = 24000  # OpenAI's audio rate: every reply's audio is sent at it


@dataclass
class ChatReply:
    """One request's reply, its Triton stream open and its first event (or None: an empty reply) in hand."""

    model: SpeechModel
    stream: SpeechStream
    first: AudioChunk | TextPiece | None
    speaks: bool
    audio_format: str
    transcripts: Transcripts
    resampler: StreamResampler | None = None  # the model's rate -> RATE, from the first audio chunk
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    audio_id: str = field(default_factory=lambda: f"audio_{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    async def open(cls, body: ChatRequest, catalog: Catalog, triton_url: str, transcripts: Transcripts) -> "ChatReply":
        body.check_unsupported()
        model = body.resolve(await catalog.models())
        speaks = body.speaks(model)
        audio_format = body.audio_format() if speaks else "wav"
        voice = body.voice(model) if speaks else None
        turn = conversation(body.messages, model, transcripts)
        inputs = make_inputs(turn.text, voice, "pcm16", input_audio=turn.audio, system_prompt=turn.system,
                             history=turn.history or None, speak=None if speaks else False, **body.sampling())
        stream = SpeechStream(triton_url, model.name, inputs, {**body.params(), **turn.params})
        try:
            first = await stream.next_event()
        except BaseException:
            await stream.close()
            raise
        return cls(model, stream, first, speaks, audio_format, transcripts)

    async def complete(self) -> dict:
        """The whole reply as a chat.completion."""
        pcm, text = [], []
        event = self.first
        while event is not None:
            if isinstance(event, AudioChunk):
                pcm.append(event.pcm16)
            else:
                text.append(event.text)
            event = await self.stream.next_event()
        transcript = "".join(text)
        message: dict = {"role": "assistant", "content": transcript, "refusal": None}
        if self.speaks:
            audio = decode(b"".join(pcm), "pcm16")
            data = encode_whole(encode(resample(audio, self.stream.sample_rate or RATE, RATE), "pcm16"), RATE,
                                AUDIO_FORMATS[self.audio_format])
            message.update(content=None, audio={
                "id": self.audio_id, "data": base64.b64encode(data).decode(),
                "expires_at": self.transcripts.add(self.audio_id, transcript), "transcript": transcript})
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model.name,
                "choices": [{"index": 0, "message": message, "finish_reason": self.stream.finish_reason,
                             "logprobs": None}], "seed": self.stream.seed}

    def _chunk(self, delta: dict, finish_reason: str | None = None, **extra) -> bytes:
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model.name,
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
                 **extra}
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    def _audio_delta(self, pcm16: bytes) -> dict:
        return {"audio": {"id": self.audio_id, "data": base64.b64encode(pcm16).decode()}}

    def _delta(self, event: AudioChunk | TextPiece) -> dict:
        if isinstance(event, AudioChunk):
            if self.resampler is None:
                self.resampler = StreamResampler(event.sample_rate, RATE)
            return self._audio_delta(encode(self.resampler.push(decode(event.pcm16, "pcm16")), "pcm16"))
        if self.speaks:
            return {"audio": {"id": self.audio_id, "transcript": event.text}}
        return {"content": event.text}

    async def events(self):
        """The reply as Server-Sent Events. A client that disconnects cancels this generator; the response then
        closes the Triton stream (app.SpeechResponse)."""
        text = []
        try:
            event = self.first
            first = {"role": "assistant", **({} if self.speaks else {"content": ""})}
            if event is not None:
                first.update(self._delta(event))
            yield self._chunk(first)
            while event is not None:
                if isinstance(event, TextPiece):
                    text.append(event.text)
                event = await self.stream.next_event()
                if event is not None:
                    yield self._chunk(self._delta(event))
            rest = self.resampler.flush() if self.resampler is not None else ()
            if len(rest):
                yield self._chunk(self._audio_delta(encode(rest, "pcm16")))
            if self.speaks:
                expires_at = self.transcripts.add(self.audio_id, "".join(text))
                yield self._chunk({"audio": {"id": self.audio_id, "expires_at": expires_at}})
            # "stop" or "length"; "cancelled" / "shutdown" when the server stopped it
            yield self._chunk({}, self.stream.finish_reason, seed=self.stream.seed)
            yield b"data: [DONE]\n\n"
        except ApiError as e:  # after the first event the status is sent: say it in the stream, then end it
            log.warning("chat stream failed after its first event: %s", e)
            yield b"data: " + json.dumps(e.body()).encode() + b"\n\n"
        finally:
            await self.stream.close()


async def unless_disconnected(receive, work) -> dict | None:
    """`work`'s result, or None once the client has gone (then `work` is cancelled). For a reply sent whole: the
    request's body is read, so the next ASGI message is the disconnect."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None
    finally:
        watch.cancel()


async def _disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
