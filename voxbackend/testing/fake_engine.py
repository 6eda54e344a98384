"""A weights-free stand-in with the Engine API, for exercising the Triton glue (tests, fault injection).

Why a double and not the real engine: it kills its loop on demand, holds a stream for as long as a test needs
(one chunk per `step_s`, any length) and makes audio a test can predict without a model. tests/test_fake_engine.py
runs the same requests through it and the real Engine so that the two cannot drift apart (API, error messages,
events, stats, KV accounting).

Select it with the engine parameters `engine_loader: voxbackend.testing.fake_engine:load` and
`frontend_loader: voxbackend.testing.fake_engine:load_frontend`. Audio is a deterministic function of the
prompt and seed; one chunk per `step_s` per running request. KV pages follow the real engine's accounting: a
request is admitted with the pages of its prompt (plus one free page per running request), grows a page as its
positions (prompt + TOKENS_PER_CHUNK per chunk sent) need one, and when the pool is dry the latest admitted is
preempted: its pages go back, it waits at the head of the queue and resumes where it was (the fake has no prefix
to recompute). A request that could never fit is refused at submit. A text containing "__die__" kills the loop.

Text streaming (`load_streaming` / `load_streaming_frontend`): a model with `text_streaming`, a real BPE
`text_tokenizer` and per-position audio (chunk i is a function of the seed, i and prompt id i), so a text sent
whole and the same text sent in pieces give the same audio exactly when the ids agree. An open request
(`submit(..., text_open=True)`) that has played all its ids waits, holding its pages, for `append_text`.
"""
from __future__ import annotations

import math
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from voxbackend.engine.engine import EngineStats
from voxbackend.errors import EngineDead, EngineOverloaded, InvalidRequest
from voxbackend.events import Event, EventKind
from voxbackend.models.base import as_prompt
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
    max_text_chars = 1000  # long enough for prompts that fill a small KV pool (tests/test_triton_faults.py)

    def prepare(self, text: str, voice: str | None = None) -> list[int]:
        if not text.strip():
            raise InvalidRequest("text is empty", field="text")
        if len(text) > self.max_text_chars:
            raise InvalidRequest(f"text is {len(text)} characters; the limit is {self.max_text_chars}", field="text")
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
    prompt_len: int
    arrival: int  # submission order: the queue's order, preempted requests included
    sent: int = 0
    pages: int = 0
    die: bool = False
    # text streaming models: one chunk per prompt id, made when it is played; the prompt grows by append_text
    prompt: list[int] | None = None
    seed: int = 0
    limit: int = 0  # chunks max_tokens allows
    text_open: bool = False

    @property
    def positions(self) -> int:
        return self.prompt_len + TOKENS_PER_CHUNK * self.sent


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
        self._waiting: list[_Req] = []  # in arrival order: preempted requests go back to their place
        self._running: dict[str, _Req] = {}
        self._cancelled: set[str] = set()
        self._used = 0
        self._arrivals = 0
        self.preemptions = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.alive = True
        self.dead_reason: str | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="fake-engine", daemon=True)
            self._thread.start()

    def submit(self, prompt, sampling: SamplingParams | None = None, on_event=None, request_id: str | None = None,
               streaming: bool = True, text_open: bool = False) -> str:
        prompt_ids = as_prompt(prompt).ids  # the glue hands over a Prompt (ids and conditioning arrays)
        if text_open and not self.model.text_streaming:
            raise InvalidRequest(f"{self.model.spec.name} does not take text in pieces (text_open)", field="text")
        sampling = sampling or self.model.default_sampling()
        if not self.alive:
            raise EngineDead(f"engine stopped after a failure: {self.dead_reason}")
        if not prompt_ids:
            raise InvalidRequest("prompt is empty")
        sampling = sampling.validated()
        pages = self._pages_for(len(prompt_ids) + sampling.max_tokens)
        if pages > self.kv_pages:
            raise InvalidRequest(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({sampling.max_tokens}) needs "
                                 f"{pages} KV pages; the pool has {self.kv_pages}", field="max_tokens")
        with self._lock:
            if len(self._waiting) >= self.max_queue:
                raise EngineOverloaded(f"overloaded: {self.max_queue} requests already queued; retry later")
            rid = request_id or uuid.uuid4().hex
            text = bytes(i for i in prompt_ids if i < 256).decode("utf-8", "replace")
            self._arrivals += 1
            if self.model.text_streaming:
                req = _Req(rid, [], on_event, len(prompt_ids), self._arrivals, die=DIE in text,
                           prompt=list(prompt_ids), seed=sampling.seed,
                           limit=sampling.max_tokens // TOKENS_PER_CHUNK, text_open=text_open)
            else:
                req = _Req(rid, fake_audio(list(prompt_ids), sampling), on_event, len(prompt_ids), self._arrivals,
                           die=DIE in text)
            self._waiting.append(req)
        return rid

    def append_text(self, request_id: str, ids: list[int], final: bool) -> None:
        with self._lock:
            r = self._running.get(request_id) or next((w for w in self._waiting if w.request_id == request_id), None)
            if r is None or r.prompt is None or not r.text_open:
                raise InvalidRequest(f"request {request_id!r} is unknown, finished or its text is already closed",
                                     field="text")
            r.prompt.extend(int(i) for i in ids)
            r.text_open = not final

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancelled.add(request_id)

    def stats(self) -> EngineStats:
        with self._lock:
            return EngineStats(len(self._running), len(self._waiting), self._used, self.kv_pages, self.preemptions)

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _pages_for(self, positions: int) -> int:
        return math.ceil(positions / self.page_size)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._step()
                time.sleep(self.step_s)
        except Exception as e:
            self.dead_reason = str(e)
            self.alive = False
            with self._lock:
                dead = list(self._running.values()) + self._waiting
                self._running.clear(), self._waiting.clear()
                self._used = 0
            for r in dead:
                r.on_event(Event(r.request_id, EventKind.ERROR, index=r.sent, error=f"engine stopped: {e}"))

    def _step(self) -> None:
        with self._lock:
            self._admit()
            batch = [r for r in self._grow(list(self._running.values())) if r.request_id in self._running]
            cancelled = self._cancelled
            self._cancelled = set()
            for rid in cancelled:  # queued (and just preempted) requests are cancelled too
                for r in [w for w in self._waiting if w.request_id == rid]:
                    self._waiting.remove(r)
                    r.on_event(Event(rid, EventKind.FINISHED, index=r.sent, finish_reason="cancelled"))
        for r in batch:
            if r.die:
                raise RuntimeError(f"injected failure ({DIE} in the text)")
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

    def _admit(self) -> None:
        """In arrival order while pages and slots last: a new request needs its prompt's pages, a preempted one
        those of all its positions, and one free page stays for each running request (each grows)."""
        for r in list(self._waiting):
            need = self._pages_for(r.positions)
            if need + len(self._running) > self.kv_pages - self._used or len(self._running) >= self.max_batch:
                break
            self._waiting.remove(r)
            r.pages = need
            self._used += need
            self._running[r.request_id] = r

    def _grow(self, batch: list[_Req]) -> list[_Req]:
        """Each request gets the pages its next chunk's positions need; a dry pool preempts the latest admitted."""
        for r in sorted(batch, key=lambda r: r.arrival):
            missing = self._pages_for(r.positions + TOKENS_PER_CHUNK) - r.pages
            while r.request_id in self._running and missing > self.kv_pages - self._used:
                self._preempt(max(self._running.values(), key=lambda x: x.arrival))
            if r.request_id in self._running and missing > 0:
                r.pages += missing
                self._used += missing
        return batch

    def _preempt(self, r: _Req) -> None:
        del self._running[r.request_id]
        self._used -= r.pages
        r.pages = 0
        self.preemptions += 1
        self._waiting.append(r)
        self._waiting.sort(key=lambda w: w.arrival)

    def _retire(self, r: _Req, reason: str) -> None:
        with self._lock:
            if self._running.pop(r.request_id, None) is not None:
                self._used -= r.pages
                r.pages = 0
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
