"""One request's state inside the engine: tokens, sampling, KV pages, codec cursor and playback clock."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

from voxbackend.events import Event
from voxbackend.sampling_params import SamplingParams


class Status(Enum):
    WAITING = "waiting"  # queued, no KV pages yet
    RUNNING = "running"  # holds KV pages; prefilling or decoding
    DETOKENIZING = "detokenizing"  # LM done, pages freed, windows still to decode
    DONE = "done"


@dataclass
class Request:
    id: str
    prompt_ids: list[int] | list[list[int]]  # ids, or rows of token_columns ids (-1: no entry)
    sampling: SamplingParams
    on_event: Callable[[Event], None]
    arrival: float
    streaming: bool = True  # False: a batch job with no listener; never "pressing" by playback
    status: Status = Status.WAITING
    output_ids: list = field(default_factory=list)  # generated steps: ids, or rows for token_columns > 1
    num_cached: int = 0  # positions whose keys/values are in the KV pool
    pages: list[int] = field(default_factory=list)
    # codec side
    codes: list[int] = field(default_factory=list)
    windows_done: int = 0
    codec_state: Any = None
    held_audio: list[Any] = field(default_factory=list)  # decoded audio held back until the first chunk is long enough
    # playback clock (engine time): the listener starts playing when the first chunk is sent
    chunks_sent: int = 0
    first_chunk_at: float | None = None
    audio_sent_s: float = 0.0
    last_chunk_s: float = 0.0
    skipped_steps: int = 0  # consecutive steps passed over by the scheduler (ageing prevents starvation)
    finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefilling(self) -> bool:
        return self.num_cached < len(self.prompt_ids)

    @property
    def lm_done(self) -> bool:
        return self.finish_reason is not None

    def buffer_s(self, now: float) -> float:
        """Audio the listener still has queued (negative: it has been stalling)."""
        if self.first_chunk_at is None:
            return 0.0
        return self.audio_sent_s - (now - self.first_chunk_at)

    def pressing(self, now: float, margin_s: float) -> bool:
        """Close to running out of audio: nothing sent yet, or the buffer is below the last chunk plus a margin."""
        if not self.streaming:
            return False
        if self.first_chunk_at is None:
            return True
        return self.buffer_s(now) < self.last_chunk_s + margin_s
