"""A weights-free stand-in with the Engine API, for exercising the Triton glue (tests, fault injection).

Select it with the engine parameters `engine_loader: voxbackend.triton.fake_engine:load` and
`frontend_loader: voxbackend.triton.fake_engine:load_frontend`. Audio is a deterministic function of the
prompt and seed; one chunk per `step_s` per running request; KV pages are reserved at admission and freed on
finish or cancel like the real engine. A text containing "__die__" kills the loop (an engine failure).

Text streaming (`load_streaming` / `load_streaming_frontend`): a model with `text_streaming`, a real BPE
`text_tokenizer` and per-position audio (chunk i is a function of the seed, i and prompt id i), so a text sent
whole and the same text sent in pieces give the same audio exactly when the ids agree. An open request
(`submit(..., text_open=True)`) that has played all its ids waits, holding its pages, for `append_text`.
"""
from __future__ import annotations

import math
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from voxbackend.errors import EngineDead, EngineOverloaded, InvalidRequest
from voxbackend.events import Event, EventKind
from voxbackend.models.text_tokens import TextTokenizer
from voxbackend.sampling_params import SamplingParams

DIE = "__die__"
TOKENS_PER_CHUNK = 7
CHUNK_SAMPLES = 2048


@dataclass(frozen=True)
class FakeSpec:
    name: str = "fake"
    sample_rate: int = 24000
    token_columns: int = 1  # one id per prompt position, as Orpheus


class FakeModel:
    spec = FakeSpec()
    text_streaming = False
    voices = ("tara", "leo")
    max_chars = 400

    def prepare(self, text: str, voice: str | None = None) -> list[int]:
        if not text.strip():
            raise InvalidRequest("text is empty", field="text")
        if len(text) > self.max_chars:
            raise InvalidRequest(f"text is {len(text)} characters; the limit is {self.max_chars}", field="text")
        voice = voice or self.voices[0]
        if voice not in self.voices:
            raise InvalidRequest(f"unknown voice {voice!r}; choose one of {', '.join(self.voices)}", field="voice")
        return [1000 + self.voices.index(voice), *text.encode("utf-8")]

    def default_sampling(self) -> SamplingParams:
        return SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3, max_tokens=1200)


class FakeStreamingModel(FakeModel):
    """The fake with the text-streaming API: ids from a Qwen2-style byte-level BPE (NFC, split, byte level)."""

    text_streaming = True

    def __init__(self) -> None:
        self.text_tokenizer = TextTokenizer(streaming_tokenizer())

    def text_piece_ids(self, text: str) -> list[int]:
        return self.text_tokenizer.encode(text)

    def prepare(self, text: str, voice: str | None = None, *, text_open: bool = False) -> list[int]:
        super().prepare(text, voice)  # the same checks
        return [1000 + self.voices.index(voice or self.voices[0]), *self.text_piece_ids(text)]


_CORPUS = (  # fixed, so the fake's ids never change
    "Hello there, how are you doing today? I'm fine, thanks; we'll see you tomorrow.",
    "The quick brown fox jumps over the lazy dog while the cat watches from the window.",
    "A streaming server sends the first audio as soon as it is ready, so the listener can start playing.",
    "Text arrives in pieces from a language model, one word or a few characters at a time.",
)


def streaming_tokenizer():
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    split = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
             r"\s*[\r\n]+|\s+(?!\S)|\s+")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=500, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return tok


def position_chunk(seed: int, position: int, token: int) -> np.ndarray:
    return (0.3 * np.random.default_rng([seed, position, token]).standard_normal(CHUNK_SAMPLES)).astype(np.float32)


def fake_audio(prompt_ids: list[int], sampling: SamplingParams) -> list[np.ndarray]:
    """The chunks a request yields: as many as max_tokens allows, at most one per prompt id."""
    n = min(sampling.max_tokens // TOKENS_PER_CHUNK, len(prompt_ids))
    rng = np.random.default_rng([sampling.seed, *prompt_ids])
    return [(0.3 * rng.standard_normal(CHUNK_SAMPLES)).astype(np.float32) for _ in range(n)]


@dataclass
class _Req:
    request_id: str
    chunks: list[np.ndarray]
    on_event: Callable[[Event], None]
    pages: int
    sent: int = 0
    die: bool = False
    # text streaming models: one chunk per prompt id, made when it is played; the prompt grows by append_text
    prompt: list[int] | None = None
    seed: int = 0
    limit: int = 0  # chunks max_tokens allows
    text_open: bool = False


@dataclass
class FakeStats:
    running: int
    queued: int
    kv_pages_used: int
    kv_pages_total: int


@dataclass
class FakeEngine:
    kv_pages: int = 64
    page_size: int = 16
    max_queue: int = 64
    max_batch: int = 32
    step_s: float = 0.02
    model: FakeModel = field(default_factory=FakeModel)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: list[_Req] = []
        self._running: dict[str, _Req] = {}
        self._cancelled: set[str] = set()
        self._used = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.alive = True

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="fake-engine", daemon=True)
            self._thread.start()

    def submit(self, prompt_ids, sampling: SamplingParams | None = None, on_event=None, request_id: str | None = None,
               streaming: bool = True, text_open: bool = False) -> str:
        if text_open and not self.model.text_streaming:
            raise InvalidRequest(f"{self.model.spec.name} cannot take text in pieces", field="text")
        sampling = sampling or self.model.default_sampling()
        if not self.alive:
            raise EngineDead("the engine loop died")
        if not prompt_ids:
            raise InvalidRequest("prompt is empty", field="prompt_ids")
        sampling = sampling.validated()
        pages = math.ceil((len(prompt_ids) + sampling.max_tokens) / self.page_size)
        if pages > self.kv_pages:
            raise InvalidRequest(f"request needs {pages} KV pages; the pool has {self.kv_pages}",
                                 field="max_tokens")
        with self._lock:
            if len(self._waiting) >= self.max_queue:
                raise EngineOverloaded(f"overloaded: {len(self._waiting)} requests are queued (max_queue)")
            rid = request_id or uuid.uuid4().hex
            text = bytes(i for i in prompt_ids if i < 256).decode("utf-8", "replace")
            if self.model.text_streaming:
                req = _Req(rid, [], on_event, pages, die=DIE in text, prompt=list(prompt_ids), seed=sampling.seed,
                           limit=sampling.max_tokens // TOKENS_PER_CHUNK, text_open=text_open)
            else:
                req = _Req(rid, fake_audio(list(prompt_ids), sampling), on_event, pages, die=DIE in text)
            self._waiting.append(req)
        return rid

    def append_text(self, request_id: str, ids: list[int], final: bool) -> None:
        with self._lock:
            r = self._running.get(request_id) or next((w for w in self._waiting if w.request_id == request_id), None)
            if r is None or r.prompt is None:
                raise InvalidRequest(f"request {request_id} is not running (unknown or finished)", field="text")
            if not r.text_open:
                raise InvalidRequest(f"request {request_id} already has all its text", field="text")
            r.prompt.extend(int(i) for i in ids)
            r.text_open = not final

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancelled.add(request_id)

    def stats(self) -> FakeStats:
        with self._lock:
            return FakeStats(len(self._running), len(self._waiting), self._used, self.kv_pages)

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._step()
                time.sleep(self.step_s)
        except Exception as e:
            self.alive = False
            with self._lock:
                dead = list(self._running.values()) + self._waiting
                self._running.clear(), self._waiting.clear()
                self._used = 0
            for r in dead:
                r.on_event(Event(r.request_id, EventKind.ERROR, index=r.sent, error=f"engine failed: {e}"))

    def _step(self) -> None:
        with self._lock:
            for r in list(self._waiting):  # admission: FIFO while pages and slots last
                if r.pages > self.kv_pages - self._used or len(self._running) >= self.max_batch:
                    break
                self._waiting.remove(r)
                self._used += r.pages
                self._running[r.request_id] = r
            cancelled = self._cancelled
            self._cancelled = set()
            for rid in cancelled:  # queued requests are cancelled too
                for r in [w for w in self._waiting if w.request_id == rid]:
                    self._waiting.remove(r)
                    r.on_event(Event(rid, EventKind.FINISHED, index=r.sent, finish_reason="cancelled"))
            batch = list(self._running.values())
        for r in batch:
            if r.die:
                raise RuntimeError("injected failure")
            if r.request_id in cancelled:
                self._retire(r, "cancelled")
            elif r.prompt is not None:
                self._play_position(r)
            elif r.sent < len(r.chunks):
                r.on_event(Event(r.request_id, EventKind.AUDIO, index=r.sent, audio=r.chunks[r.sent]))
                r.sent += 1
            else:
                self._retire(r, "length")

    def _play_position(self, r: _Req) -> None:
        with self._lock:
            token = r.prompt[r.sent] if r.sent < len(r.prompt) else None
            text_open = r.text_open
        if r.sent >= r.limit:
            self._retire(r, "length")
        elif token is not None:
            r.on_event(Event(r.request_id, EventKind.AUDIO, index=r.sent, audio=position_chunk(r.seed, r.sent, token)))
            r.sent += 1
        elif not text_open:
            self._retire(r, "stop")
        # else: out of text with more to come: wait, keeping the pages

    def _retire(self, r: _Req, reason: str) -> None:
        with self._lock:
            self._running.pop(r.request_id, None)
            self._used -= r.pages
        r.on_event(Event(r.request_id, EventKind.FINISHED, index=r.sent, finish_reason=reason))

    def synthesize(self, text: str, voice: str | None = None, sampling: SamplingParams | None = None):
        if self.model.text_streaming:
            sampling = (sampling or self.model.default_sampling()).validated()
            prompt = self.model.prepare(text, voice)[:sampling.max_tokens // TOKENS_PER_CHUNK]
            chunks = [position_chunk(sampling.seed, i, t) for i, t in enumerate(prompt)]
            return (np.concatenate(chunks) if chunks else np.zeros(0, np.float32)), self.model.spec.sample_rate
        chunks = fake_audio(self.model.prepare(text, voice), (sampling or self.model.default_sampling()).validated())
        return (np.concatenate(chunks) if chunks else np.zeros(0, np.float32)), self.model.spec.sample_rate


def load(model_dir: str, codec_dir: str | None = None, **options) -> FakeEngine:
    """engine_loader: ignores the checkpoint; takes kv_pages, page_size, max_queue, max_batch, step_s."""
    known = {"kv_pages": int, "page_size": int, "max_queue": int, "max_batch": int, "step_s": float}
    return FakeEngine(**{k: known[k](v) for k, v in options.items() if k in known})


def load_frontend(model_dir: str, codec_dir: str | None = None) -> FakeModel:
    return FakeModel()


def load_streaming(model_dir: str, codec_dir: str | None = None, **options) -> FakeEngine:
    """engine_loader for text streaming: the fake with FakeStreamingModel."""
    engine = load(model_dir, codec_dir, **options)
    engine.model = FakeStreamingModel()
    return engine


def load_streaming_frontend(model_dir: str, codec_dir: str | None = None) -> FakeStreamingModel:
    return FakeStreamingModel()
