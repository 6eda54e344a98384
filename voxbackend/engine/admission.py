"""KV pages for requests: admission, growth before each LM step, and preemption when the pool runs dry. The engine
owns the `waiting` queue and the `running` list; admission moves requests from one to the other."""
from __future__ import annotations

import logging
from collections import deque

from voxbackend.config import EngineConfig
from voxbackend.engine.kv_pool import KVPool
from voxbackend.engine.policies import Policy
from voxbackend.models.base import SpeechModel
from voxbackend.request import Request

log = logging.getLogger("voxbackend.engine")


class Admission:
    def __init__(self, pool: KVPool, policy: Policy, model: SpeechModel, config: EngineConfig,
                 waiting: deque[Request], running: list[Request]):
        self.pool = pool
        self.policy = policy
        self.model = model
        self.config = config
        self.waiting = waiting
        self.running = running
        self.preemptions = 0  # since the engine started: requests whose pages were taken back mid-generation

    def admit(self, now: float) -> None:
        """Give KV pages to waiting and preempted requests in the policy's order, until one does not fit (it
        and those behind it wait: a large request is not overtaken forever by small ones).

        A new request needs the pages of its first prefill chunk; a preempted one the pages of its whole
        sequence, since it must recompute all of it before it can sample again (a half-recomputed prefix taken
        back would be wasted work); a guided request needs them for both its rows. On top, one free page per
        request already on the LM: each grows by about a page per page_size steps, so a newcomer is not let into a
        pool that must preempt at the very next step.
        """
        queued = [r for r in self.running if r.lm.preempted] + list(self.waiting)
        for r in self.policy.admission_order(queued, now):
            first = r.num_positions if r.lm.preempted else min(len(r.prompt_ids), self.config.prefill_budget)
            need = self.pool.pages_for(first) * len(r.pool_keys)
            if need + self._headroom() > self.pool.free_pages and not self._make_room(r, need, now):
                return
            self._allocate(r, first)
            if r.lm.preempted:
                r.lm.preempted = False
            else:
                self.waiting.remove(r)
                r.codec.state = self.model.new_codec_state(r.conditioning)
                self.running.append(r)

    def _headroom(self) -> int:
        return sum(1 for r in self.running if r.on_lm)

    def _make_room(self, r: Request, need: int, now: float) -> bool:
        """A request the policy lets preempt (online: a stream whose listener waits, new or preempted and run
        dry) may take the pages of requests that can afford a pause: batch jobs and streams with more buffered
        audio than the pressing threshold. All or nothing: nobody is preempted if that would still not make
        room."""
        if not self.policy.may_preempt_for(r, now):
            return False
        victims = [v for v in self.running if v.on_lm and not self.policy.pressing(v, now)]
        # each victim frees its pages and lowers the headroom by one
        if self.pool.free_pages + sum(held_pages(v) + 1 for v in victims) < need + self._headroom():
            return False
        while need + self._headroom() > self.pool.free_pages:
            victim = preemption_victim(victims, now)
            victims.remove(victim)
            self.preempt(victim)
        return True

    def grow(self, plan: list[tuple[Request, int]], now: float) -> list[tuple[Request, int]]:
        """Before the LM step, each planned request gets the pages for the positions it writes, in plan order
        (the most pressing first). When the pool is dry, the request that can best afford a pause among all on
        the LM (possibly the one asking) is preempted. Returns the plan without the preempted."""
        for r, n in plan:
            # most steps need none; a guided request's rows grow together
            need = sum(self.pool.missing(key, r.lm.num_cached + n) for key in r.pool_keys)
            while not r.lm.preempted and need > self.pool.free_pages:
                self.preempt(preemption_victim([x for x in self.running if x.on_lm], now))
            if need and not r.lm.preempted:
                self._allocate(r, r.lm.num_cached + n)
        return [(r, n) for r, n in plan if not r.lm.preempted]

    def preempt(self, r: Request) -> None:
        """Take a request's pages back. It keeps its tokens, codes and codec state (ready windows still decode);
        on resume it recomputes prompt + generated steps, so its output is the same (sampling counters follow
        len(output_ids), not time)."""
        self.release(r)
        r.lm.num_cached = 0
        r.lm.preempted = True
        r.lm.preemptions += 1
        r.lm.skipped_steps = 0
        self.preemptions += 1
        log.info("preempted %s at %d positions (KV pool full)", r.id, r.num_positions)

    def release(self, r: Request) -> None:
        """The request's pages go back to the pool (harmless when it holds none)."""
        for key in r.pool_keys:
            self.pool.release(key)
        r.lm.pages = []
        if r.guide is not None:
            r.guide.pages = []

    def _allocate(self, r: Request, num_tokens: int) -> None:
        """Grow every LM row of the request to hold num_tokens positions."""
        r.lm.pages = self.pool.allocate(r.id, num_tokens)
        if r.guide is not None:
            r.guide.pages = self.pool.allocate(r.pool_keys[1], num_tokens)


def held_pages(r: Request) -> int:
    return len(r.lm.pages) + (len(r.guide.pages) if r.guide is not None else 0)


def preemption_victim(holders: list[Request], now: float) -> Request:
    """The request to lose its KV pages when the pool runs dry: the one that can best afford a pause.
    Non-streaming requests first (nobody is listening), then the stream whose listener has the most audio
    buffered; ties go to the latest arrival (the least work to redo)."""
    return max(holders, key=lambda r: (not r.streaming, r.lead_s(now) if r.streaming else 0.0, r.arrival))
