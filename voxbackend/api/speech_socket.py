"""WebSocket text-in, audio-out: an LLM's text streams in as it is generated, audio comes back in order.

Client -> server (JSON text frames):
    {"type": "start", "model": "orpheus", "voice": "tara", "seed": 7, ...}   optional, before any text
    {"type": "text", "text": "Hello the"}                                   any number of pieces
    {"type": "end"}                                                         no more text
Server -> client:
    {"type": "sentence", "index": i, "text": "...", "sample_rate": 24000}   before sentence i's first audio
    binary frames: sentence i's audio, little-endian PCM16 mono, one frame per engine chunk
    {"type": "sentence_end", "index": i, "chunks": n, "audio_s": s, "finish_reason": "stop"}
    {"type": "done", "stats": {...}}                                        then the socket closes (1000)
    {"type": "error", "error": {OpenAI error object}, "index": i | null}    then the socket closes (1008 / 1011)

The served models take no streamed text input yet, so the text is cut at sentence boundaries and each
sentence is one Triton request on this socket; the next sentence's request starts while the current one
plays (LOOKAHEAD), its audio held back until the current sentence ends, so audio leaves in order.
A client that disconnects cancels every request still running.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from dataclasses import dataclass, field

from pydantic import ValidationError
from starlette.websockets import WebSocket, WebSocketDisconnect

from voxbackend.api.catalog import Catalog
from voxbackend.api.errors import ApiError, bad_request
from voxbackend.api.requests import SynthesisOptions, validation_error
from voxbackend.api.sentences import SentenceBuffer
from voxbackend.api.triton_stream import SpeechStream, speech_inputs

LOOKAHEAD = 2  # requests open at once: the one playing and the next


@dataclass
class Sentence:
    index: int
    text: str
    stream: SpeechStream
    sent_at: float
    chunks: int = 0
    samples: int = 0


@dataclass
class SocketStats:
    started: float = field(default_factory=time.monotonic)
    first_text: float | None = None
    first_audio: float | None = None
    first_request: float | None = None
    sentences: int = 0
    chunks: int = 0
    audio_s: float = 0.0
    sentence_ttfa_s: list[float] = field(default_factory=list)

    def report(self) -> dict:
        now = time.monotonic()
        since = lambda t: None if t is None or self.first_audio is None else round(self.first_audio - t, 4)  # noqa: E731
        return {"sentences": self.sentences, "chunks": self.chunks, "audio_s": round(self.audio_s, 4),
                "wall_s": round(now - self.started, 4), "ttfa_s": since(self.first_request),
                "first_text_to_audio_s": since(self.first_text),
                "sentence_ttfa_s": [round(t, 4) for t in self.sentence_ttfa_s]}


class SpeechSocket:
    def __init__(self, ws: WebSocket, catalog: Catalog, triton_url: str):
        self.ws = ws
        self.catalog = catalog
        self.triton_url = triton_url
        self.options = SynthesisOptions()
        self.started = False  # the first text arrived: options are fixed from here on
        self.sentences: asyncio.Queue[str | None] = asyncio.Queue()
        self.buffer = SentenceBuffer()
        self.stats = SocketStats()
        self.open: set[SpeechStream] = set()
        self.playing: int | None = None  # index of the sentence whose audio is being sent

    async def run(self) -> None:
        await self.ws.accept()
        receiver = asyncio.create_task(self._receive())
        player = asyncio.create_task(self._play())
        try:
            done, _ = await asyncio.wait({receiver, player}, return_when=asyncio.FIRST_COMPLETED)
            if player in done:
                player.result()  # raises the player's error
                await self.ws.send_json({"type": "done", "stats": self.stats.report()})
                await self.ws.close(1000)
            else:
                receiver.result()  # a disconnect or a bad message; a clean receive never ends by itself
        except ApiError as e:
            await self._send_error(e, self.playing if player.done() else None)
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass  # the client went away: cancel what runs (below)
        finally:
            for task in (receiver, player):
                task.cancel()
            await asyncio.gather(receiver, player, return_exceptions=True)
            for stream in list(self.open):
                await stream.close()

    async def _send_error(self, e: ApiError, index: int | None = None) -> None:
        try:
            await self.ws.send_json({"type": "error", "error": e.body()["error"], "index": index})
            await self.ws.close(1008 if e.status < 500 else 1011)
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass

    async def _receive(self) -> None:
        ended = False
        while True:
            try:
                message = json.loads(await self.ws.receive_text())
            except (json.JSONDecodeError, KeyError):  # KeyError: a binary frame
                raise bad_request("messages must be JSON text frames", "type") from None
            kind = message.get("type") if isinstance(message, dict) else None
            if ended:
                raise bad_request(f"{kind!r} message after end", "type")
            if kind == "start":
                if self.started:
                    raise bad_request("start must come before any text", "type")
                try:
                    self.options = SynthesisOptions(**{k: v for k, v in message.items() if k != "type"})
                except ValidationError as e:
                    raise validation_error(e) from None
                self.options.resolve(await self.catalog.models())  # a bad model or voice fails now, not later
            elif kind == "text":
                text = message.get("text")
                if not isinstance(text, str):
                    raise bad_request("text must be a string", "text")
                if not self.started:
                    self.started, self.stats.first_text = True, time.monotonic()
                for sentence in self.buffer.add(text):
                    self.sentences.put_nowait(sentence)
            elif kind == "end":
                ended = True
                for sentence in self.buffer.flush():
                    self.sentences.put_nowait(sentence)
                self.sentences.put_nowait(None)
            else:
                raise bad_request(f"unknown message type {kind!r}; send start, text or end", "type")

    async def _open(self, text: str) -> Sentence:
        model, voice = self.options.resolve(await self.catalog.models())
        stream = SpeechStream(self.triton_url, model.name, speech_inputs(
            text, model.voice_input, voice, self.options.sampling(), self.options.model_inputs(model)))
        self.open.add(stream)
        now = time.monotonic()
        self.stats.first_request = self.stats.first_request or now
        index, self.stats.sentences = self.stats.sentences, self.stats.sentences + 1
        return Sentence(index, text, stream, now)

    async def _play(self) -> None:
        opened: deque[Sentence] = deque()
        ended = False
        while True:
            while not ended and len(opened) < LOOKAHEAD and (not opened or not self.sentences.empty()):
                text = await self.sentences.get()
                if text is None:
                    ended = True
                else:
                    opened.append(await self._open(text))
            if not opened:
                return
            current = opened[0]
            self.playing = current.index
            chunk = await current.stream.next()  # an ApiError ends the socket (run)
            if chunk is None:
                await self.ws.send_json({"type": "sentence_end", "index": current.index, "chunks": current.chunks,
                                         "audio_s": round(current.samples / (current.stream.sample_rate or 1), 4),
                                         "finish_reason": current.stream.finish_reason})
                await current.stream.close()
                self.open.discard(current.stream)
                opened.popleft()
                continue
            now = time.monotonic()
            if current.chunks == 0:
                self.stats.sentence_ttfa_s.append(now - current.sent_at)
                await self.ws.send_json({"type": "sentence", "index": current.index, "text": current.text,
                                         "sample_rate": chunk.sample_rate})
            self.stats.first_audio = self.stats.first_audio or now
            await self.ws.send_bytes(chunk.pcm16)
            current.chunks += 1
            current.samples += len(chunk.pcm16) // 2
            self.stats.chunks += 1
            self.stats.audio_s += len(chunk.pcm16) / 2 / chunk.sample_rate
