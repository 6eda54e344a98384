"""The engine loop: admit, schedule, LM step, sample, detokenize, emit. One thread per engine.

Callers on other threads only touch the inbox (submissions, cancellations and appended text) under a lock;
everything else is owned by the engine thread. Events go out through each request's `on_event` callback, which
must not block.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch

from voxbackend.config import EngineConfig
from voxbackend.engine.detokenize import Detokenizer
from voxbackend.engine.kv_pool import KVPool
from voxbackend.engine.admission import Admission
from voxbackend.engine.model_runner import ModelRunner
from voxbackend.engine.policies import make_policy
from voxbackend.engine.validation import RequestValidator
from voxbackend.errors import EngineDead, EngineOverloaded, InvalidRequest
from voxbackend.events import Event, EventKind
from voxbackend.models.base import Prompt, SpeechModel
from voxbackend.request import Request
from voxbackend.sampling_params import SamplingParams

log = logging.getLogger("voxbackend.engine")
MAX_CONSECUTIVE_FAILURES = 3


@dataclass
class EngineStats:
    running: int  # admitted and not finished: on the LM, preempted (waiting to resume) or still detokenizing
    queued: int  # waiting for admission
    kv_pages_used: int
    kv_pages_total: int
    preemptions: int  # since the engine started: requests whose KV pages were taken back mid-generation


class Engine:
    def __init__(self, model: SpeechModel, config: EngineConfig, clock: Callable[[], float] = time.monotonic):
        self.model = model
        self.config = config
        self.clock = clock
        self.pool = KVPool(model.spec.geometry, config.kv_pages, config.page_size, config.device, config.torch_dtype)
        self.runner = ModelRunner(model, config, self.pool)
        self.validator = RequestValidator(model, config, self.pool)
        self.scheduler = make_policy(config)
        self.detokenizer = Detokenizer(model) if model.spec.window else None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # holds pages (LM), preempted, or LM finished and still detokenizing
        self.admission = Admission(self.pool, self.scheduler, model, config, self.waiting, self.running)
        self._inbox: list[Request] = []
        self._cancels: set[str] = set()
        self._appends: list[tuple[str, list[int], bool]] = []
        self._open_text: set[str] = set()  # requests whose text is still open (append_text takes more)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._ids = itertools.count()
        self._failures = 0
        self.alive = True
        self.dead_reason: str | None = None

    @property
    def max_tokens_limit(self) -> int:
        """The largest max_tokens a request may ask (EngineConfig.max_tokens_limit, or the model's maximum)."""
        return self.validator.max_tokens_limit

    @property
    def preemptions(self) -> int:
        return self.admission.preemptions

    @property
    def attention(self):
        """The paged attention backend the model runner plans each step with."""
        return self.runner.attention

    # ---------------------------------------------------------------- public, thread-safe
    def submit(
        self,
        prompt: list[int] | list[list[int]] | Prompt,
        sampling: SamplingParams | None = None,
        on_event: Callable[[Event], None] | None = None,
        request_id: str | None = None,
        streaming: bool = True,
        text_open: bool = False,
    ) -> str:
        """Queue a request; validation errors raise here, before any device work. A Prompt (what prepare may
        return) brings the request's conditioning arrays and the model's length rules for it. `text_open` (models
        with text_streaming): the prompt holds the first piece of the text; more comes through append_text."""
        if not self.alive:
            raise EngineDead(f"engine stopped after a failure: {self.dead_reason}")
        checked = self.validator.check(prompt, sampling, text_open)
        rid = request_id or f"req-{next(self._ids)}"
        req = Request(rid, checked.prompt_ids, checked.sampling, on_event or (lambda e: None), self.clock(),
                      streaming=streaming, track=checked.track, conditioning=checked.conditioning,
                      awaiting_input=self.model.waits_for_input(checked.track),
                      feature_positions=checked.feature_positions, features=checked.features)
        with self._lock:
            if len(self.waiting) + len(self._inbox) >= self.config.max_queue:
                raise EngineOverloaded(f"overloaded: {self.config.max_queue} requests already queued; retry later")
            self._inbox.append(req)
            if text_open:
                self._open_text.add(rid)
        self._wake.set()
        return rid

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancels.add(request_id)
        self._wake.set()

    def append_text(self, request_id: str, ids: list[int], final: bool) -> None:
        """More dual-track text ids (SpeechModel.text_piece_ids) for a request submitted with text_open;
        `final` closes its text (the model then ends it: tts_eos, then pads). Goes through the inbox like
        cancel. Refused with InvalidRequest(field="text") for a request that is unknown, finished or already
        closed; a request that finishes while the append is in the inbox (it stopped, was cancelled) just
        ignores it: its final event is already out. Ids its model refuses on the engine thread end the request
        with an ERROR event."""
        ids = self.model.check_track_ids(ids)  # refused here for a model without text streaming
        with self._lock:
            if request_id not in self._open_text:
                raise InvalidRequest(f"request {request_id!r} is unknown, finished or its text is already closed",
                                     field="text")
            if final:
                self._open_text.discard(request_id)
            self._appends.append((request_id, list(ids), final))
        self._wake.set()

    def stats(self) -> EngineStats:
        with self._lock:
            queued = len(self.waiting) + len(self._inbox)
        return EngineStats(len(self.running), queued, self.pool.used_pages, self.pool.num_pages, self.preemptions)

    def start(self) -> "Engine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="voxbackend-engine", daemon=True)
            self._thread.start()
        return self

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    # ---------------------------------------------------------------- convenience API
    def generate_ids(self, prompts: list[list[int]], sampling: SamplingParams | None = None) -> list[list[int]]:
        """LM tokens only; all prompts are submitted together and batched continuously."""
        done: dict[str, list[int]] = {}
        errors: list[str] = []
        finished = threading.Event()

        def on_event(e: Event) -> None:
            if e.kind is EventKind.ERROR:
                errors.append(e.error or "error")
            if e.final:
                done[e.request_id] = e.token_ids or []
                if len(done) == len(prompts):
                    finished.set()

        ids = [self.submit(p, sampling, on_event, streaming=False) for p in prompts]
        self._wait(finished)
        if errors:
            raise RuntimeError(errors[0])
        return [done[i] for i in ids]

    def stream(
        self, text: str, voice: str | None = None, sampling: SamplingParams | None = None, **prepare_options
    ) -> Iterator[np.ndarray]:
        """`prepare_options` go to the model's prepare (CSM: context=[...])."""
        events: queue.Queue[Event] = queue.Queue()
        rid = self.submit(self.model.prepare(text, voice, **prepare_options), sampling, events.put)
        self.start()
        try:
            while True:
                e = events.get()
                if e.kind is EventKind.AUDIO:
                    yield e.audio
                elif e.kind is EventKind.ERROR:
                    raise RuntimeError(e.error)
                else:
                    return
        finally:
            self.cancel(rid)  # a consumer that stops early frees the request; harmless once finished

    def synthesize(
        self, text: str, voice: str | None = None, sampling: SamplingParams | None = None, **prepare_options
    ):
        chunks = list(self.stream(text, voice, sampling, **prepare_options))
        audio = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
        return audio, self.model.spec.sample_rate

    def _wait(self, finished: threading.Event) -> None:
        if self._thread is not None:
            finished.wait()
            return
        while not finished.is_set():  # not started: drive the loop on this thread
            self.step()

    # ---------------------------------------------------------------- the loop
    def _loop(self) -> None:
        while not self._stop:
            worked = self.step()
            if not worked:
                self._wake.wait(timeout=0.05)
                self._wake.clear()

    def step(self) -> bool:
        """One iteration; returns whether there was work. Never raises: failures become error events."""
        if not self.alive:
            return False
        self._drain_inbox()
        now = self.clock()
        if self.detokenizer is not None:
            for r in self.running:
                r.ready_windows = self.detokenizer.ready(r)
        self.admission.admit(now)
        lm = self.scheduler.schedule_lm(self.running, now)
        try:
            lm = self.admission.grow(lm, now)
            if lm:
                self._run_lm(lm)
            detok = self._schedule_detok(now, lm_requests=sum(1 for r in self.running if r.on_lm))
            if detok:
                self._run_detok(detok)
            self._failures = 0
        except Exception as exc:  # noqa: BLE001 - a step failure must not kill other requests' streams
            log.exception("engine step failed")
            self._failures += 1
            involved = {r.id for r, _ in lm} | {r.id for r in self.running if r.lm_done}
            for r in [r for r in self.running if r.id in involved]:
                self._finish(r, error=f"engine step failed: {exc}")
            if self._failures >= MAX_CONSECUTIVE_FAILURES:
                self._die(f"{MAX_CONSECUTIVE_FAILURES} engine steps failed in a row; last: {exc}")
            return True
        return bool(lm or detok or self.waiting or any(r.preempted for r in self.running))

    def _drain_inbox(self) -> None:
        with self._lock:
            self.waiting.extend(self._inbox)
            self._inbox.clear()
            cancels, self._cancels = self._cancels, set()
            appends, self._appends = self._appends, []
        if appends:
            live = {r.id: r for r in itertools.chain(self.waiting, self.running)}
            for rid, ids, final in appends:
                r = live.get(rid)
                if r is None or r.lm_done:  # finished while the append was in the inbox
                    continue
                try:
                    self.model.extend_track(r.track, ids, final)
                except InvalidRequest as exc:  # what append_text could not tell synchronously: this request ends
                    if r in self.waiting:
                        self.waiting.remove(r)
                    self._finish(r, error=str(exc))
                    continue
                if r.awaiting_input:
                    self._feed(r)
        if not cancels:
            return
        for r in [r for r in self.waiting if r.id in cancels]:
            self.waiting.remove(r)
            with self._lock:
                self._open_text.discard(r.id)
            self._emit_final(r, "cancelled")
        for r in [r for r in self.running if r.id in cancels]:
            self._finish(r, reason="cancelled")

    def _run_lm(self, plan: list[tuple[Request, int]]) -> None:
        for r, step in self.runner.run(plan):  # the step's one host transfer is behind us
            r.output_ids.append(step)
            r.codes.extend(self.model.codes_from_step(step, len(r.codes)))
            if self.model.ends(step, r.track):
                self._lm_finished(r, "stop")
            elif len(r.output_ids) >= r.sampling.max_tokens:
                self._lm_finished(r, "length")
            else:
                r.awaiting_input = True
                self._feed(r)

    def _feed(self, r: Request) -> None:
        """The positions after the last sampled step, from the model (the step itself, the step plus the next text
        id, or several); a track still waiting for text leaves the request off the LM until append_text."""
        rows = self.model.next_inputs(r.output_ids[-1] if r.output_ids else None, r.track)
        if rows is not None:
            r.input_rows.extend(rows)
            r.awaiting_input = False

    def _lm_finished(self, r: Request, reason: str) -> None:
        r.finish_reason = reason
        with self._lock:  # text appended from now on is refused: the utterance has ended
            self._open_text.discard(r.id)
        self.admission.release(r)  # pages go back now, not after detokenization
        self.runner.release(r)
        if self.detokenizer is None or self.detokenizer.finished(r):
            self._finish(r, reason=reason)

    def _schedule_detok(self, now: float, lm_requests: int) -> list[tuple[Request, int]]:
        if self.detokenizer is None:
            return []
        ready = [(r, n) for r in self.running if (n := self.detokenizer.ready(r)) > 0]
        return self.scheduler.schedule_detok(ready, lm_requests, now, self.model.spec.window.stateful)

    @torch.inference_mode()
    def _run_detok(self, plan: list[tuple[Request, int]]) -> None:
        hold = self.config.first_chunk_s * self.model.spec.sample_rate
        for r, audio in self.detokenizer.run(plan):
            done = self.detokenizer.finished(r)
            if r.first_chunk_at is None:
                # The first chunk waits until it covers first_chunk_s (or the stream ends): a listener that
                # starts on a thin buffer stalls at the next scheduling hiccup.
                r.held_audio.append(audio)
                if sum(len(a) for a in r.held_audio) < hold and not done:
                    continue
                audio, r.held_audio = np.concatenate(r.held_audio), []
            self._send_audio(r, audio)
            if done:
                self._finish(r, reason=r.finish_reason)

    def _send_audio(self, r: Request, audio: np.ndarray) -> None:
        r.record_chunk(self.clock(), len(audio) / self.model.spec.sample_rate)
        self._deliver(r, Event(r.id, EventKind.AUDIO, index=r.chunks_sent, audio=audio))
        r.chunks_sent += 1

    def _finish(self, r: Request, reason: str | None = None, error: str | None = None) -> None:
        with self._lock:
            self._open_text.discard(r.id)
        self.admission.release(r)
        self.runner.release(r)
        if r in self.running:
            self.running.remove(r)
        if error is not None:
            self._deliver(r, Event(r.id, EventKind.ERROR, index=r.chunks_sent, error=error))
        else:
            self._emit_final(r, reason or "stop")

    def _emit_final(self, r: Request, reason: str) -> None:
        self._deliver(
            r, Event(r.id, EventKind.FINISHED, index=r.chunks_sent, finish_reason=reason, token_ids=list(r.output_ids))
        )

    def _deliver(self, r: Request, event: Event) -> None:
        try:
            r.on_event(event)
        except Exception:  # noqa: BLE001 - a broken consumer must not stop the engine
            log.exception("on_event callback failed for %s", r.id)

    def _die(self, reason: str) -> None:
        self.alive = False
        self.dead_reason = reason
        with self._lock:
            self.waiting.extend(self._inbox)
            self._inbox.clear()
        for r in list(self.running) + list(self.waiting):
            self._finish(r, error=f"engine stopped: {reason}")
        self.waiting.clear()
