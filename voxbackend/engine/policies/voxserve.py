"""VoxServe's published online policy, for ablation only (`policy="voxserve"`).

It reproduces the scheduling rules of VoxServe's OnlineScheduler (arXiv 2602.00269 and its public code) on our
engine, faults included, so that our streaming-aware policy is measured against the original rather than a
straw man. Differences from our `online` policy (docs/scheduling.md has the table):

- LM: at most one prefill per step, the whole prompt at once (no chunking); while a prefill runs the LM batch
  is capped at PREFILL_BATCH (VoxServe's prefill CUDA-graph batch size). Then pressing decodes, then the
  others, both in arrival order (ours: most urgent first by buffer, several chunked prefills per step under a
  token budget, batch never capped by a prefill). No ageing: a request can be passed over indefinitely.
- Detokenizer: runs only when a pressing request has a window ready, so non-streaming requests (never
  pressing) are decoded only when a streaming request happens to be pressing at the same time: alone they
  never finish (ours decodes them when the LM is idle). Its window budget is the LM batch size. Pressing
  requests share it proportionally (at least one window each, then trimmed), in arrival order.

"Pressing" is the same rule in both: nothing sent yet, or buffered audio <= the last chunk + the margin.
One fault is not reproduced: VoxServe decodes several windows of one request from the same stale codec state;
our engine always hands a stateful codec one window per request per call, because the other way corrupts audio.
"""
from __future__ import annotations

from voxbackend.engine.policies.base import Plan, Policy
from voxbackend.request import Request

PREFILL_BATCH = 8  # VoxServe's prefill_graph_batch_size: the LM batch cap while a prefill is in the step


class VoxServePolicy(Policy):
    def _pressing(self, r: Request, now: float) -> bool:
        """VoxServe's rule: from the chunks sent alone (nothing sent yet, or buffer <= last chunk + margin), with
        its playback clock: the first chunk's send time plus all audio sent, a player that never pauses (ours
        resumes after running dry: Playback.buffer_s)."""
        p = r.playback
        if not r.streaming:
            return False
        if p.first_chunk_at is None:
            return True
        return p.audio_sent_s - (now - p.first_chunk_at) <= p.last_chunk_s + self.config.playback_margin_s

    def schedule_lm(self, running: list[Request], now: float) -> Plan:
        active = sorted((r for r in running if r.wants_lm), key=lambda r: r.arrival)
        prefills = [r for r in active if r.uncached > 1 or r.lm.num_cached == 0]  # a prompt, or a resumed prefix
        decodes = [r for r in active if r not in prefills]
        plan: Plan = []
        cap = self.config.max_batch
        if prefills:
            plan.append((prefills[0], prefills[0].uncached))
            cap = min(cap, PREFILL_BATCH)
        pressing = [r for r in decodes if self._pressing(r, now)]
        others = [r for r in decodes if not self._pressing(r, now)]
        for r in pressing + others:
            if len(plan) >= cap:
                break
            plan.append((r, 1))
        return plan

    def detok_plan(self, ready: Plan, lm_requests: int, now: float) -> Plan:
        ready = sorted(ready, key=lambda x: x[0].arrival)
        pressing = [(r, n) for r, n in ready if self._pressing(r, now)]
        if not pressing:
            return []
        cap = self.config.max_batch
        shares = _proportional([n for _, n in pressing], cap)
        plan = [(r, k) for (r, _), k in zip(pressing, shares) if k > 0]
        left = cap - sum(k for _, k in plan)
        for r, n in ready:
            if left <= 0:
                break
            if not self._pressing(r, now):
                plan.append((r, min(n, left)))
                left -= plan[-1][1]
        return plan


def _proportional(counts: list[int], cap: int) -> list[int]:
    """VoxServe's split: everything when it fits; else max(1, count * cap // total) each, then one window is
    taken back from the first entries above 1 until the sum fits. When every share is 1 and they still exceed
    the cap, VoxServe's loop never ends; it cannot happen there (its active requests never outnumber its batch)
    but can here (admission is bounded by KV pages, not the batch), so the shares are left over the cap."""
    total = sum(counts)
    if total <= cap:
        return list(counts)
    shares = [max(1, c * cap // total) for c in counts]
    while sum(shares) > cap and any(s > 1 for s in shares):
        for i, s in enumerate(shares):
            if s > 1:
                shares[i] -= 1
                if sum(shares) <= cap:
                    break
    return shares
