"""The project's Triton stream client (tritonclient gRPC streaming): request tensors by name, one request on its
own stream (`stream_request`), an utterance sent in text pieces as one Triton sequence (`stream_text_pieces`), and
what a stream delivered (`StreamOutcome`: audio, TTFA, stalls, finish). The speech API (voxbackend.api), the
command-line client (`python -m clients.tts_stream`), the load generator, the benchmarks and the tests all stream
through it."""
from __future__ import annotations

import queue
import random
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from voxbackend.triton.schema import SAMPLING_TYPES



def context_fields(texts: list[str], audio: list[bytes | np.ndarray | str | Path], speakers: list[int] | None = None,
                   default_speaker: int = 0) -> dict[str, list]:
    """CSM context segments -> CONTEXT_TEXT / CONTEXT_SPEAKER / CONTEXT_AUDIO lists. Audio files (paths or bytes)
    are sent as they are: the server decodes and resamples them; float32 arrays go as raw samples (send
    CONTEXT_SAMPLE_RATE too). Speakers default to `default_speaker` for every segment."""
    if len(texts) != len(audio):
        raise ValueError(f"{len(texts)} context text(s) but {len(audio)} context audio file(s): give one of each "
                         "per segment")
    speakers = list(speakers) if speakers else [default_speaker] * len(texts)
    if len(speakers) != len(texts):
        raise ValueError(f"{len(speakers)} context speaker(s) for {len(texts)} segment(s)")
    files = [a if isinstance(a, (bytes, np.ndarray)) else Path(a).read_bytes() for a in audio]
    return {"CONTEXT_TEXT": list(texts), "CONTEXT_SPEAKER": speakers, "CONTEXT_AUDIO": files} if texts else {}


def make_inputs(text: str | bytes | None, voice: str | None = None, audio_format: str | None = None, *,
                speaker: int | None = None, context: dict[str, list] | None = None,
                context_sample_rate: int | None = None, reference_audio: bytes | str | Path | None = None,
                reference_text: str | None = None, exaggeration: float | None = None, batched: bool = False,
                input_audio: bytes | str | Path | None = None, system_prompt: str | None = None,
                history: list[dict] | None = None, speak: bool | None = None, **sampling) -> list:
    """Request tensors by name; sampling keys are the tensor names (TEMPERATURE=0.6, SEED=7, ...).

    CSM: `speaker`, and `context` as made by context_fields; CONTEXT_AUDIO items are file bytes, or float32
    arrays sent as raw samples at `context_sample_rate`. Voice cloning (CosyVoice2, Qwen3-TTS Base):
    `reference_audio` (file bytes or a path) and its transcript `reference_text` (Chatterbox: the clip alone, and
    `exaggeration`). A spoken-dialogue model (Step-Audio 2): the user's turn as `text`, `input_audio` (file bytes or
    a path) or both, a `system_prompt`, earlier turns as `history` ([{"role": "user" | "assistant", "text": ...,
    "audio": file bytes or a path}], oldest first), `speak=False` for a text reply. batched: with a leading batch
    dimension of 1, for a model with max_batch_size > 0 (`<model>_text_stream`).
    """
    import tritonclient.grpc as grpcclient

    def tensor(name: str, value: np.ndarray, dtype: str):
        value = value[None] if batched else value
        t = grpcclient.InferInput(name, list(value.shape), dtype)
        t.set_data_from_numpy(value)
        return t

    def text_tensor(name: str, value: str | bytes):
        return tensor(name, np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_), "BYTES")

    inputs = [text_tensor("TEXT", text)] if text is not None else []
    if voice:
        inputs.append(text_tensor("VOICE", voice))
    if speaker is not None:
        inputs.append(tensor("SPEAKER", np.array([speaker], dtype=np.int32), "INT32"))
    for name, items in (context or {}).items():
        if name == "CONTEXT_SPEAKER":
            inputs.append(tensor(name, np.array(items, dtype=np.int32).reshape(-1), "INT32"))
        else:
            raw = [np.asarray(x, "<f4").tobytes() if isinstance(x, np.ndarray) else
                   x.encode() if isinstance(x, str) else x for x in items]
            inputs.append(tensor(name, np.array(raw, dtype=np.object_).reshape(-1), "BYTES"))
    if context_sample_rate is not None:
        inputs.append(tensor("CONTEXT_SAMPLE_RATE", np.array([context_sample_rate], dtype=np.int32), "INT32"))
    if reference_audio is not None:
        inputs.append(text_tensor("REFERENCE_AUDIO", _file_bytes(reference_audio)))
    if reference_text is not None:
        inputs.append(text_tensor("REFERENCE_TEXT", reference_text))
    if exaggeration is not None:
        inputs.append(tensor("EXAGGERATION", np.array([exaggeration], dtype=np.float32), "FP32"))
    if input_audio is not None:
        inputs.append(text_tensor("INPUT_AUDIO", _file_bytes(input_audio)))
    if system_prompt is not None:
        inputs.append(text_tensor("SYSTEM_PROMPT", system_prompt))
    if history:
        for name, key in (("HISTORY_ROLE", "role"), ("HISTORY_TEXT", "text"), ("HISTORY_AUDIO", "audio")):
            items = [_file_bytes(turn[key]) if key == "audio" and turn.get(key) is not None else
                     (turn.get(key) or "").encode() for turn in history]
            inputs.append(tensor(name, np.array(items, dtype=np.object_), "BYTES"))
    if speak is not None:
        inputs.append(tensor("SPEAK", np.array([speak], dtype=bool), "BOOL"))
    if audio_format:
        inputs.append(text_tensor("AUDIO_FORMAT", audio_format))
    for name, value in sampling.items():
        if value is None:
            continue
        if name not in SAMPLING_TYPES:
            raise ValueError(f"unknown sampling field {name}; known: {', '.join(SAMPLING_TYPES)}")
        triton_type, dtype = SAMPLING_TYPES[name]
        inputs.append(tensor(name, np.array([value], dtype=dtype), triton_type))
    return inputs


def _file_bytes(clip: bytes | str | Path) -> bytes:
    return clip if isinstance(clip, bytes) else Path(clip).read_bytes()


def response_audio(result, audio_format: str) -> np.ndarray:
    """One response's AUDIO as float32: encoded bytes from a front model, float samples from an engine."""
    audio = result.as_numpy("AUDIO")
    if audio is None:
        return np.zeros(0, np.float32)
    if audio.dtype == np.object_:  # front model: one element of raw little-endian bytes
        data = bytes(audio.reshape(-1)[0]) if audio.size else b""
        if audio_format == "fp32":
            return np.frombuffer(data, dtype="<f4").astype(np.float32)
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767.0
    return audio.astype(np.float32).reshape(-1)


def response_scalar(result, name: str, default=None):
    """One metadata output of a response (SAMPLE_RATE, CHUNK_INDEX, FINAL, FINISH_REASON) as a Python value."""
    value = result.as_numpy(name)
    if value is None or value.size == 0:
        return default
    item = value.reshape(-1)[0]
    return item.decode() if isinstance(item, bytes) else item.item()


@dataclass
class StreamOutcome:
    """What the client saw of one request; times are time.monotonic() seconds."""

    send_time: float
    chunks: list[np.ndarray] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)
    sample_rate: int = 0
    finish_reason: str | None = None
    error: str | None = None
    end_time: float | None = None
    responses: int = 0  # every callback for this request, audio or final or error
    late_responses: int = 0  # callbacks after the final response or error (should stay 0)
    arrived_in_order: bool = True  # chunks came in CHUNK_INDEX order
    seed: int | None = None  # SEED_USED: the seed the server sampled with (send it as SEED to reproduce the audio)
    piece_errors: list[str] = field(default_factory=list)  # text streaming: later pieces the server refused
    # a model that answers in text too (TEXT_OUT): (arrival, audio chunks before it, the piece), in arrival order
    text_pieces: list[tuple[float, int, str]] = field(default_factory=list)
    on_text: Callable[[str], None] | None = None  # called with each text piece as it arrives

    def take(self, result, t: float, audio_format: str) -> bool:
        """Record one response that arrived at t: its audio, seed and, on the stream's last response (FINAL),
        why it ended. Returns whether it was Triton's final response (nothing comes after it)."""
        audio = response_audio(result, audio_format)
        self.sample_rate = int(response_scalar(result, "SAMPLE_RATE", self.sample_rate) or 0)
        self.seed = response_scalar(result, "SEED_USED", self.seed)
        if audio.size:
            self.chunks.append(audio)
            self.arrivals.append(t)
            self.indices.append(int(response_scalar(result, "CHUNK_INDEX", len(self.indices))))
        text = response_scalar(result, "TEXT_OUT", "")
        if text:
            self.text_pieces.append((t, int(response_scalar(result, "CHUNK_INDEX", len(self.chunks))), text))
            if self.on_text is not None:
                self.on_text(text)
        if response_scalar(result, "FINAL", False):  # the stream's last response: FINISH_REASON says why
            self.finish_reason, self.end_time = response_scalar(result, "FINISH_REASON", "") or None, t
        if is_triton_final(result):
            self.end_time = self.end_time or t
            return True
        return False

    def put_in_order(self) -> None:
        """Sort chunks by CHUNK_INDEX (a server should keep order; this makes the client robust if not).

        A chunk can only play once every earlier one is here, so its arrival is the latest arrival so far.
        """
        order = sorted(range(len(self.chunks)), key=lambda i: self.indices[i])
        self.arrived_in_order = order == list(range(len(order)))
        self.chunks = [self.chunks[i] for i in order]
        self.indices = [self.indices[i] for i in order]
        self.arrivals = list(np.maximum.accumulate([self.arrivals[i] for i in order])) if order else []

    @property
    def audio(self) -> np.ndarray:
        return np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.float32)

    @property
    def text(self) -> str:
        """The reply's text (TEXT_OUT pieces joined)."""
        return "".join(piece for _, _, piece in self.text_pieces)

    @property
    def audio_s(self) -> float:
        return sum(c.size for c in self.chunks) / self.sample_rate if self.sample_rate else 0.0

    @property
    def ttfa_s(self) -> float | None:
        return self.arrivals[0] - self.send_time if self.arrivals else None

    def on_time(self) -> list[bool]:
        """docs/metrics.md: chunk i >= 1 is on time if chunks 0..i-1 hold more audio than the time since chunk 0."""
        flags, buffered = [], 0.0
        for i in range(1, len(self.chunks)):
            buffered += self.chunks[i - 1].size / self.sample_rate
            flags.append(buffered > self.arrivals[i] - self.arrivals[0])
        return flags

    @property
    def stalls(self) -> int:
        return sum(not ok for ok in self.on_time())

    @property
    def wall_s(self) -> float:
        return (self.end_time or time.monotonic()) - self.send_time


def is_triton_final(result) -> bool:
    """Triton's own end-of-stream flag (enable_empty_final_response): nothing follows this response."""
    params = result.get_response().parameters
    return params["triton_final_response"].bool_param if "triton_final_response" in params else False


class StreamCall:
    """One request on its own gRPC stream: opened and sent at construction, every response (or error) handed to
    `callback(result, error)` on tritonclient's stream thread; close() hangs up."""

    def __init__(self, url: str, model: str, inputs: list, callback, request_id: str = "tts"):
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=callback)
        try:
            self.client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=True)
        except BaseException:
            self.close(cancel=False)
            raise

    def close(self, cancel: bool) -> None:
        """cancel: the request may still be running, stop it. Cancel only such a request: cancelling one Triton
        already rejected (wrong dtype or shape) leaves it counted as live in 2.51, and the server then waits out
        its exit timeout on shutdown."""
        try:
            self.client.stop_stream(cancel_requests=cancel)
        finally:
            self.client.close()


def stream_request(url: str, model: str, inputs: list, audio_format: str = "pcm16", timeout: float = 300.0,
                   cancel_after_chunks: int | None = None, request_id: str = "tts",
                   linger_s: float = 0.0, on_text: Callable[[str], None] | None = None) -> StreamOutcome:
    """Send one request on its own gRPC stream and collect every response until the final one.

    cancel_after_chunks: stop the stream with cancel_requests=True after that many audio chunks (a client that
    hangs up); the outcome then has finish_reason "client-cancelled".
    linger_s: keep listening that long after the final response or error and count late_responses (tests).
    on_text: called with each piece of the reply's text as it arrives (a model that answers in text too).
    """
    responses: queue.SimpleQueue = queue.SimpleQueue()
    out = StreamOutcome(send_time=time.monotonic(), on_text=on_text)
    call = StreamCall(url, model, inputs, lambda result, error: responses.put((time.monotonic(), result, error)),
                      request_id)
    cancelled = False
    try:
        deadline = out.send_time + timeout
        while True:
            try:
                t, result, error = responses.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                out.error = f"timed out after {timeout} s"
                cancelled = True  # still running on the server: hang up
                break
            out.responses += 1
            if error is not None:
                out.error, out.end_time = str(error), t
                break
            if out.take(result, t, audio_format):
                break  # Triton sends nothing after this one
            if cancel_after_chunks is not None and len(out.chunks) >= cancel_after_chunks:
                cancelled = True
                out.finish_reason, out.end_time = "client-cancelled", time.monotonic()
                break
        if linger_s > 0 and not cancelled:
            time.sleep(linger_s)
            while not responses.empty():
                responses.get()
                out.late_responses += 1
    finally:
        call.close(cancel=cancelled)
    out.put_in_order()
    return out


_PIECE_ERROR = re.compile(r"^\[request id: ([^\]]*)\] ")


def stream_text_pieces(url: str, model: str, pieces: Iterable[str], inputs: Iterable = (), audio_format: str = "pcm16",
                       piece_delay: float = 0.0, timeout: float = 300.0, request_id: str = "tts",
                       sequence_id: int | None = None) -> StreamOutcome:
    """One utterance whose text arrives in pieces: every piece is a request of one Triton sequence on one gRPC
    stream (the first with START and `inputs`: voice, sampling, format, all batched), then an empty END piece
    once `pieces` is exhausted (a generator may block, e.g. on stdin). The audio comes on the first piece's
    request; send_time, and so ttfa_s, is when the first piece was sent."""
    import tritonclient.grpc as grpcclient

    responses: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((time.monotonic(), result, error)))
    sequence = sequence_id or random.randrange(1, 2**63)
    out = StreamOutcome(send_time=time.monotonic())
    sent_first = threading.Event()
    failures: list[BaseException] = []

    def send(text: str, n: int, end: bool) -> None:
        first = n == 0
        tensors = [*make_inputs(text, batched=True), *(inputs if first else ())]
        if first:
            out.send_time = time.monotonic()
        client.async_stream_infer(model, tensors, request_id=request_id if first else f"{request_id}-{n}",
                                  sequence_id=sequence, sequence_start=first, sequence_end=end,
                                  enable_empty_final_response=True)
        sent_first.set()

    def send_all() -> None:
        n = 0
        try:
            for n, piece in enumerate(pieces):
                if n and piece_delay > 0:
                    time.sleep(piece_delay)
                send(piece, n, end=False)
                n += 1
            send("", n, end=True)
        except BaseException as e:  # the collector reports it
            failures.append(e)
            sent_first.set()

    sender = threading.Thread(target=send_all, name="pieces", daemon=True)
    sender.start()
    cancelled = False
    try:
        sent_first.wait()  # stdin may take a while to give its first line: the clock starts at the first piece
        deadline = time.monotonic() + timeout
        while True:
            if failures:
                out.error, cancelled = f"sending a piece failed: {failures[0]}", True
                break
            try:
                t, result, error = responses.get(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() < deadline:
                    continue
                out.error, cancelled = f"timed out after {timeout} s", True
                break
            if error is not None:
                message = str(error)
                match = _PIECE_ERROR.match(message)
                if match and match.group(1) != request_id:  # a later piece was refused; the utterance goes on
                    out.piece_errors.append(message)
                    continue
                out.error, out.end_time = message, t
                out.responses += 1
                break
            if result.get_response().id != request_id:
                continue  # a later piece's empty final response
            out.responses += 1
            if out.take(result, t, audio_format):
                break
    finally:
        try:
            client.stop_stream(cancel_requests=cancelled)
        finally:
            client.close()
    out.put_in_order()
    return out
