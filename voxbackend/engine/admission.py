"""KV pages for requests: admission, growth before each LM step, and preemption when the pool runs dry."""
from __future__ import annotations

from voxbackend.request import Request


def preemption_victim(holders: list[Request], now: float) -> Request:
    """The request to lose its KV pages when the pool runs dry: the one that can best afford a pause.
    Non-streaming requests first (nobody is listening), then the stream whose listener has the most audio
    buffered; ties go to the latest arrival (the least work to redo)."""
    return max(holders, key=lambda r: (not r.streaming, r.lead_s(now) if r.streaming else 0.0, r.arrival))
