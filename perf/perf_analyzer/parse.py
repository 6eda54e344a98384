"""perf_analyzer CSV (+ optional --profile-export-file JSON) -> Markdown table and PNG plot.

Why the profile export: perf_analyzer 2.51 prints "using the first response for measuring latency" for
decoupled models, but its CSV/summary latencies measured here are to the LAST response of each stream
(a toy model with first chunk at 40 ms and last at 340 ms reports p50 341 ms). The profile export holds
every response timestamp, so first-response (time to first audio) percentiles are computed from it.
Percentiles: numpy linear. CSV latency columns are microseconds.

    python perf/perf_analyzer/parse.py out.csv --profile out_profile.json --md out.md --png out.png
"""
from __future__ import annotations

import argparse
import csv
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class PaRow:
    mode: str                 # "concurrency" or "request_rate"
    load: float               # concurrency or requests/s
    infer_per_s: float
    responses_per_s: float | None
    latency_us: dict[int, float] = field(default_factory=dict)  # percentile -> us (PA's CSV latency)
    avg_latency_us: float | None = None
    first_response_ms: dict[int, float] = field(default_factory=dict)  # from the profile export
    requests: int | None = None


def _num(s: str | None) -> float | None:
    s = (s or "").strip()
    return float(s) if s else None


def parse_csv(path: str | Path) -> list[PaRow]:
    """Rows sorted by load (perf_analyzer sorts its CSV by throughput, not load)."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        cols = reader.fieldnames or []
        if "Concurrency" in cols:
            mode, load_col = "concurrency", "Concurrency"
        elif "Request Rate" in cols:
            mode, load_col = "request_rate", "Request Rate"
        else:
            raise ValueError(f"{path}: no Concurrency or Request Rate column in {cols}")
        pcols = {int(c[1:].split()[0]): c for c in cols if c.startswith("p") and c.endswith(" latency")}
        rows = [PaRow(mode=mode, load=float(r[load_col]), infer_per_s=float(r["Inferences/Second"]),
                      responses_per_s=_num(r.get("Response Throughput")),
                      latency_us={p: float(r[c]) for p, c in pcols.items()},
                      avg_latency_us=_num(r.get("Avg latency")))
                for r in reader]
    return sorted(rows, key=lambda r: r.load)


def load_profile(path: str | Path) -> dict:
    """PA writes BYTES outputs (our encoded audio) into the export as raw, non-UTF-8 bytes; JSON's
    structure is ASCII, so latin-1 decodes any file and only those payload strings come out garbled."""
    return json.loads(Path(path).read_bytes().decode("latin-1"))


def first_response_latencies(profile: dict) -> dict[float, list[float]]:
    """Per experiment load value: seconds from request send to its first non-empty response."""
    out: dict[float, list[float]] = {}
    for exp in profile.get("experiments", []):
        lat = []
        for req in exp.get("requests", []):
            ts, outs = req.get("response_timestamps") or [], req.get("response_outputs") or []
            # Skip flags-only (empty) responses when outputs were exported.
            first = next((t for i, t in enumerate(ts) if i >= len(outs) or outs[i]), None)
            if first is not None:
                lat.append((first - req["timestamp"]) / 1e9)
        out[float(exp["experiment"]["value"])] = lat
    return out


def slim_profile(profile: dict) -> dict:
    """Drop response/request payloads (PA exports every audio sample as JSON) but keep timestamps."""
    slim = {k: v for k, v in profile.items() if k != "experiments"}
    slim["experiments"] = [
        {**{k: v for k, v in e.items() if k != "requests"},
         "requests": [{"timestamp": r["timestamp"], "response_timestamps": r.get("response_timestamps", [])}
                      for r in e.get("requests", [])]}
        for e in profile.get("experiments", [])]
    return slim


def attach_profile(rows: list[PaRow], profile: dict, percentiles=(50, 90, 99)) -> None:
    lats = first_response_latencies(profile)
    for r in rows:
        lat = lats.get(float(r.load))
        if lat:
            r.requests = len(lat)
            r.first_response_ms = {p: 1000 * float(np.percentile(lat, p, method="linear")) for p in percentiles}


def markdown(rows: list[PaRow]) -> str:
    load = "concurrency" if rows and rows[0].mode == "concurrency" else "request rate (req/s)"
    have_first = any(r.first_response_ms for r in rows)
    head = [load, "infer/s", "responses/s"]
    if have_first:
        head += ["first response p50 (ms)", "p90", "p99"]
    head += ["PA latency p50 (ms)", "p90", "p99"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    def f(v, d=1): return "-" if v is None else f"{v:.{d}f}"
    for r in rows:
        cells = [f"{r.load:g}", f(r.infer_per_s, 2), f(r.responses_per_s, 2)]
        if have_first:
            cells += [f(r.first_response_ms.get(p)) for p in (50, 90, 99)]
        cells += [f(r.latency_us[p] / 1000 if p in r.latency_us else None) for p in (50, 90, 99)]
        lines.append("| " + " | ".join(cells) + " |")
    note = ("\nFirst response = time to first audio, from the profile export. PA latency = perf_analyzer 2.51's "
            "CSV latency, which for these decoupled streams is to the last response.\n")
    return "\n".join(lines) + note


def plot(rows: list[PaRow], png: str | Path, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r.load for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    have_first = any(r.first_response_ms for r in rows)
    for p, style in ((50, "-o"), (90, "-s"), (99, "-^")):
        if have_first:
            ax.plot(x, [r.first_response_ms.get(p, np.nan) for r in rows], style, label=f"first response p{p}")
        else:
            ax.plot(x, [r.latency_us.get(p, np.nan) / 1000 for r in rows], style, label=f"PA latency p{p}")
    ax.set_xlabel("concurrency" if rows and rows[0].mode == "concurrency" else "request rate (req/s)")
    ax.set_ylabel("latency (ms)")
    ax2 = ax.twinx()
    ax2.plot(x, [r.responses_per_s if r.responses_per_s is not None else r.infer_per_s for r in rows],
             "--", color="gray", label="responses/s")
    ax2.set_ylabel("response throughput (responses/s)")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=8)
    ax.set_title(title or "perf_analyzer sweep")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--profile", help="perf_analyzer --profile-export-file JSON")
    ap.add_argument("--slim-profile", help="write the profile without payloads here (small enough to keep)")
    ap.add_argument("--md", help="Markdown output (default: print)")
    ap.add_argument("--png", help="plot output")
    ap.add_argument("--title", default="")
    a = ap.parse_args(argv)
    rows = parse_csv(a.csv)
    if a.profile:
        profile = load_profile(a.profile)
        attach_profile(rows, profile)
        if a.slim_profile:
            Path(a.slim_profile).write_text(json.dumps(slim_profile(profile)))
    md = markdown(rows)
    if a.md:
        Path(a.md).write_text(md)
    print(md)
    if a.png:
        plot(rows, a.png, a.title)


if __name__ == "__main__":
    main()
