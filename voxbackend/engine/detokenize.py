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
        if self.spec.scheduled_by_model:
            return self.model.windows_ready(r.codec.state, r.codec.codes, r.lm_done)
        return window_count(self.spec, self.frames(r), r.lm_done) - r.codec.windows_done

    def finished(self, r: Request) -> bool:
        return r.lm_done and self.ready(r) == 0

    def run(self, plan: list[tuple[Request, int]]) -> list[tuple[Request, np.ndarray]]:
        """Decode the planned windows (in order per request); returns one audio chunk per request."""
        jobs: list[WindowJob] = []
        owners: list[Request] = []
        pf = self.per_frame
        for r, n in plan:
            n_frames = self.frames(r)
            if self.spec.scheduled_by_model:  # the state knows its windows; it gets every frame so far
                frames = np.asarray(r.codec.codes[: n_frames * pf]).reshape(-1, pf)
                for k in range(r.codec.windows_done, r.codec.windows_done + n):
                    jobs.append(WindowJob(r.id, k, frames, window_seed(r.sampling.seed, k), False, r.codec.state))
                    owners.append(r)
                continue
            total = window_count(self.spec, n_frames, r.lm_done)
            for k in range(r.codec.windows_done, r.codec.windows_done + n):
                start, end = window_bounds(self.spec, k, n_frames)  # only the window's codes become an array
                frames = np.asarray(r.codec.codes[start * pf : end * pf]).reshape(-1, pf)
                jobs.append(WindowJob(r.id, k, frames, window_seed(r.sampling.seed, k), k == total - 1,
                                      r.codec.state))
                owners.append(r)
        audio = self.model.detokenize(jobs)
        chunks: dict[str, list[np.ndarray]] = {}
        for r, job, wav in zip(owners, jobs, audio):
            chunks.setdefault(r.id, []).append(wav)
            r.codec.state = job.state
        out = []
        for r, n in plan:
            r.codec.windows_done += n
            out.append((r, np.concatenate(chunks[r.id]).astype(np.float32, copy=False)))
        return out
