"""What every scheduling policy shares: chunked prefill under a token budget with several prefills per step,
ageing of requests passed over too often, arrival order for KV admission, one window per request per call for a
stateful codec. A policy decides, one engine step at a time, which requests run on the LM and which codec windows
go to the detokenizer; the clock is a parameter (tests use a fake one)."""
from __future__ import annotations

from voxbackend.config import EngineConfig
from voxbackend.request import Request

MAX_SKIPPED_STEPS = 8  # a request passed over this many steps in a row is treated as pressing

Plan = list[tuple[Request, int]]  # (request, positions on the LM or windows to decode)


class Policy:
    def __init__(self, config: EngineConfig):
        self.config = config

    # ---------------------------------------------------------------- the LM
    def lm_order(self, lm_reqs: list[Request], now: float) -> list[Request]:
        """Who gets LM slots first."""
        return sorted(lm_reqs, key=lambda r: r.arrival)

    def schedule_lm(self, running: list[Request], now: float) -> Plan:
        budget = self.config.prefill_budget
        plan: Plan = []
        candidates = [r for r in running if r.wants_lm]
        for r in self.lm_order(candidates, now):
            if len(plan) >= self.config.max_batch or budget <= 0:
                break
            n = min(r.uncached, budget)  # a prompt (or a resumed prefix) in chunks; 1 while decoding
            plan.append((r, n))
            budget -= n
        chosen = {id(r) for r, _ in plan}
        for r in candidates:
            r.lm.skipped_steps = 0 if id(r) in chosen else r.lm.skipped_steps + 1
        return plan

    # ---------------------------------------------------------------- KV pages
    def admission_order(self, waiting: list[Request], now: float) -> list[Request]:
        """Who gets KV pages first (a preempted request keeps its arrival, so it comes back before later ones)."""
        return sorted(waiting, key=lambda r: r.arrival)

    def pressing(self, r: Request, now: float) -> bool:
        return r.pressing(now, self.config.playback_margin_s)

    def may_preempt_for(self, r: Request, now: float) -> bool:
        """Whether waiting request r may take the pages of requests that can afford a pause (engine/admission)."""
        return False

    # ---------------------------------------------------------------- the detokenizer
    def schedule_detok(self, ready: Plan, lm_requests: int, now: float, stateful: bool) -> Plan:
        """ready: (request, windows ready) for requests with at least one; lm_requests: requests on the LM (0:
        it is idle). Returns windows to decode now."""
        if stateful:  # a stateful codec decodes one window per request per call, in order
            ready = [(r, 1) for r, _ in ready]
        return self.detok_plan(ready, lm_requests, now)

    def detok_plan(self, ready: Plan, lm_requests: int, now: float) -> Plan:
        raise NotImplementedError


def by_arrival(items: Plan) -> Plan:
    return sorted(items, key=lambda x: x[0].arrival)


def take(items: Plan, cap: int) -> Plan:
    plan = []
    for r, n in items:
        if cap <= 0:
            break
        plan.append((r, min(n, cap)))
        cap -= plan[-1][1]
    return plan


def full_batches(ready: Plan, lm_requests: int, cap: int) -> Plan:
    """Decode only a full batch of windows, or whatever is ready when the LM is idle, oldest requests first:
    every codec call's fixed cost comes out of the LM's time (on a CPU one window alone costs 2.7x a window in a
    batch of 16)."""
    total = sum(n for _, n in ready)
    return [] if lm_requests and total < cap else take(by_arrival(ready), cap)
