"""What comes out of an engine step, on the engine thread: a sampled LM step becomes a token, codec codes and the
request's next inputs; decoded windows become audio events; a request that ends gives its KV pages and penalty
slot back and gets its final event. Events go out through each request's `on_event` callback, which must not
block."""
from __future__ import annotations

import logging
from typing import Callable

import numpy as np

from voxbackend.config import EngineConfig
from voxbackend.engine.admission import Admission
from voxbackend.engine.detokenize import Detokenizer
from voxbackend.engine.inbox import Inbox
from voxbackend.engine.model_runner import ModelRunner
from voxbackend.events import Event, EventKind
from voxbackend.models.base import SpeechModel
from voxbackend.request import Request

log = logging.getLogger("voxbackend.engine")


class Output:
    def __init__(self, model: SpeechModel, config: EngineConfig, clock: Callable[[], float], runner: ModelRunner,
                 admission: Admission, detokenizer: Detokenizer | None, inbox: Inbox, running: list[Request]):
        self.model = model
        self.config = config
        self.clock = clock
        self.runner = runner
        self.admission = admission
        self.detokenizer = detokenizer
        self.inbox = inbox
        self.running = running

    # ---------------------------------------------------------------- the LM
    def lm_steps(self, sampled: list[tuple[Request, int | list[int]]]) -> None:
        for r, step in sampled:
            r.lm.output_ids.append(step)
            r.codec.codes.extend(self.model.codes_from_step(step, len(r.codec.codes)))
            if self.model.text_output and self.model.is_text_id(step):
                r.lm.text_ids.append(step)
                self._send_text(r, final=False)
            if self.model.ends(step, r.lm.track):
                self._lm_finished(r, "stop")
            elif len(r.lm.output_ids) >= min(r.sampling.max_tokens,
                                             self.model.track_max_tokens(r.lm.track) or r.sampling.max_tokens):
                self._lm_finished(r, "length")
            else:
                r.lm.awaiting_input = True
                self.feed(r)

    def feed(self, r: Request) -> None:
        """The positions after the last sampled step, from the model (the step itself, the step plus the next text
        id, or several); a track still waiting for text leaves the request off the LM until append_text."""
        rows = self.model.next_inputs(r.lm.output_ids[-1] if r.lm.output_ids else None, r.lm.track)
        if rows is not None:
            r.lm.input_rows.extend(rows)
            r.lm.awaiting_input = False

    def _send_text(self, r: Request, final: bool) -> None:
        """The reply's new characters, decoding only the ids since the last piece sent (and that piece's, for
        context), not the whole reply again at every id. A byte-level tokenizer may split a character across ids:
        its text then ends in U+FFFD until the rest arrives, so that piece waits (unless the reply has ended)."""
        lm = r.lm
        sent = self.model.decode_text(lm.text_ids[lm.text_prefix:lm.text_read])
        text = self.model.decode_text(lm.text_ids[lm.text_prefix:])
        if len(text) > len(sent) and (final or not text.endswith("\ufffd")):
            self._deliver(r, Event(r.id, EventKind.TEXT, index=r.playback.chunks_sent, text=text[len(sent):]))
            lm.text_prefix, lm.text_read = lm.text_read, len(lm.text_ids)

    def _lm_finished(self, r: Request, reason: str) -> None:
        r.lm.finish_reason = reason
        if self.model.text_output:
            self._send_text(r, final=True)
        self.inbox.close_text(r.id)  # the utterance has ended
        self.admission.release(r)  # pages go back now, not after detokenization
        self.runner.release(r)
        if self.detokenizer is None or self.detokenizer.finished(r):
            self.finish(r, reason=reason)

    # ---------------------------------------------------------------- audio
    def audio(self, decoded: list[tuple[Request, np.ndarray]]) -> None:
        hold = self.config.first_chunk_s * self.model.spec.sample_rate
        for r, audio in decoded:
            done = self.detokenizer.finished(r)
            p = r.playback
            if p.first_chunk_at is None:
                # The first chunk waits until it covers first_chunk_s (or the stream ends): a listener that
                # starts on a thin buffer stalls at the next scheduling hiccup.
                p.held_audio.append(audio)
                if sum(len(a) for a in p.held_audio) < hold and not done:
                    continue
                audio, p.held_audio = np.concatenate(p.held_audio), []
            self._send_audio(r, audio)
            if done:
                self.finish(r, reason=r.lm.finish_reason)

    def _send_audio(self, r: Request, audio: np.ndarray) -> None:
        r.playback.record_chunk(self.clock(), len(audio) / self.model.spec.sample_rate)
        self._deliver(r, Event(r.id, EventKind.AUDIO, index=r.playback.chunks_sent, audio=audio))
        r.playback.chunks_sent += 1

    # ---------------------------------------------------------------- the end of a request
    def finish(self, r: Request, reason: str | None = None, error: str | None = None) -> None:
        self.inbox.close_text(r.id)
        self.admission.release(r)
        self.runner.release(r)
        if r in self.running:
            self.running.remove(r)
        if error is not None:
            self._deliver(r, Event(r.id, EventKind.ERROR, index=r.playback.chunks_sent, error=error))
        else:
            self.emit_final(r, reason or "stop")

    def emit_final(self, r: Request, reason: str) -> None:
        self._deliver(
            r, Event(r.id, EventKind.FINISHED, index=r.playback.chunks_sent, finish_reason=reason,
                     token_ids=list(r.lm.output_ids))
        )

    def _deliver(self, r: Request, event: Event) -> None:
        try:
            r.on_event(event)
        except Exception:  # noqa: BLE001 - a broken consumer must not stop the engine
            log.exception("on_event callback failed for %s", r.id)
