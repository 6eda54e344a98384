"""The engine's codec when it runs in another process (a codec stage, codec_stage/): each request's windows go out
with its codec state and its urgency, and come back later as audio and the state after them.

While a request's windows are out it has none ready (Detokenizer.ready), so the engine neither sends its next
window (a stateful codec's windows must follow each other) nor finishes it. The LM keeps stepping meanwhile. A
request that ends meanwhile (cancelled, failed) drops its reply when it comes: its codec state is then nowhere.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Protocol

import numpy as np

from voxbackend.engine.detokenize import Detokenizer
from voxbackend.request import Request

BULK_SLACK_S = 3600.0  # a batch request has no listener: behind every stream


class CodecClient(Protocol):
    def decode(self, jobs: list, slack_s: float) -> Future:
        """Decode one request's windows (WindowJob, in order) -> a future of (audio per window, state after)."""

    def close(self) -> None: ...


def slack_s(r: Request, now: float) -> float:
    """How long the request's listener can wait for this window: the audio it still has queued; a stream not
    playing yet has waited since it arrived (the oldest first)."""
    if not r.streaming:
        return BULK_SLACK_S
    if r.playback.first_chunk_at is None:
        return -(now - r.arrival)
    return r.playback.buffer_s(now)


class RemoteCodec:
    def __init__(self, detokenizer: Detokenizer, client: CodecClient, wake: threading.Event):
        self.detokenizer = detokenizer
        self.client = client
        self.wake = wake  # the engine loop's: a reply wakes it
        self.out: dict[str, tuple[Request, int, Future]] = {}

    def send(self, plan: list[tuple[Request, int]], now: float) -> None:
        for r, n in plan:
            future = self.client.decode(self.detokenizer.jobs(r, n), slack_s(r, now))
            r.codec.in_flight = True
            self.out[r.id] = (r, n, future)
            future.add_done_callback(lambda _: self.wake.set())

    def collect(self, running: list[Request]) -> tuple[list[tuple[Request, np.ndarray]], list[tuple[Request, str]]]:
        """The replies that came: (request, audio) decoded, (request, error) failed; requests no longer running
        are left out."""
        decoded, failed = [], []
        live = {r.id for r in running}
        for rid in [rid for rid, (_, _, f) in self.out.items() if f.done()]:
            r, n, future = self.out.pop(rid)
            r.codec.in_flight = False
            if rid not in live:
                continue
            try:
                audio, state = future.result()
            except Exception as exc:  # noqa: BLE001 - this request's windows failed; the others play on
                failed.append((r, str(exc)))
                continue
            decoded.append(self.detokenizer.delivered(r, n, audio, state))
        return decoded, failed
