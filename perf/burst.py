"""One closed burst through an in-process engine (the model benches: csm, qwen3_tts, cosyvoice2): every request
is submitted at once and the engine thread's events record, per request, when its first and last audio arrived,
how many samples it got and its final event."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class BurstRequest:
    ttfa: float  # submit of the burst to the first audio (0 when there was none)
    service: float  # to the last audio
    samples: int
    final: Any  # the request's final Event (token_ids, finish_reason)


def run_burst(engine, submissions: list[tuple[Any, Any]],
              timeout_s: float = 3600.0) -> tuple[float, list[BurstRequest]]:
    """(prompt, sampling) pairs submitted together -> (wall to the last final event, one record per submission)."""
    from voxbackend import EventKind

    first: dict[str, float] = {}
    last: dict[str, float] = {}
    samples: dict[str, int] = {}
    finals: dict[str, Any] = {}
    done = threading.Event()
    lock = threading.Lock()

    def on_event(e) -> None:  # engine thread: bookkeeping only
        now = time.perf_counter()
        with lock:
            if e.kind is EventKind.AUDIO:
                first.setdefault(e.request_id, now)
                last[e.request_id] = now
                samples[e.request_id] = samples.get(e.request_id, 0) + len(e.audio)
            if e.final:
                finals[e.request_id] = e
                if len(finals) == len(submissions):
                    done.set()

    t0 = time.perf_counter()
    ids = [engine.submit(prompt, sampling, on_event) for prompt, sampling in submissions]
    if not done.wait(timeout_s):
        raise RuntimeError(f"the engine burst did not finish within {timeout_s:.0f} s")
    wall = time.perf_counter() - t0
    return wall, [BurstRequest(first.get(i, t0) - t0, last.get(i, t0) - t0, samples.get(i, 0), finals[i]) for i in ids]
