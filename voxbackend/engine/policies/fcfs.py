"""fcfs: continuous batching in arrival order; every ready window is decoded at once."""
from __future__ import annotations

from voxbackend.engine.policies.base import Plan, Policy, by_arrival, take


class FcfsPolicy(Policy):
    def detok_plan(self, ready: Plan, lm_requests: int, now: float) -> Plan:
        return take(by_arrival(ready), self.config.detok_batch)
