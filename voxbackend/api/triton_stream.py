"""One Triton streaming request as an async iterator of PCM16 chunks (and, from a model that answers in text too,
text pieces in their place among them), for the asyncio side of the service.

The gRPC stream is the project's client (voxbackend.stream_client.StreamCall): tritonclient calls back on its own
thread; each response is handed to the event loop through a queue. close() hangs up, cancelling the request
in Triton when it is still running, so a client that goes away leaves no generation behind.
"""
from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass

import anyio
import numpy as np

from voxbackend.stream_client import StreamCall, is_triton_final, make_inputs, response_scalar
from voxbackend.api.errors import from_triton

_ids = itertools.count()


@dataclass
class AudioChunk:
    pcm16: bytes  # little-endian int16 mono samples
    sample_rate: int
    index: int


@dataclass
class TextPiece:
    text: str  # the reply's text since the previous piece (TEXT_OUT: whole characters)
    audio_chunks: int  # audio chunks sent before it


class SpeechStream:
    """Send one request; `await next()` gives its audio chunks in order, then None (`next_event()` the text pieces
    too, as Triton sent them); a Triton error raises ApiError, its param found through `params` (errors.py)."""

    def __init__(self, url: str, model: str, inputs: list, params: dict[str, str] | None = None):
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._params = params
        self.done = False  # Triton's final response (or an error) arrived: nothing is running any more
        self.finish_reason: str | None = None
        self.chunks = 0
        self.sample_rate = 0
        self.seed: int | None = None  # SEED_USED: sent back as the seed it reproduces the reply
        self._call: StreamCall | None = None
        try:
            self._call = StreamCall(url, model, inputs, self._on_response, request_id=f"api-{next(_ids)}")
        except Exception as e:  # tritonclient refused before sending (bad address...)
            self.done = True
            raise from_triton(str(e), params) from None

    def _on_response(self, result, error) -> None:  # tritonclient's stream thread
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (result, error))
        except RuntimeError:  # the loop is gone (service shutting down)
            pass

    async def next(self) -> AudioChunk | None:
        """The next audio chunk; text pieces are passed over (a speech client wants the audio alone)."""
        while (event := await self.next_event()) is not None:
            if isinstance(event, AudioChunk):
                return event
        return None

    async def next_event(self) -> AudioChunk | TextPiece | None:
        while not self.done:
            result, error = await self._queue.get()
            if error is not None:
                self.done = True
                raise from_triton(str(error), self._params)
            audio = result.as_numpy("AUDIO")
            data = bytes(audio.reshape(-1)[0]) if audio is not None and audio.size else b""
            text = response_scalar(result, "TEXT_OUT", "")
            self.sample_rate = int(response_scalar(result, "SAMPLE_RATE", self.sample_rate) or 0)
            self.seed = response_scalar(result, "SEED_USED", self.seed)
            if response_scalar(result, "FINAL", False):
                self.finish_reason = response_scalar(result, "FINISH_REASON", "") or None
            if is_triton_final(result):
                self.done = True
            if data:
                self.chunks += 1
                return AudioChunk(data, self.sample_rate, int(response_scalar(result, "CHUNK_INDEX", self.chunks - 1)))
            if text:
                return TextPiece(text, self.chunks)
        return None

    async def close(self) -> None:
        """Hang up; cancels the request in Triton unless it already ended. Safe to call twice, and from a task
        that is being cancelled (a client that disconnected): the hang-up itself is shielded."""
        call, self._call = self._call, None
        if call is not None:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(call.close, not self.done)


def speech_inputs(text: str, voice_input: str | None, voice: str | int | None, sampling: dict,
                  model_inputs: dict[str, float] | None = None) -> list:
    """Request tensors for the front model: TEXT, the model's voice input (VOICE name or SPEAKER id), PCM16 audio,
    the sampling fields given (tensor name -> value) and the model's own FP32 inputs given (EXAGGERATION)."""
    import tritonclient.grpc as grpcclient

    inputs = make_inputs(text, voice if voice_input == "VOICE" else None, "pcm16",
                         speaker=voice if voice_input == "SPEAKER" else None, **sampling)
    for name, value in (model_inputs or {}).items():
        tensor = grpcclient.InferInput(name, [1], "FP32")
        tensor.set_data_from_numpy(np.array([value], dtype=np.float32))
        inputs.append(tensor)
    return inputs

