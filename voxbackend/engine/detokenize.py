"""Cutting each request's codec frames into windows and decoding windows of many requests in one batch."""
from __future__ import annotations

import numpy as np

from voxbackend.models.base import SpeechModel, WindowJob, WindowSpec
from voxbackend.request import Request


def window_count(spec: WindowSpec, n_frames: int, lm_done: bool) -> int:
    """Windows that can be decoded now from n_frames frames."""
    full = 0 if n_frames < spec.first_frames else (n_frames - spec.first_frames) // spec.hop_frames + 1
    if lm_done and spec.flush_on_finish:
        covered = spec.first_frames + (full - 1) * spec.hop_frames if full else 0
        if n_frames > covered:
            return full + 1
    return full


def window_bounds(spec: WindowSpec, k: int, n_frames: int) -> tuple[int, int]:
    end = spec.first_frames + k * spec.hop_frames  # a flushed tail window is cut short, not shifted
    return max(0, end - spec.frames) if k else 0, min(end, n_frames)


def window_seed(request_seed: int, k: int) -> int:
    return (request_seed * 1_000_003 + k) & 0x7FFFFFFF


class Detokenizer:
    def __init__(self, model: SpeechModel):
        self.model = model
        self.spec = model.spec.window
        self.per_frame = model.spec.codes_per_frame

    def frames(self, r: Request) -> int:
        return len(r.codec.codes) // self.per_frame

    def ready(self, r: Request) -> int:
        if r.codec.in_flight:  # its windows are out at a codec stage (engine/remote_codec.py)
            return 0
        if self.spec.scheduled_by_model:
            return self.model.windows_ready(r.codec.state, r.codec.codes, r.lm_done)
        return window_count(self.spec, self.frames(r), r.lm_done) - r.codec.windows_done

    def finished(self, r: Request) -> bool:
        return r.lm_done and not r.codec.in_flight and self.ready(r) == 0

    def jobs(self, r: Request, n: int) -> list[WindowJob]:
        """The request's next n windows, in order; they share its codec state."""
        pf = self.per_frame
        n_frames = self.frames(r)
        first = r.codec.windows_done
        if self.spec.scheduled_by_model:  # the state knows its windows; it gets every frame so far
            frames = np.asarray(r.codec.codes[: n_frames * pf]).reshape(-1, pf)
            return [WindowJob(r.id, k, frames, window_seed(r.sampling.seed, k), False, r.codec.state)
                    for k in range(first, first + n)]
        total = window_count(self.spec, n_frames, r.lm_done)
        jobs = []
        for k in range(first, first + n):
            start, end = window_bounds(self.spec, k, n_frames)  # only the window's codes become an array
            frames = np.asarray(r.codec.codes[start * pf : end * pf]).reshape(-1, pf)
            jobs.append(WindowJob(r.id, k, frames, window_seed(r.sampling.seed, k), k == total - 1, r.codec.state))
        return jobs

    def delivered(self, r: Request, n: int, audio: list[np.ndarray], state) -> tuple[Request, np.ndarray]:
        """n decoded windows of r, with the codec state after them -> its audio chunk."""
        r.codec.state = state
        r.codec.windows_done += n
        return r, np.concatenate(audio).astype(np.float32, copy=False)

    def run(self, plan: list[tuple[Request, int]]) -> list[tuple[Request, np.ndarray]]:
        """Decode the planned windows (in order per request) in one batch; returns one audio chunk per request."""
        jobs = [self.jobs(r, n) for r, n in plan]
        audio = self.model.detokenize([job for group in jobs for job in group])
        out, at = [], 0
        for (r, n), group in zip(plan, jobs):
            out.append(self.delivered(r, n, audio[at : at + n], group[-1].state))
            at += n
        return out
