"""Utterances whose text arrives in pieces: the requests of one Triton sequence (correlation id, START / END).

The first piece (START) carries the voice, sampling and format fields and owns the audio stream: its response
sender gets every chunk and the final response. Every later piece gets one final flag and no response (the
client sees Triton's empty final response when it asks for it), or an error naming the field. Pieces are
tokenized here, on Triton's execute thread, with the commit rule of text_commit.py; the engine only receives
ids. The engine request starts with the first complete pre-token: a first piece "Hel" starts nothing until the
next piece or END. A sequence silent longer than max_sequence_idle_microseconds (Triton frees its slot then and
tells no one) is cancelled here, so a client that went quiet without END frees its KV pages.
Pure Python over the Engine API and the response loop: tested without Triton.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from voxbackend.errors import EngineDead, EngineOverloaded, InvalidRequest
from voxbackend.events import Event, EventKind
from voxbackend.sampling_params import SamplingParams
from voxbackend.tensor_spec import TensorSpec
from voxbackend.triton import fields
from voxbackend.triton.schema import DEFAULT_AUDIO_FORMAT
from voxbackend.triton.streams import Responder, ResponseLoop, Stream
from voxbackend.triton.text_commit import TextCommitter

log = logging.getLogger("voxbackend.triton")


@dataclass
class Piece:
    """One request of a sequence, as Triton delivered it (inputs without the batch dimension)."""

    corrid: int
    start: bool
    end: bool
    get: fields.Getter
    names: tuple[str, ...]  # the inputs the request carries, control inputs excluded
    responder: Responder
    request_id: str = ""
    arrived: float = 0.0


@dataclass
class OpenText:
    """An utterance between its START and END piece."""

    corrid: int
    stream: Stream
    committer: TextCommitter
    options: dict  # prepare() keywords from the first piece
    sampling: SamplingParams
    last_piece: float
    submitted: bool = False
    chars: int = 0  # the text received so far, against the model's max_text_chars


class StreamError(Exception):
    """The utterance cannot go on: its stream ends with this message."""


class TextSequences:
    def __init__(self, engine, loop: ResponseLoop, specs: tuple[TensorSpec, ...], idle_s: float,
                 clock: Callable[[], float] = time.monotonic, stream_id: Callable[[str], str] = lambda rid: ""):
        self.engine, self.model, self.loop, self.specs = engine, engine.model, loop, specs
        self.idle_s, self.clock, self.stream_id = idle_s, clock, stream_id
        self.sample_rate = int(self.model.spec.sample_rate)
        self._open: dict[int, OpenText] = {}
        self._lock = threading.Lock()  # execute() and the idle watcher

    @property
    def open_count(self) -> int:
        return len(self._open)

    # --- Triton's execute thread ---
    def piece(self, p: Piece) -> None:
        try:
            self._piece(p)
        except Exception as e:  # never raise out of execute: the request would never get its final flag
            log.exception("text piece %s of sequence %s failed", p.request_id, p.corrid)
            if not p.start:  # a START piece's stream is ended by _begin itself
                self.loop.reply(p.responder, f"internal error: {type(e).__name__}: {e}")

    def _piece(self, p: Piece) -> None:
        with self._lock:
            if p.start:
                self._begin(p)
                return
            seq = self._open.get(p.corrid)
            if seq is None:
                tag = f"[request id: {p.request_id}] " if p.request_id else ""
                self.loop.reply(p.responder, f"{tag}InvalidRequest: TEXT: sequence {p.corrid} has no open utterance "
                                             "(its first piece was refused, it ended, or it was idle too long)")
                return
            seq.last_piece = p.arrived
            tag = f"[request id: {p.request_id}] " if p.request_id else ""  # Triton's own form: says which piece
            try:
                extra = sorted(set(p.names) - {"TEXT"})
                if extra:
                    raise InvalidRequest(f"{extra[0]} is read from the first piece of a sequence only (START); "
                                         "later pieces carry TEXT alone", field=fields.engine_field(extra[0]))
                text = piece_text(p.get)
            except InvalidRequest as e:
                self.loop.reply(p.responder, f"{tag}InvalidRequest: {e}")  # this piece only: the utterance goes on
                return
            error = self._feed(seq, text, p.end)
            self.loop.reply(p.responder, None if error is None else tag + error)

    def _begin(self, p: Piece) -> None:
        old = self._open.pop(p.corrid, None)
        if old is not None:  # START again on a live id: a new utterance replaces the old one
            self._drop(old, "a new START on its sequence")
        rid = f"{p.request_id or 'text'}-{p.corrid}-{uuid.uuid4().hex[:8]}"
        try:
            fmt = fields.audio_format(p.get)
        except InvalidRequest:
            fmt = DEFAULT_AUDIO_FORMAT  # reported below, once the stream exists
        stream = Stream(rid, p.responder, fmt, p.arrived, self.sample_rate, stream_id=self.stream_id(rid))
        self.loop.add(stream)
        if self.loop.closing:
            return
        try:
            fields.audio_format(p.get)
            options = fields.prepare_kwargs(p.get, self.specs)
            sampling = fields.sampling(p.get, self.model.default_sampling())
            text = piece_text(p.get)
            committer = TextCommitter(self.model.text_tokenizer, self.model.text_piece_ids)
        except InvalidRequest as e:
            self.loop.reject(rid, f"InvalidRequest: {e}")
            return
        except Exception as e:  # the stream exists: end it, never leave it open
            self.loop.reject(rid, f"internal error: {type(e).__name__}: {e}")
            return
        stream.seed = sampling.seed
        seq = OpenText(p.corrid, stream, committer, options, sampling, p.arrived)
        self._open[p.corrid] = seq
        error = self._feed(seq, text, p.end, on_stream=True)
        if error is not None:
            self.loop.reject(rid, error)

    def _feed(self, seq: OpenText, text: str, end: bool, on_stream: bool = False) -> str | None:
        """Commit what became final; returns the piece's error message (None: accepted). An error that ends
        the utterance is also sent on its stream (unless the piece is the stream's own)."""
        rid = seq.stream.request_id
        if end:
            self._forget(seq)
        try:
            seq.chars += len(text)
            if seq.chars > self.model.max_text_chars:
                raise StreamError(f"InvalidRequest: TEXT: the pieces add up to {seq.chars} characters; the limit is "
                                  f"{self.model.max_text_chars}")
            ids = seq.committer.add(text) + (seq.committer.close() if end else [])
            if not seq.submitted:
                self._submit(seq, end)
            elif ids or end:
                self.engine.append_text(rid, ids, end)
            return None
        except StreamError as e:
            self._forget(seq)
            if seq.submitted:  # the engine request must not play on (nor hold its pages) after its stream ended
                self.engine.cancel(rid)
            if not on_stream:
                self.loop.reject(rid, str(e))
            return str(e)
        except InvalidRequest as e:  # append_text: the request finished (max_tokens, cancelled) or is closed
            return f"InvalidRequest: {fields.for_client(e, self.specs)}"
        except Exception as e:  # never raise out of execute
            log.exception("text piece of %s failed", rid)
            return f"internal error: {type(e).__name__}: {e}"

    def _forget(self, seq: OpenText) -> None:
        if self._open.get(seq.corrid) is seq:
            del self._open[seq.corrid]

    def _submit(self, seq: OpenText, end: bool) -> None:
        """Start the engine request once some text is final (or the text is complete)."""
        head, rest = seq.committer.head()
        if not head.strip():
            if not end:
                return  # nothing final yet: the request starts with the first complete pre-token
            raise StreamError("InvalidRequest: TEXT is empty (the sequence ended without text)")
        text_open = not end or bool(rest)
        try:
            prompt = self.model.prepare(head, text_open=text_open, **seq.options)
            self.engine.submit(prompt, seq.sampling, self.loop.on_event, request_id=seq.stream.request_id,
                               text_open=text_open)
        except InvalidRequest as e:
            raise StreamError(f"InvalidRequest: {fields.for_client(e, self.specs)}") from None
        except (EngineOverloaded, EngineDead) as e:
            raise StreamError(f"{type(e).__name__}: {e}") from None
        seq.submitted = True
        if text_open:
            self.engine.append_text(seq.stream.request_id, rest, end)

    # --- the idle watcher thread ---
    def expire_idle(self) -> None:
        now = self.clock()
        with self._lock:
            for corrid, seq in list(self._open.items()):
                if not seq.submitted and seq.stream.cancel_at is not None:
                    del self._open[corrid]  # the client left before the engine request started
                    self._drop(seq, "its client went away")
                elif now - seq.last_piece > self.idle_s:
                    del self._open[corrid]
                    log.warning("sequence %s sent no piece for %.1f s (max_sequence_idle_microseconds); cancelled",
                                corrid, now - seq.last_piece)
                    self._drop(seq, "idle")

    def _drop(self, seq: OpenText, why: str) -> None:
        rid = seq.stream.request_id
        if seq.submitted:
            self.loop.request_cancel(rid)  # the engine finishes it as cancelled and frees its pages
        else:  # nothing in the engine: end the stream here
            self.loop.on_event(Event(rid, EventKind.FINISHED, finish_reason="cancelled"))
        log.info("text stream %s cancelled: %s", rid, why)


def piece_text(get: fields.Getter) -> str:
    """A piece's TEXT: required, UTF-8, may be empty (an END piece with no more text)."""
    return fields.string_field(get, "TEXT", required=True)
