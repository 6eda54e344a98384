"""Custom Prometheus metrics of an engine model, on Triton's metrics port next to its own.

The MetricFamily objects are kept on this object for the model's lifetime: a collected family makes every
later update fail with "MetricFamily has been deleted" (seen with Triton 2.51, docs/triton.md).
"""
from __future__ import annotations

TTFA_BUCKETS = [0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0]
FINISH_REASONS = ("stop", "length", "cancelled", "shutdown", "error")


class TritonMetrics:
    """Implements streams.Metrics with pb_utils.MetricFamily.

    Labels: model and instance (each instance has its own engine), plus reason on finished streams.
    """

    def __init__(self, pb_utils, model: str, instance: str):
        fam = pb_utils.MetricFamily
        labels = {"model": model, "instance": instance}
        self.families = [  # keep alive (see module doc)
            fam("voxbackend_ttfa_seconds", "Time to first audio: request reaching the engine model to its "
                "first chunk sent", fam.HISTOGRAM),
            fam("voxbackend_late_chunks_total", "Chunks sent after the listener's buffer ran dry "
                "(docs/metrics.md, measured at the server)", fam.COUNTER),
            fam("voxbackend_requests_finished_total", "Finished streams by finish reason", fam.COUNTER),
            fam("voxbackend_active_streams", "Streams open in this model (running or queued)", fam.GAUGE),
            fam("voxbackend_queued_requests", "Requests waiting for admission (KV pages or batch slots)", fam.GAUGE),
            fam("voxbackend_kv_pages_used", "KV cache pages in use", fam.GAUGE),
            fam("voxbackend_kv_pages_total", "KV cache pages in the pool", fam.GAUGE),
            # Triton 2.51 lets no Python model mark itself unready: alert or probe on this instead
            fam("voxbackend_engine_alive", "1 while the engine loop runs, 0 once it died", fam.GAUGE),
            fam("voxbackend_preemptions_total", "Requests whose KV pages were taken back mid-generation (the pool "
                "ran dry); each resumes later with the same output", fam.COUNTER),
        ]
        ttfa, late, finished, active, queued, kv_used, kv_total, alive, preempted = self.families
        self._ttfa = ttfa.Metric(labels=labels, buckets=TTFA_BUCKETS)
        self._late = late.Metric(labels=labels)
        self._finished = {r: finished.Metric(labels={**labels, "reason": r}) for r in FINISH_REASONS}
        self._active = active.Metric(labels=labels)
        self._queued = queued.Metric(labels=labels)
        self._kv_used = kv_used.Metric(labels=labels)
        self._kv_total = kv_total.Metric(labels=labels)
        self._alive = alive.Metric(labels=labels)
        self._alive.set(1)
        self._preemptions = preempted.Metric(labels=labels)
        self._preemptions_seen = 0

    def first_audio(self, seconds: float) -> None:
        self._ttfa.observe(seconds)

    def late_chunk(self) -> None:
        self._late.increment(1)

    def finished(self, reason: str) -> None:
        self._finished.get(reason, self._finished["error"]).increment(1)

    def gauges(self, active: int, queued: int, kv_used: int, kv_total: int, alive: bool = True) -> None:
        self._alive.set(1 if alive else 0)
        self._active.set(active)
        self._queued.set(queued)
        self._kv_used.set(kv_used)
        self._kv_total.set(kv_total)

    def preemptions(self, total: int) -> None:
        """The engine's cumulative count; the counter advances by what is new since the last reading."""
        if total > self._preemptions_seen:
            self._preemptions.increment(total - self._preemptions_seen)
            self._preemptions_seen = total
