"""offline: fills the LM batch in arrival order and detokenizes in bulk (a full batch of windows, or whatever is
left when the LM has nothing to do), for batch jobs where nobody listens live."""
from __future__ import annotations

from voxbackend.engine.policies.base import Plan, Policy, full_batches


class OfflinePolicy(Policy):
    def detok_plan(self, ready: Plan, lm_requests: int, now: float) -> Plan:
        return full_batches(ready, lm_requests, self.config.detok_batch)
