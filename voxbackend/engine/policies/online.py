"""online (the default): streaming-aware. A request is pressing when its listener is close to running out of audio
(docs/scheduling.md). Pressing requests get LM slots and KV pages first, and may take the pages of requests that
can afford a pause. The detokenizer runs only when a listener needs audio soon or a full batch is ready, and then
also fills its leftover slots with other requests' windows. With a pace floor (detok_pace_floor; on a CPU by
default), once the machine is near its limit (streams made barely faster than they play) it serves the LM in
arrival order and decodes only full batches, as offline does."""
from __future__ import annotations

import math
from dataclasses import dataclass

from voxbackend.config import EngineConfig
from voxbackend.engine.policies.base import MAX_SKIPPED_STEPS, Plan, Policy, full_batches, take
from voxbackend.request import Request

RATE_WINDOW_S = 1.0  # the rate windows become ready at is averaged over about this long
IDLE_GAP_S = 0.5  # no decision for this long: the engine was idle, and the rate starts over
FULL_BATCH_WITHIN_S = 0.3  # "near the limit" also needs a full codec batch to form this fast


class OnlinePolicy(Policy):
    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.window_rate = WindowRate()
        self.slow_pace = False  # the detokenizer's last reading of the streams' pace
        self.near_limit = False  # its last verdict; the LM order follows it

    def _urgent(self, r: Request, now: float) -> bool:
        return self.pressing(r, now) or r.lm.skipped_steps >= MAX_SKIPPED_STEPS

    def lm_order(self, lm_reqs: list[Request], now: float) -> list[Request]:
        # near its limit online serves in arrival order too: when not every stream can keep playing, the oldest
        # ones finishing beats spreading the shortfall over all of them
        if self.near_limit:
            return super().lm_order(lm_reqs, now)

        def key(r: Request):
            if r.playback.first_chunk_at is None and r.streaming:  # nothing played yet: time to first audio counts
                return (1, r.arrival)
            urgent = self._urgent(r, now)
            return (0 if urgent else 2, r.lead_s(now))

        # streams about to stall first, then those still waiting for their first audio, then the rest
        return sorted(lm_reqs, key=key)

    def admission_order(self, waiting: list[Request], now: float) -> list[Request]:
        """Streams whose listener is waiting or about to run dry (new streams, preempted ones with a drained
        buffer) ahead of the rest; arrival order within each group."""
        return sorted(waiting, key=lambda r: (not self.pressing(r, now), r.arrival))

    def may_preempt_for(self, r: Request, now: float) -> bool:
        """A stream whose listener waits (a new one, or a preempted one that ran dry)."""
        return r.streaming and self.pressing(r, now)

    def detok_plan(self, ready: Plan, lm_requests: int, now: float) -> Plan:
        total = sum(n for _, n in ready)
        self.window_rate.observe(now, total)
        plan = self._detok_plan(ready, total, lm_requests, now) if ready else []
        self.window_rate.left(total - sum(n for _, n in plan))
        return plan

    def _detok_plan(self, ready: Plan, total: int, lm_requests: int, now: float) -> Plan:
        cap = self.config.detok_batch
        if lm_requests and self._near_limit(ready, lm_requests, now):
            # near the limit the LM's time is what keeps streams playing; arrival order keeps the oldest ones
            # playing when not all can
            return full_batches(ready, lm_requests, cap)
        # Otherwise decode for a listener only when it needs audio soon: its first chunk, or a buffer below
        # detok_margin_s. Until then its windows pile up, so the codec runs less often on bigger batches (its
        # fixed cost per call is what tipped streams into stalling near the knee with the LM's 1 s margin).
        is_urgent = [self._detok_urgent(r, now) for r, _ in ready]
        urgent = [x for x, u in zip(ready, is_urgent) if u]
        if not urgent and lm_requests and total < cap:
            return []
        others = sorted([x for x, u in zip(ready, is_urgent) if not u], key=lambda x: x[0].playback.buffer_s(now))
        urgent.sort(key=lambda x: (x[0].playback.first_chunk_at is not None, x[0].playback.buffer_s(now)))
        plan = _split(urgent, cap)
        return plan + take(others, cap - sum(n for _, n in plan))

    def _detok_urgent(self, r: Request, now: float) -> bool:
        """A listener needs audio soon (batch jobs never do: they ride along, or run when the LM is idle)."""
        p = r.playback
        return r.streaming and (p.first_chunk_at is None or p.buffer_s(now) < self.config.detok_margin_s)

    def _near_limit(self, ready: Plan, lm_requests: int, now: float) -> bool:
        """The machine is near its limit: the streams are made barely faster than they play (their average pace
        is below detok_pace_floor; when no ready stream has played long enough to tell, the last reading stands
        while other streams are on the LM) and windows come fast enough that a full codec batch forms within
        FULL_BATCH_WITHIN_S (waiting for one costs listeners little; a device that is slow even with few streams
        keeps the rules for headroom)."""
        paces = [p for r, _ in ready if (p := r.pace(now)) is not None]
        if paces:
            self.slow_pace = sum(paces) / len(paces) < self.config.pace_floor
        elif lm_requests <= len(ready):
            # only streams too young to tell are running: the streams that gave the last reading have ended, and
            # a lone new stream must not wait for a full batch on their account
            self.slow_pace = False
        batch_s = self.window_rate.seconds_for(self.config.detok_batch)
        self.near_limit = self.slow_pace and batch_s <= FULL_BATCH_WITHIN_S
        return self.near_limit


@dataclass
class WindowRate:
    """Codec windows becoming ready per second, averaged over about RATE_WINDOW_S: how much the ready count grew
    between the detokenizer's decisions (windows of requests that ended in between are not seen as growth)."""

    per_s: float = 0.0
    at: float | None = None
    pending: int = 0  # windows left ready after the last decision

    def observe(self, now: float, ready: int) -> None:
        if self.at is None or now - self.at > IDLE_GAP_S:
            self.per_s = 0.0  # after an idle engine: unknown, which reads as low load
        elif now > self.at:
            dt = now - self.at
            self.per_s += min(1.0, dt / RATE_WINDOW_S) * (max(0, ready - self.pending) / dt - self.per_s)
        self.at, self.pending = now, ready

    def left(self, windows: int) -> None:
        self.pending = windows

    def seconds_for(self, windows: int) -> float:
        """How long `windows` more windows take to become ready at the recent rate (inf: none are coming)."""
        if windows <= 0:
            return 0.0
        return windows / self.per_s if self.per_s > 0 else math.inf


def _split(items: Plan, cap: int) -> Plan:
    """Every urgent request gets all its ready windows; over budget, each gets a proportional share (>= 1
    for the most urgent ones that fit)."""
    total = sum(n for _, n in items)
    if total <= cap:
        return list(items)
    plan = []
    for r, n in items:
        share = max(1, n * cap // total)
        share = min(share, cap - sum(k for _, k in plan))
        if share <= 0:
            break
        plan.append((r, share))
    return plan
