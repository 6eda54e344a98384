"""CosyVoice2's text input streaming: upstream `Qwen2LM.inference_bistream` as per-request state the engine drives.

Upstream pulls text pieces from a generator and feeds the LM:
- `[sos]`, then the text (prompt transcript first) and the prompt speech tokens interleaved 5 : 15, as far as the
  text allows; speech generation starts once the prompt speech is all in (without prompt speech: once 5 text
  tokens are in);
- the LM emits a fill token when it wants more text (it is never fed); then the next piece is pulled and 5 more
  text tokens are fed, or, with fewer than 5 buffered, more pieces are pulled first. From the first fill on, the
  fill is forced 15 speech tokens after the previous one. The end id is excluded until the text ends;
- when the text has ended: the input that produced the last fill again (upstream's `lm_input` still holds it),
  the remaining text and the task id, then generation runs to the end id.
One piece is pulled per fill, whatever has arrived meanwhile, so the positions depend only on the pieces, not on
when they arrive. A piece here is what one `Engine.append_text` call brings (the first is the prompt's text).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MIX_TEXT, MIX_SPEECH = 5, 15  # upstream's mix_ratio


@dataclass
class BistreamTrack:
    text: deque[int]  # text ids not fed yet (upstream's text_cache)
    speech: deque[int]  # prompt speech (engine ids) not interleaved yet
    open: bool  # more pieces may come
    need_text: bool  # the next forward needs 5 text tokens first (after a fill; at a start without prompt speech)
    pieces: deque[list[int]] = field(default_factory=deque)  # arrived, not pulled yet
    text_ids: int = 0  # text ids received in all (the limit's count)
    pending: list[int] = field(default_factory=list)  # positions built, not handed to the engine yet
    prefilled: list[int] = field(default_factory=list)  # prompt positions upstream would feed with the first forward
    last_fed: list[int] = field(default_factory=list)  # the last forward's input (upstream's lm_input after it)
    decoding: bool = False  # a forward has happened
    final: bool = False  # the text has ended and the task id is in: generation runs to the end id
    waiting: bool = False  # the text loop waits for a piece: the next next_inputs call resumes it
    steps: int = 0  # steps generated and fed (fills included: upstream's len(out_tokens))
    next_fill: int = -1  # the step forced to be the fill token (-1: before the first fill)


@dataclass(frozen=True)
class Bistream:
    """The rules, in engine ids."""

    sos: int
    task: int
    fill: int

    def start(self, text: list[int], speech: list[int], open: bool) -> tuple[list[int], BistreamTrack]:
        """The prompt's text (transcript + first piece) and prompt speech -> (positions to prefill, track)."""
        track = BistreamTrack(deque(text), deque(speech), open, need_text=not speech, text_ids=len(text))
        rows = self._after_pull(track)
        if rows is not None:  # the first forward can run at once: the whole prompt is its input
            positions = [self.sos, *rows]
            track.last_fed, track.decoding = positions, True
            return positions, track
        positions = [self.sos, *track.pending]  # fed when the first forward runs: the same positions
        track.prefilled, track.pending, track.waiting = positions, [], True
        return positions, track

    def extend(self, track: BistreamTrack, ids: list[int], final: bool) -> None:
        track.pieces.append(list(ids))
        track.text_ids += len(ids)
        track.open = not final

    def next_inputs(self, step: int | None, track: BistreamTrack) -> list[int] | None:
        if track.waiting:  # the same step again, after more text came: resume the text loop
            return self._advance(track)
        track.steps += 1
        if track.final or step != self.fill:
            track.last_fed = [step]
            return [step]
        track.next_fill = track.steps - 1 + MIX_SPEECH + 1
        track.need_text = True
        return self._advance(track)

    def forced_fill(self, track: BistreamTrack) -> bool:
        return not track.final and track.next_fill == track.steps

    # ---------------------------------------------------------------- upstream's text loop
    def _advance(self, track: BistreamTrack) -> list[int] | None:
        """Pull pieces until a forward can run: its new positions; None: wait for a piece."""
        while True:
            if track.pieces:
                track.text.extend(track.pieces.popleft())
            elif track.open:
                track.waiting = True
                return None
            else:
                return self._final(track)
            rows = self._after_pull(track)
            if rows is not None:
                return rows

    def _after_pull(self, track: BistreamTrack) -> list[int] | None:
        while track.speech and len(track.text) >= MIX_TEXT:
            track.pending += _take(track.text, MIX_TEXT) + _take(track.speech, MIX_SPEECH)
        if track.speech:
            return None
        if track.need_text:
            if len(track.text) < MIX_TEXT:
                return None
            track.pending += _take(track.text, MIX_TEXT)
            track.need_text = False
        return self._forward(track, track.pending)

    def _final(self, track: BistreamTrack) -> list[int]:
        # upstream: concat([lm_input, text_cache, task_id]); after a forward its lm_input is the one fed last
        # (left prompt speech is dropped, as upstream does)
        rows = (track.last_fed if track.decoding else []) + track.pending + list(track.text) + [self.task]
        track.text.clear()
        track.final = True
        return self._forward(track, rows)

    def _forward(self, track: BistreamTrack, rows: list[int]) -> list[int]:
        track.last_fed = track.prefilled + rows if not track.decoding else rows
        track.pending, track.prefilled = [], []
        track.decoding, track.waiting = True, False
        return rows


def _take(queue: deque[int], n: int) -> list[int]:
    return [queue.popleft() for _ in range(min(n, len(queue)))]
