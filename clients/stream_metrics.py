"""Streaming TTS metrics (docs/metrics.md), as pure functions over per-request timelines.

Definitions used everywhere in this project:

- TTFA: send time -> arrival of the first chunk that carries audio samples.
- On time: playback starts when the first audio arrives. Chunk i (i >= 1) is on time if the audio
  of chunks 0..i-1 is strictly longer than arrival_i - arrival_0. Chunk 0 starts playback and is
  not judged, so "on-time chunk %" counts judged chunks (i >= 1) only.
- Stall-free: every judged chunk is on time. A request that errored or got no audio is not
  stall-free (it never played), and it stays in the denominator of the stall-free %.
- x real time: total audio seconds / wall seconds of the run (higher is better).
- Percentiles: numpy.percentile with method="linear" (the default; linear interpolation between
  order statistics, i.e. type 7 of Hyndman and Fan).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class StreamTimeline:
    """What one client saw of one request. Times are seconds on one monotonic clock."""
    send_time: float
    chunks: list[tuple[float, float]] = field(default_factory=list)  # (arrival_time, audio_seconds)
    error: str | None = None
    end_time: float | None = None        # final response (or error / timeout) arrival
    scheduled_time: float | None = None  # when the arrival process wanted it sent (open-loop lag check)
    prompt: str = ""
    request_id: str = ""
    finish_reason: str | None = None     # the model's FINISH_REASON on the final response, if it sends one

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "StreamTimeline":
        d = dict(d)
        d["chunks"] = [tuple(c) for c in d.get("chunks", [])]
        return cls(**d)


def _audio_chunks(tl: StreamTimeline) -> list[tuple[float, float]]:
    # Empty responses (e.g. a bare final flag) carry no samples and do not count as chunks.
    return [c for c in tl.chunks if c[1] > 0]


def ttfa(tl: StreamTimeline) -> float | None:
    """Seconds from send to the first audio samples; None if no audio arrived."""
    chunks = _audio_chunks(tl)
    return chunks[0][0] - tl.send_time if chunks else None


def on_time_flags(tl: StreamTimeline, startup_s: float = 0.0) -> list[bool]:
    """One flag per judged chunk: was the listener's buffer still non-empty when it arrived?

    startup_s = 0 (the definition above): playback starts at chunk 0, chunks 1..n-1 are judged. A player that
    first buffers startup_s of audio starts at the chunk that brings it there (or at the last chunk), and only
    the chunks after that one are judged."""
    chunks = _audio_chunks(tl)
    if not chunks:
        return []
    start, buffered = 0, chunks[0][1]
    while buffered < startup_s and start + 1 < len(chunks):
        start += 1
        buffered += chunks[start][1]
    t0 = chunks[start][0]
    flags = []
    for i in range(start + 1, len(chunks)):
        flags.append(buffered > chunks[i][0] - t0)  # audio of chunks 0..i-1 against the time played
        buffered += chunks[i][1]
    return flags


def stall_free(tl: StreamTimeline, startup_s: float = 0.0) -> bool:
    """True if the request finished without error, played some audio, and never ran dry."""
    return tl.error is None and bool(_audio_chunks(tl)) and all(on_time_flags(tl, startup_s))


def audio_seconds(tl: StreamTimeline) -> float:
    return float(sum(d for _, d in tl.chunks))


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q, method="linear")) if values else None


def summarize(timelines: list[StreamTimeline], wall_s: float | None = None, startup_s: float = 0.0) -> dict:
    """Aggregate metrics for one load level. wall_s defaults to first send -> last arrival or end; startup_s is
    the player's startup buffer (see on_time_flags)."""
    n = len(timelines)
    ttfas = [t for t in (ttfa(tl) for tl in timelines) if t is not None]
    flags = [f for tl in timelines for f in on_time_flags(tl, startup_s)]
    n_free = sum(stall_free(tl, startup_s) for tl in timelines)
    audio = sum(audio_seconds(tl) for tl in timelines)
    if wall_s is None and timelines:
        ends = [max([tl.end_time or tl.send_time] + [a for a, _ in tl.chunks]) for tl in timelines]
        wall_s = max(ends) - min(tl.send_time for tl in timelines)
    lags = [tl.send_time - tl.scheduled_time for tl in timelines if tl.scheduled_time is not None]
    return {
        "count": n,
        "errors": sum(tl.error is not None for tl in timelines),
        "ttfa_count": len(ttfas),
        "ttfa_mean_s": float(np.mean(ttfas)) if ttfas else None,
        "ttfa_p50_s": _pct(ttfas, 50),
        "ttfa_p90_s": _pct(ttfas, 90),
        "ttfa_p95_s": _pct(ttfas, 95),
        "ttfa_p99_s": _pct(ttfas, 99),
        "chunks_judged": len(flags),
        "on_time_chunk_pct": 100.0 * sum(flags) / len(flags) if flags else None,
        "stall_free_frac": n_free / n if n else None,
        "stall_free_pct": 100.0 * n_free / n if n else None,
        "audio_s": audio,
        "wall_s": wall_s,
        "x_real_time": audio / wall_s if wall_s else None,
        "send_lag_max_s": max(lags) if lags else None,
        "percentile_method": "numpy linear",
    }


def meets_targets(summary: dict, ttfa_p90_target_s: float, stall_free_target: float = 0.99) -> bool:
    """The goodput condition of docs/metrics.md for one load level."""
    p90, free = summary.get("ttfa_p90_s"), summary.get("stall_free_frac")
    if not summary.get("count") or p90 is None or free is None:
        return False
    return p90 <= ttfa_p90_target_s and free >= stall_free_target - 1e-12


def goodput(results_by_rate: dict[float, dict], ttfa_p90_target_s: float,
            stall_free_target: float = 0.99) -> float | None:
    """Highest request rate (req/s) whose summary has p90 TTFA <= target and stall-free >= target.

    results_by_rate maps rate -> summarize() output. Returns None when no rate qualifies.
    Always print the targets next to the number (see goodput_label)."""
    ok = [r for r, s in results_by_rate.items() if meets_targets(s, ttfa_p90_target_s, stall_free_target)]
    return max(ok) if ok else None


def goodput_label(ttfa_p90_target_s: float, stall_free_target: float = 0.99) -> str:
    return f"p90 TTFA <= {ttfa_p90_target_s:g} s, stall-free >= {100 * stall_free_target:g}%"


def markdown_table(results_by_rate: dict[float, dict]) -> str:
    """One row per rate; times in ms."""
    def ms(v): return "-" if v is None else f"{1000 * v:.0f}"
    def f1(v): return "-" if v is None else f"{v:.1f}"
    def f2(v): return "-" if v is None else f"{v:.2f}"
    rows = ["| rate (req/s) | requests | errors | TTFA mean | p50 | p90 | p95 | p99 (ms) "
            "| on-time chunks % | stall-free % | audio s | x real time |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for rate in sorted(results_by_rate):
        s = results_by_rate[rate]
        rows.append(f"| {rate:g} | {s['count']} | {s['errors']} | {ms(s['ttfa_mean_s'])} | "
                    f"{ms(s['ttfa_p50_s'])} | {ms(s['ttfa_p90_s'])} | {ms(s['ttfa_p95_s'])} | "
                    f"{ms(s['ttfa_p99_s'])} | {f1(s['on_time_chunk_pct'])} | {f1(s['stall_free_pct'])} | "
                    f"{s['audio_s']:.1f} | {f2(s['x_real_time'])} |")
    return "\n".join(rows)
