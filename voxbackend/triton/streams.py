"""The one response thread of an engine model instance.

The engine thread only puts events into a queue (never blocks on Triton); this thread turns them into
responses, polls every open stream's is_cancelled() and cancels in the engine, sends probes for streams behind
a BLS caller that have nothing to send (cancel_channel), updates the metrics, and ends every stream with exactly
one final response even when the engine dies. One sender thread, not one per
request: concurrent sends from many threads crashed the Python backend stub.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from voxbackend.events import Event, EventKind
from voxbackend.triton.drain import DRAINING, grace_expired

log = logging.getLogger("voxbackend.triton")
PROBE = "probe"  # FINISH_REASON of a probe response: no audio, dropped by the BLS caller
SHUTDOWN = "shutdown"  # FINISH_REASON of streams ended because the server is stopping
# A stream of a BLS caller (CANCEL_PROBES) that fails gets a normal final response whose FINISH_REASON is this prefix
# and the message, for the caller to send its client as an error. In 2.51 an error response of the engine after its
# first one never reached the BLS call (seen here: an engine failure, the drain's grace period).
ERROR_PREFIX = "error: "


class Responder(Protocol):
    """One client stream as the loop sees it (the Triton adapter wraps a response sender)."""

    def send(self, outputs: dict[str, np.ndarray] | None, error: str | None, final: bool) -> None: ...

    def is_cancelled(self) -> bool: ...


class Metrics(Protocol):
    def first_audio(self, seconds: float) -> None: ...
    def late_chunk(self) -> None: ...
    def finished(self, reason: str) -> None: ...
    def gauges(self, active: int, queued: int, kv_used: int, kv_total: int, alive: bool) -> None: ...
    def preemptions(self, total: int) -> None: ...


class NullMetrics:
    def first_audio(self, seconds: float) -> None: pass
    def late_chunk(self) -> None: pass
    def finished(self, reason: str) -> None: pass
    def gauges(self, active: int, queued: int, kv_used: int, kv_total: int, alive: bool) -> None: pass
    def preemptions(self, total: int) -> None: pass


@dataclass
class Stream:
    request_id: str
    responder: Responder
    audio_format: str
    arrived: float  # clock time the request reached this model
    sample_rate: int
    stream_id: str = ""  # sent with every response (see cancel_channel)
    seed: int = 0  # the request's sampling seed, returned with every response
    probes: bool = False  # a BLS caller's stream: probe while there is nothing to send (see cancel_channel)
    text_output: bool = False  # the model answers in text too: every response carries TEXT_OUT
    last_sent: float | None = None  # clock time of the last response (None: none yet)
    chunks: int = 0
    first_sent: float | None = None
    audio_s: float = 0.0  # audio sent so far, seconds
    cancel_at: float | None = None  # when we asked the engine to cancel


@dataclass
class _Add:
    stream: Stream


@dataclass
class _Stop:
    reason: str


@dataclass
class _Cancel:
    request_id: str


@dataclass
class _Shutdown:
    pass


@dataclass
class _Drain:
    grace_s: float


@dataclass
class _Reply:
    responder: Responder
    error: str | None


@dataclass
class ResponseLoop:
    engine: object  # cancel(), stats(), alive
    metrics: Metrics = field(default_factory=NullMetrics)
    poll_s: float = 0.02  # longest wait for an event before housekeeping
    cancel_check_s: float = 0.1  # is_cancelled() is an IPC round trip per stream: not on every poll
    gauge_s: float = 0.25  # how often engine.stats() is read
    cancel_grace_s: float = 30.0  # a cancelled stream the engine never finishes is closed by us
    probe_s: float = 0.4  # a probing stream silent this long gets a probe: a dead front client is seen within 1 s
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, Stream] = {}
        self._thread: threading.Thread | None = None
        self._last_gauges = 0.0
        self._last_cancel_check = 0.0
        self.closing = False  # set by request_shutdown: every stream, open or new, ends at once
        self.draining = False  # set by request_drain: new streams are refused, open ones may finish
        self._drain_deadline: float | None = None
        self._drain_grace_s = 0.0

    # --- called from execute() (Triton's thread) ---
    def add(self, stream: Stream) -> None:
        """Register before engine.submit, so the stream is known before its first event is handled."""
        self._queue.put(_Add(stream))

    def reject(self, request_id: str, message: str) -> None:
        self._queue.put(Event(request_id, EventKind.ERROR, error=message))

    def reply(self, responder: Responder, error: str | None = None) -> None:
        """End a request that carries no stream (a later piece of a text stream) with one final send: an error,
        or no response at all (the client sees Triton's empty final response if it asked for it). Through this
        thread: sends from several threads crash the stub."""
        self._queue.put(_Reply(responder, error))

    def request_cancel(self, request_id: str) -> None:
        """Cancel from outside Triton's own signal (a BLS caller, via cancel_channel)."""
        self._queue.put(_Cancel(request_id))

    def request_shutdown(self) -> None:
        """The server is stopping (the launcher, via cancel_channel): end every stream with a final response.

        A normal final response (FINISH_REASON "shutdown"), not an error: the request was not at fault."""
        self.closing = True
        self._queue.put(_Shutdown())

    def request_drain(self, grace_s: float) -> None:
        """The server is stopping (drain.DrainWatch): refuse new streams; open ones may run grace_s more
        seconds, then end with an error and a final flag, so that Triton can unload the model in time."""
        self.draining = True
        self._queue.put(_Drain(grace_s))

    # --- called from the engine thread: must not block ---
    def on_event(self, event: Event) -> None:
        self._queue.put(event)

    # --- lifecycle ---
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="voxbackend-responses", daemon=True)
            self._thread.start()

    def stop(self, reason: str = "the model is being unloaded", timeout: float = 5.0) -> None:
        if self._thread is not None:
            self._queue.put(_Stop(reason))
            self._thread.join(timeout)
            self._thread = None

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    # --- the thread ---
    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self.poll_s if not self.closing else 0.5)  # stopping: stay quiet
            except queue.Empty:
                item = None
            try:
                # housekeeping at least every poll_s: an engine that keeps the queue full must not hide a cancel
                until = self.clock() + self.poll_s
                while item is not None:
                    if isinstance(item, _Stop):
                        self._close_all(item.reason)
                        return
                    self._handle(item)
                    busy = not self._queue.empty() and self.clock() < until
                    item = self._queue.get_nowait() if busy else None
                self._housekeeping()
            except Exception:  # never let the sender die: every open stream would hang
                log.exception("response loop error")

    def _handle(self, item: _Add | _Cancel | _Shutdown | _Reply | Event) -> None:
        if isinstance(item, _Reply):
            try:
                item.responder.send(None, item.error, final=True)
            except Exception as e:
                log.warning("reply failed: %s", e)
            return
        if isinstance(item, _Add):
            self._streams[item.stream.request_id] = item.stream
            if self.closing:
                self._end_for_shutdown(item.stream)
            elif self.draining:
                self._fail(item.stream, DRAINING)
            return
        if isinstance(item, _Drain):
            self._drain_grace_s = item.grace_s
            self._drain_deadline = self.clock() + item.grace_s
            return
        if isinstance(item, _Shutdown):
            for s in list(self._streams.values()):
                self._end_for_shutdown(s)
            self._update_gauges()  # at once: the launcher sends SIGINT when the gauges show no open stream
            self._last_gauges = self.clock()
            return
        if isinstance(item, _Cancel):
            s = self._streams.get(item.request_id)
            if s is not None and s.cancel_at is None:
                s.cancel_at = self.clock()
                self.engine.cancel(s.request_id)
            return
        stream = self._streams.get(item.request_id)
        if stream is None:
            return  # already closed (e.g. by the cancel watchdog)
        if item.kind is EventKind.AUDIO:
            self._send_audio(stream, item)
        elif item.kind is EventKind.TEXT:
            empty = np.zeros(0, dtype=np.float32)
            self._safe_send(stream, self._outputs(stream, empty, stream.chunks, final=False, reason="",
                                                  text=item.text), None, final=False)
        elif item.kind is EventKind.FINISHED:
            self._finish(stream, item.finish_reason or "stop")
        else:
            self._fail(stream, item.error or "engine error")

    def _send_audio(self, s: Stream, event: Event) -> None:
        now = self.clock()
        audio = np.asarray(event.audio, dtype=np.float32).reshape(-1)
        if s.first_sent is None:
            s.first_sent = now
            self.metrics.first_audio(now - s.arrived)
        elif s.audio_s <= now - s.first_sent:
            self.metrics.late_chunk()  # the listener's buffer ran dry before this chunk (docs/metrics.md)
        s.audio_s += audio.size / s.sample_rate
        self._safe_send(s, self._outputs(s, audio, s.chunks, final=False, reason=""), None, final=False)
        s.chunks += 1

    def _send_probe(self, s: Stream) -> None:
        empty = np.zeros(0, dtype=np.float32)
        self._safe_send(s, self._outputs(s, empty, s.chunks, final=False, reason=PROBE), None, final=False)

    def _finish(self, s: Stream, reason: str) -> None:
        self._streams.pop(s.request_id, None)
        self.metrics.finished(reason)
        empty = np.zeros(0, dtype=np.float32)
        self._safe_send(s, self._outputs(s, empty, s.chunks, final=True, reason=reason), None, final=True)

    def _end_for_shutdown(self, s: Stream) -> None:
        self.engine.cancel(s.request_id)
        self._finish(s, SHUTDOWN)

    def _fail(self, s: Stream, message: str) -> None:
        self._streams.pop(s.request_id, None)
        self.metrics.finished("error")
        if s.probes:  # a BLS caller's stream (ERROR_PREFIX)
            empty = np.zeros(0, dtype=np.float32)
            self._safe_send(s, self._outputs(s, empty, s.chunks, final=True, reason=ERROR_PREFIX + message), None,
                            final=True)
        else:
            self._safe_send(s, None, message, final=True)

    def _outputs(self, s: Stream, audio: np.ndarray, index: int, final: bool, reason: str,
                 text: str = "") -> dict[str, np.ndarray]:
        out = {
            "AUDIO": audio,
            "SAMPLE_RATE": np.array([s.sample_rate], dtype=np.int32),
            "CHUNK_INDEX": np.array([index], dtype=np.int32),
            "FINAL": np.array([final], dtype=bool),
            "FINISH_REASON": np.array([reason.encode()], dtype=np.object_),
            "AUDIO_FORMAT": np.array([s.audio_format.encode()], dtype=np.object_),
            "STREAM_ID": np.array([s.stream_id.encode()], dtype=np.object_),
            "SEED_USED": np.array([s.seed], dtype=np.int64),
        }
        if s.text_output:
            out["TEXT_OUT"] = np.array([text.encode()], dtype=np.object_)
        return out

    def _safe_send(self, s: Stream, outputs, error: str | None, final: bool) -> None:
        s.last_sent = self.clock()
        try:
            s.responder.send(outputs, error, final)
        except Exception as e:  # a client that went away must not take the loop down
            log.warning("send to %s failed: %s", s.request_id, e)

    def _housekeeping(self) -> None:
        now = self.clock()
        alive = getattr(self.engine, "alive", True)
        check = now - self._last_cancel_check >= self.cancel_check_s
        if check:
            self._last_cancel_check = now
        expired = self._drain_deadline is not None and now >= self._drain_deadline
        for s in list(self._streams.values()):
            if expired:
                self.engine.cancel(s.request_id)
                self._fail(s, grace_expired(self._drain_grace_s))
            elif not alive:
                self._fail(s, "the engine stopped after an internal error; the model must be reloaded")
            elif s.cancel_at is None:
                if check and self._cancelled(s):
                    s.cancel_at = now
                    self.engine.cancel(s.request_id)
                elif s.probes and now - (s.last_sent or s.arrived) >= self.probe_s:
                    self._send_probe(s)
            elif now - s.cancel_at > self.cancel_grace_s:
                log.warning("engine did not finish cancelled request %s; closing it", s.request_id)
                self._finish(s, "cancelled")
        if now - self._last_gauges >= self.gauge_s:
            self._last_gauges = now
            self._update_gauges()

    def _cancelled(self, s: Stream) -> bool:
        try:
            return bool(s.responder.is_cancelled())
        except Exception:
            return False

    def _update_gauges(self) -> None:
        try:
            st = self.engine.stats()
            alive = bool(getattr(self.engine, "alive", True))
            self.metrics.gauges(len(self._streams), st.queued, st.kv_pages_used, st.kv_pages_total, alive)
            self.metrics.preemptions(getattr(st, "preemptions", 0))  # engines without preemption report none
        except Exception as e:
            log.debug("stats unavailable: %s", e)

    def _close_all(self, reason: str) -> None:
        for s in list(self._streams.values()):
            self._fail(s, f"request aborted: {reason}")
        self._update_gauges()
