"""The engine: its lifecycle, its loop (drain the inbox, admit, schedule, LM step, detokenize, emit) and the public
API. One thread per engine; callers on other threads only touch the inbox (engine/inbox.py). Events go out
through each request's `on_event` callback (engine/output.py), which must not block.
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
from voxbackend.engine.admission import Admission
from voxbackend.engine.codec_stream import CodecStream
from voxbackend.engine.detokenize import Detokenizer
from voxbackend.engine.inbox import Inbox
from voxbackend.engine.kv_pool import KVPool
from voxbackend.engine.model_runner import ModelRunner
from voxbackend.engine.output import Output
from voxbackend.engine.policies import make_policy
from voxbackend.engine.remote_codec import CodecClient, RemoteCodec
from voxbackend.engine.validation import RequestValidator
from voxbackend.errors import EngineDead, InvalidRequest
from voxbackend.events import Event, EventKind
from voxbackend.models.base import Prompt, SpeechModel
from voxbackend.request import LMState, Request
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
        self.codec_stream = CodecStream(config.device) if self.detokenizer and config.overlaps_codec else None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # holds pages (LM), preempted, or LM finished and still detokenizing
        self.admission = Admission(self.pool, self.scheduler, model, config, self.waiting, self.running)
        self.inbox = Inbox(self.waiting, config.max_queue)
        self.output = Output(model, config, clock, self.runner, self.admission, self.detokenizer, self.inbox,
                             self.running)
        self.remote_codec: RemoteCodec | None = None  # use_codec_stage: windows decode in another process
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
                      streaming=streaming, conditioning=checked.conditioning,
                      feature_positions=checked.feature_positions, features=checked.features, guide=checked.guide,
                      lm=LMState(track=checked.track, awaiting_input=self.model.waits_for_input(checked.track)))
        self.inbox.submit(req, text_open)
        return rid

    def cancel(self, request_id: str) -> None:
        self.inbox.cancel(request_id)

    def append_text(self, request_id: str, ids: list[int], final: bool) -> None:
        """More dual-track text ids (SpeechModel.text_piece_ids) for a request submitted with text_open;
        `final` closes its text (the model then ends it: tts_eos, then pads). Goes through the inbox like
        cancel. Refused with InvalidRequest(field="text") for a request that is unknown, finished or already
        closed; a request that finishes while the append is in the inbox (it stopped, was cancelled) just
        ignores it: its final event is already out. Ids its model refuses on the engine thread end the request
        with an ERROR event."""
        ids = self.model.check_track_ids(ids)  # refused here for a model without text streaming
        self.inbox.append_text(request_id, ids, final)

    def use_codec_stage(self, client: CodecClient) -> None:
        """Decode codec windows through `client` (a codec stage in another process) instead of in this one;
        before start(). The LM steps while windows are out."""
        if self.detokenizer is None:
            raise ValueError(f"{self.model.spec.name} has no codec")
        self.remote_codec = RemoteCodec(self.detokenizer, client, self.inbox.wake)
        self.codec_stream = None

    def stats(self) -> EngineStats:
        queued = self.inbox.queued()
        return EngineStats(len(self.running), queued, self.pool.used_pages, self.pool.num_pages, self.preemptions)

    def start(self) -> "Engine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="voxbackend-engine", daemon=True)
            self._thread.start()
        return self

    def shutdown(self) -> None:
        self._stop = True
        self.inbox.wake.set()
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
                elif e.final:
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
                self.inbox.wake.wait(timeout=0.05)
                self.inbox.wake.clear()

    def step(self) -> bool:
        """One iteration; returns whether there was work. Never raises: failures become error events."""
        if not self.alive:
            return False
        self._drain_inbox()
        lm: list[tuple[Request, int]] = []
        if self.remote_codec is not None:
            try:
                self._collect_remote()
            except Exception as exc:  # noqa: BLE001 - as a failed step below
                return self._step_failed(exc, lm)
        now = self.clock()
        if self.detokenizer is not None:
            for r in self.running:
                r.codec.ready_windows = self.detokenizer.ready(r)
        self.admission.admit(now)
        self._encode_features()
        lm = self.scheduler.schedule_lm(self.running, now)
        try:
            lm = self.admission.grow(lm, now)
            if self.remote_codec is not None:  # windows out first: the stage decodes them while the LM steps
                detok = self._ready_windows()
                self.remote_codec.send(detok, now)
                if lm:
                    self._run_lm(lm)
            elif self.codec_stream is not None:
                detok = self._overlapped(lm, now)
            else:
                if lm:
                    self._run_lm(lm)
                detok = self._schedule_detok(now)
                if detok:
                    self._run_detok(detok)
            self._failures = 0
        except Exception as exc:  # noqa: BLE001 - a step failure must not kill other requests' streams
            return self._step_failed(exc, lm)
        return bool(lm or detok or self.waiting or any(r.lm.preempted for r in self.running))

    @torch.inference_mode()
    def _encode_features(self) -> None:
        """engine_features models: the FEATURE vectors of the requests admitted since the last step, in one call (a
        preempted request keeps its own). A failure ends those requests only."""
        pending = [r for r in self.running if r.feature_positions and r.features is None]
        if not pending:
            return
        try:
            vectors = self.model.encode_features([r.conditioning for r in pending])
        except Exception as exc:  # noqa: BLE001 - their input, or the device: not the other streams' problem
            log.exception("encoding prompt features failed")
            for r in pending:
                self.output.finish(r, error=f"encoding the request's audio failed: {exc}")
            return
        for r, v in zip(pending, vectors):
            r.features = v.to(self.config.torch_dtype)

    def _step_failed(self, exc: Exception, lm: list[tuple[Request, int]]) -> bool:
        log.exception("engine step failed")
        self._failures += 1
        involved = {r.id for r, _ in lm} | {r.id for r in self.running if r.lm_done}
        for r in [r for r in self.running if r.id in involved]:
            self.output.finish(r, error=f"engine step failed: {exc}")
        if self._failures >= MAX_CONSECUTIVE_FAILURES:
            self._die(f"{MAX_CONSECUTIVE_FAILURES} engine steps failed in a row; last: {exc}")
        return True

    @torch.inference_mode()
    def _collect_remote(self) -> None:
        """The codec stage's replies since the last step: audio out; a request whose windows failed ends."""
        decoded, failed = self.remote_codec.collect(self.running)
        for r, error in failed:
            self.output.finish(r, error=error)
        self.output.audio(decoded)

    def _drain_inbox(self) -> None:
        cancels, appends = self.inbox.drain()
        if appends:
            live = {r.id: r for r in itertools.chain(self.waiting, self.running)}
            for rid, ids, final in appends:
                r = live.get(rid)
                if r is None or r.lm_done:  # finished while the append was in the inbox
                    continue
                try:
                    self.model.extend_track(r.lm.track, ids, final)
                except InvalidRequest as exc:  # what append_text could not tell synchronously: this request ends
                    if r in self.waiting:
                        self.waiting.remove(r)
                    self.output.finish(r, error=str(exc))
                    continue
                if r.lm.awaiting_input:
                    self.output.feed(r)
        if not cancels:
            return
        for r in [r for r in self.waiting if r.id in cancels]:
            self.waiting.remove(r)
            self.inbox.close_text(r.id)
            self.output.emit_final(r, "cancelled")
        for r in [r for r in self.running if r.id in cancels]:
            self.output.finish(r, reason="cancelled")

    def _run_lm(self, plan: list[tuple[Request, int]]) -> None:
        self.output.lm_steps(self.runner.run(plan))  # run() ends with the step's one host transfer

    def _overlapped(self, lm: list[tuple[Request, int]], now: float) -> list[tuple[Request, int]]:
        """The LM step queued, the codec windows that were ready before it decoded on the codec's stream while
        the device runs it, then the step's ids (engine/codec_stream.py). Returns the codec plan."""
        detok = self._schedule_detok(now)
        self.codec_stream.mark_before_lm()
        launched = self.runner.launch(lm) if lm else None
        if detok:
            with self.codec_stream.running():
                self._run_detok(detok)
        if launched is not None:
            self.output.lm_steps(launched.collect())
        return detok

    def _ready_windows(self) -> list[tuple[Request, int]]:
        """With a codec stage, every ready window goes out at once: its decoding costs the LM nothing here, and the
        stage batches and orders the windows of all its engines by urgency itself (codec_stage/urgent_queue.py)."""
        stateful = self.model.spec.window.stateful  # one window per request at a time, in order
        return [(r, 1 if stateful else r.codec.ready_windows) for r in self.running if r.codec.ready_windows > 0]

    def _schedule_detok(self, now: float) -> list[tuple[Request, int]]:
        if self.detokenizer is None:
            return []
        ready = [(r, n) for r in self.running if (n := self.detokenizer.ready(r)) > 0]
        lm_requests = sum(1 for r in self.running if r.on_lm)
        return self.scheduler.schedule_detok(ready, lm_requests, now, self.model.spec.window.stateful)

    @torch.inference_mode()
    def _run_detok(self, plan: list[tuple[Request, int]]) -> None:
        self.output.audio(self.detokenizer.run(plan))

    def _die(self, reason: str) -> None:
        self.alive = False
        self.dead_reason = reason
        self.inbox.flush()
        for r in list(self.running) + list(self.waiting):
            self.output.finish(r, error=f"engine stopped: {reason}")
        self.waiting.clear()
