"""The engines' Prometheus gauges (voxbackend/triton/metrics.py), read from Triton's metrics port as JSON."""
from __future__ import annotations

import re
import urllib.request

GAUGES = {
    "voxbackend_active_streams": "active_streams",
    "voxbackend_queued_requests": "queued_requests",
    "voxbackend_kv_pages_used": "kv_pages_used",
    "voxbackend_kv_pages_total": "kv_pages_total",
    "voxbackend_engine_alive": "engine_alive",
}
_SAMPLE = re.compile(r'^(\w+)\{([^}]*)\}\s+(\S+)', re.MULTILINE)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> dict[str, dict]:
    """Engine model -> {gauge: value summed over its instances, "instances": n}; engine_alive is the minimum
    (one dead instance makes the model unhealthy)."""
    models: dict[str, dict] = {}
    instances: dict[str, set] = {}
    for name, labels, value in _SAMPLE.findall(text):
        if name not in GAUGES:
            continue
        tags = dict(_LABEL.findall(labels))
        model, key = tags.get("model", ""), GAUGES[name]
        entry = models.setdefault(model, {})
        instances.setdefault(model, set()).add(tags.get("instance", ""))
        number = float(value)
        entry[key] = min(entry.get(key, number), number) if key == "engine_alive" else entry.get(key, 0) + number
    for model, entry in models.items():
        entry["instances"] = len(instances[model])
        for key in GAUGES.values():
            if key in entry and key != "engine_alive":
                entry[key] = int(entry[key])
        if "engine_alive" in entry:
            entry["engine_alive"] = entry["engine_alive"] >= 1
    return models


def read(metrics_url: str, timeout: float = 3.0) -> dict[str, dict]:
    """Blocking: scrape and parse (raises OSError when the metrics port does not answer)."""
    with urllib.request.urlopen(metrics_url, timeout=timeout) as r:
        return parse(r.read().decode("utf-8", "replace"))
