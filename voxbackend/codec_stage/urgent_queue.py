"""A codec stage's queue: window groups from any number of engines, decoded most urgent first, in batches.

A group is one request's windows of one engine step (one window for a stateful codec), with its codec state. Its
urgency is its deadline: when it arrived plus the audio its listener still has queued (the engine's `slack_s`;
zero or less for a stream that has not played yet, large for a batch job). Each batch takes the earliest deadlines
first, up to `max_windows` windows, so a stream's first window never waits behind bulk work queued before it,
whichever engine sent either. Triton's dynamic batcher cannot do this here: windows reach the stage over its socket
(local_socket.py says why), and a batch that is running cannot be preempted anyway, so the stage keeps batches
bounded instead.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

log = logging.getLogger("voxbackend.codec_stage")

# reply(audio per window, the codec state after the group, error): error set means the group was not decoded
Reply = Callable[[list[np.ndarray] | None, Any, str | None], None]


@dataclass(order=True)
class _Group:
    deadline: float
    seq: int
    jobs: list = field(compare=False)
    reply: Reply = field(compare=False)
    source: int = field(compare=False, default=0)  # which engine connection sent it


@dataclass
class StageStats:
    windows: int = 0
    batches: int = 0
    mixed_batches: int = 0  # batches holding windows of more than one engine
    queued: int = 0  # groups waiting now


class UrgentWindows:
    def __init__(self, model, max_windows: int, clock: Callable[[], float] = time.monotonic,
                 on_batch: Callable[[int, int], None] | None = None):
        """on_batch(windows, engines): after each decoded batch (the Triton model's metrics)."""
        if max_windows < 1:
            raise ValueError(f"max_windows must be at least 1, got {max_windows}")
        self.model = model
        self.max_windows = max_windows
        self.clock = clock
        self.on_batch = on_batch
        self.stats = StageStats()
        self._heap: list[_Group] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None

    def put(self, jobs: list, slack_s: float, reply: Reply, source: int = 0) -> None:
        if not jobs:
            raise ValueError("a window group has at least one window")
        with self._cv:
            heapq.heappush(self._heap, _Group(self.clock() + slack_s, next(self._seq), jobs, reply, source))
            self.stats.queued = len(self._heap)
            self._cv.notify()

    def take(self) -> list[_Group]:
        """The next batch: groups by deadline while their windows fit in max_windows (always at least one)."""
        batch, windows = [], 0
        while self._heap and (not batch or windows + len(self._heap[0].jobs) <= self.max_windows):
            group = heapq.heappop(self._heap)
            batch.append(group)
            windows += len(group.jobs)
        self.stats.queued = len(self._heap)
        return batch

    def decode(self, batch: list[_Group]) -> None:
        jobs = [job for group in batch for job in group.jobs]
        try:
            with torch.inference_mode():
                audio = self.model.detokenize(jobs)
        except Exception as exc:  # noqa: BLE001 - the engines end these requests; the stage keeps serving
            log.exception("codec batch of %d windows failed", len(jobs))
            for group in batch:
                _safe(group.reply, None, None, f"codec stage failed: {type(exc).__name__}: {exc}")
            return
        self.stats.windows += len(jobs)
        self.stats.batches += 1
        engines = len({group.source for group in batch})
        self.stats.mixed_batches += engines > 1
        if self.on_batch is not None:
            self.on_batch(len(jobs), engines)
        at = 0
        for group in batch:
            n = len(group.jobs)
            _safe(group.reply, list(audio[at : at + n]), group.jobs[-1].state, None)
            at += n

    def start(self) -> "UrgentWindows":
        self._thread = threading.Thread(target=self._loop, name="voxbackend-codec-stage", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._heap and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                batch = self.take()
            self.decode(batch)


def _safe(reply: Reply, audio, state, error) -> None:
    try:
        reply(audio, state, error)
    except Exception:  # noqa: BLE001 - an engine that went away must not stop the stage
        log.exception("a codec reply could not be sent")
