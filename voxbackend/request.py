"""One request's state inside the engine. What was submitted is on the Request itself; what changes as it runs is
grouped by the part of the engine that owns it: the sequence on the LM (LMState), its row of the repetition
penalty table (PenaltyState), its codec cursor (CodecState) and its listener's player (Playback)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from voxbackend.events import Event
from voxbackend.sampling_params import SamplingParams

PACE_AFTER_S = 0.5  # a stream's pace is measured once it has played this long (before, one chunk decides it)


@dataclass(slots=True)
class LMState:
    """The sequence on the LM: the engine, admission, the policies and the model runner."""

    track: Any = None  # the model's per-request input state (dual-track text), from split_prompt
    output_ids: list = field(default_factory=list)  # generated steps: ids, or rows for token_columns > 1
    # the positions after the prompt: what followed each generated step (the model's next_inputs, one or more
    # per step; a preempted request recomputes exactly these); while the model waits for more input
    # (awaiting_input) the last step's are not in yet, or, for a track that waits at submission, none are
    input_rows: list = field(default_factory=list)
    awaiting_input: bool = False
    num_cached: int = 0  # positions whose keys/values are in the KV pool
    pages: list[int] = field(default_factory=list)  # grows with the sequence, page by page
    preempted: bool = False  # pages taken back mid-generation; resumes by recomputing its whole sequence
    preemptions: int = 0
    skipped_steps: int = 0  # consecutive steps passed over by the policy (ageing prevents starvation)
    finish_reason: str | None = None  # set when the LM is done with it ("stop", "length")
    text_ids: list[int] = field(default_factory=list)  # text_output models: the reply's text ids so far
    # text_ids[:text_read] are sent; text_ids[text_prefix:text_read], decoded again with the new ids, give the new
    # characters their context (a tokenizer may decode an id differently at the start of a piece)
    text_prefix: int = 0
    text_read: int = 0


@dataclass(slots=True)
class GuideRow:
    """The unconditioned LM row of a request sampled with classifier-free guidance: its own prompt (same length and
    positions) and KV pages. It is fed the request's generated inputs and is admitted, grown, preempted and released
    with it; the sampled step comes from both rows' logits."""

    prompt_ids: list
    features: Any = None  # [N, hidden] on the device: its FEATURE rows' vectors, at the request's feature_positions
    pages: list[int] = field(default_factory=list)

    def positions(self, r: "Request", start: int, end: int) -> list:
        prompt = len(self.prompt_ids)
        return self.prompt_ids[start:end] + r.lm.input_rows[max(0, start - prompt) : max(0, end - prompt)]

    def position(self, r: "Request", i: int):
        prompt = len(self.prompt_ids)
        return self.prompt_ids[i] if i < prompt else r.lm.input_rows[i - prompt]


@dataclass(slots=True)
class PenaltyState:
    """The model runner's row of penalized ids (engine/penalties.py), while the request samples with a penalty."""

    slot: int | None = None
    length: int = 0  # entries written in that row


@dataclass(slots=True)
class CodecState:
    """The detokenizer's cursor: codes from the LM, windows decoded, and the codec's own state."""

    codes: list[int] = field(default_factory=list)
    windows_done: int = 0
    state: Any = None
    ready_windows: int = 0  # windows decodable now but not decoded yet (the engine sets it every step)
    in_flight: bool = False  # windows are out at a codec stage (engine/remote_codec.py); state comes back with them


@dataclass(slots=True)
class Playback:
    """The listener's player, in engine time: it starts when the first chunk is sent, pauses when it runs dry and
    resumes with the next chunk."""

    held_audio: list[Any] = field(default_factory=list)  # decoded audio held back until the first chunk is long enough
    chunks_sent: int = 0
    first_chunk_at: float | None = None
    first_chunk_len_s: float = 0.0
    audio_sent_s: float = 0.0
    last_chunk_s: float = 0.0
    queued_s: float = 0.0  # audio the player had queued right after the last chunk arrived
    last_chunk_at: float = 0.0

    def record_chunk(self, now: float, seconds: float) -> None:
        """A chunk of `seconds` of audio was sent at `now`. A player that ran dry waited for it and plays it from
        now, so a stream that stalled once is not counted behind forever (which made it look urgent every step)."""
        if self.first_chunk_at is None:
            self.first_chunk_at, self.first_chunk_len_s = now, seconds
        self.queued_s = max(0.0, self.buffer_s(now)) + seconds
        self.last_chunk_at = now
        self.audio_sent_s += seconds
        self.last_chunk_s = seconds

    def buffer_s(self, now: float) -> float:
        """Audio the listener still has queued (negative: its player has been waiting that long)."""
        if self.first_chunk_at is None:
            return 0.0
        return self.queued_s - (now - self.last_chunk_at)


@dataclass(slots=True)
class Request:
    id: str
    prompt_ids: list[int] | list[list[int]]  # ids, or rows of token_columns ids (-1: no entry)
    sampling: SamplingParams
    on_event: Callable[[Event], None]
    arrival: float
    streaming: bool = True  # False: a batch job with no listener; never "pressing" by playback
    conditioning: dict[str, Any] = field(default_factory=dict)  # the Prompt's arrays, for new_codec_state
    # the prompt positions that are FEATURE rows (ascending) and their vectors [N, hidden], on the device
    feature_positions: list[int] = field(default_factory=list)
    features: Any = None
    guide: GuideRow | None = None  # sampling.cfg_weight > 0 on a model with guidance
    lm: LMState = field(default_factory=LMState)
    penalty: PenaltyState = field(default_factory=PenaltyState)
    codec: CodecState = field(default_factory=CodecState)
    playback: Playback = field(default_factory=Playback)

    @property
    def num_positions(self) -> int:
        """The sequence so far: prompt and the inputs of generated steps (the last one's keys/values are not cached
        yet)."""
        return len(self.prompt_ids) + len(self.lm.input_rows)

    @property
    def pool_keys(self) -> tuple[str, ...]:
        """Its page tables in the KV pool: one per LM row."""
        return (self.id,) if self.guide is None else (self.id, self.id + "/uncond")

    @property
    def uncached(self) -> int:
        """Positions still to run through the LM before the next step can be sampled (1 while decoding)."""
        return self.num_positions - self.lm.num_cached

    def positions(self, start: int, end: int) -> list:
        """Inputs of positions [start, end): prompt entries, then the inputs of generated steps (a resumed
        request's prefix)."""
        prompt = len(self.prompt_ids)
        return self.prompt_ids[start:end] + self.lm.input_rows[max(0, start - prompt) : max(0, end - prompt)]

    def position(self, i: int):
        """The input of position i (positions(i, i + 1)[0])."""
        prompt = len(self.prompt_ids)
        return self.prompt_ids[i] if i < prompt else self.lm.input_rows[i - prompt]

    @property
    def on_lm(self) -> bool:
        """Holds KV pages and still generates (neither finished on the LM nor preempted)."""
        return not self.lm_done and not self.lm.preempted

    @property
    def wants_lm(self) -> bool:
        """On the LM with positions to run (not waiting for input it does not have yet)."""
        return self.on_lm and self.uncached > 0

    @property
    def lm_done(self) -> bool:
        return self.lm.finish_reason is not None

    def ready_audio_s(self) -> float:
        """Audio of the ready windows (one codec call away), at the average length of the windows sent so far."""
        done = self.codec.windows_done
        return self.codec.ready_windows * self.playback.audio_sent_s / done if done else 0.0

    def lead_s(self, now: float) -> float:
        """How far the stream is ahead of its listener: the buffer plus the audio of its ready windows."""
        return self.playback.buffer_s(now) + self.ready_audio_s()

    def pace(self, now: float) -> float | None:
        """Audio made per second since the first chunk was sent (x real time; ready windows count), or None
        before it has played PACE_AFTER_S (the first chunk's own audio is left out: it was made before)."""
        p = self.playback
        if p.first_chunk_at is None or now - p.first_chunk_at < PACE_AFTER_S:
            return None
        return (p.audio_sent_s - p.first_chunk_len_s + self.ready_audio_s()) / (now - p.first_chunk_at)

    def pressing(self, now: float, margin_s: float) -> bool:
        """Close to running out of audio: nothing sent yet, or its lead is below the last chunk plus a margin.
        The lead counts ready windows: a stream whose codec windows wait for a bigger batch is not short of
        audio, so the LM, admission and preemption do not treat it as if it were."""
        if not self.streaming:
            return False
        if self.playback.first_chunk_at is None:
            return True
        return self.lead_s(now) < self.playback.last_chunk_s + margin_s
