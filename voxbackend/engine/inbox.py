"""The one place callers on other threads touch the engine: new requests, cancellations and appended text wait
here under a lock until the engine thread drains them at the start of a step. Everything else is the engine
thread's."""
from __future__ import annotations

import threading
from collections import deque

from voxbackend.errors import EngineOverloaded, InvalidRequest
from voxbackend.request import Request

Append = tuple[str, list[int], bool]  # (request id, text ids, final)


class Inbox:
    def __init__(self, waiting: deque[Request], max_queue: int):
        self.waiting = waiting  # the engine's queue; read (its length) and extended only under the lock
        self.max_queue = max_queue
        self.wake = threading.Event()  # set on every arrival: the idle engine thread sleeps on it
        self._lock = threading.Lock()
        self._new: list[Request] = []
        self._cancels: set[str] = set()
        self._appends: list[Append] = []
        self._open_text: set[str] = set()  # requests whose text is still open (append_text takes more)

    def submit(self, req: Request, text_open: bool) -> None:
        with self._lock:
            if len(self.waiting) + len(self._new) >= self.max_queue:
                raise EngineOverloaded(f"overloaded: {self.max_queue} requests already queued; retry later")
            self._new.append(req)
            if text_open:
                self._open_text.add(req.id)
        self.wake.set()

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancels.add(request_id)
        self.wake.set()

    def append_text(self, request_id: str, ids: list[int], final: bool) -> None:
        with self._lock:
            if request_id not in self._open_text:
                raise InvalidRequest(f"request {request_id!r} is unknown, finished or its text is already closed",
                                     field="text")
            if final:
                self._open_text.discard(request_id)
            self._appends.append((request_id, list(ids), final))
        self.wake.set()

    def close_text(self, request_id: str) -> None:
        """Text appended from now on is refused: the request has ended (or its utterance has)."""
        with self._lock:
            self._open_text.discard(request_id)

    def queued(self) -> int:
        with self._lock:
            return len(self.waiting) + len(self._new)

    def drain(self) -> tuple[set[str], list[Append]]:
        """New requests join the waiting queue; returns the cancellations and appends since the last drain."""
        with self._lock:
            self.waiting.extend(self._new)
            self._new.clear()
            cancels, self._cancels = self._cancels, set()
            appends, self._appends = self._appends, []
        return cancels, appends

    def flush(self) -> None:
        """New requests join the waiting queue (the engine is stopping and fails them all)."""
        with self._lock:
            self.waiting.extend(self._new)
            self._new.clear()
