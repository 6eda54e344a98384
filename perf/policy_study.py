"""Scheduling-policy study: online vs fcfs vs offline vs voxserve where scheduling decides who stalls.

Every run is the real engine and scheduler on a simulated clock (perf/policy_sim.py), so each number is exact
for its arrival seed, and the spread across seeds is the spread of the workload, not of a noisy machine.
Cells: a Poisson rate sweep (each policy's knee and goodput), the rates just below and above the knee, bursts
(Gamma arrivals, CV 2 and 4), mixed lengths (short replies among long readings), a player that buffers 0.5 or
1.0 s before it starts, and the two Orpheus window hops. Writes perf/results/<date>-<commit>-<machine>-policy.md
with tables (mean and 95% confidence interval over seeds) and plots.

    python perf/policy_study.py                      # a fixed-cost-dominated analytic device (8 ms per LM step)
    python perf/policy_study.py --profile h200       # Orpheus-3B on an H200, from first principles (slow to run)
    python perf/policy_study.py --calibrate          # fit the cost model to the tiny model on this machine first
    python perf/policy_study.py --quick              # one seed, fewer cells (a smoke run)
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from clients.stream_metrics import goodput, goodput_label, summarize, ttfa  # noqa: E402
from perf.policy_sim import PROFILES, CostModel, Workload, calibrate, simulate  # noqa: E402
from perf.provenance import collect, markdown_lines, result_filename  # noqa: E402
from voxbackend.config import EngineConfig  # noqa: E402

POLICIES = ("online", "fcfs", "offline", "voxserve")
METRICS = (("stall_free_pct", "stall-free %", 1), ("on_time_chunk_pct", "on-time chunks %", 1),
           ("ttfa_p50_s", "TTFA p50 (ms)", 1000), ("ttfa_p90_s", "TTFA p90 (ms)", 1000),
           ("ttfa_p99_s", "TTFA p99 (ms)", 1000))


@dataclass(frozen=True)
class Settings:
    cost: CostModel
    seeds: tuple[int, ...]
    duration_s: float
    rates: tuple[float, ...]
    ttfa_p90: float
    stall_free: float
    max_batch: int
    detok_batch: int
    policies: tuple[str, ...] = POLICIES
    detok_margin_s: float = EngineConfig.detok_margin_s  # the online policy's
    detok_pace_floor: float = 0.0  # the online policy's (the simulated device is not a CPU: no "auto")
    first_chunk_s: float = 0.0  # EngineConfig.first_chunk_s
    delivery_jitter_s: float = 0.0  # mean delay from the engine's event to the client (policy_sim.simulate)

    def engine_options(self) -> dict:
        return {"detok_margin_s": self.detok_margin_s, "detok_pace_floor": self.detok_pace_floor,
                "first_chunk_s": self.first_chunk_s,
                "delivery_jitter_s": self.delivery_jitter_s}


def run_cell(st: Settings, wl: Workload, policy: str, **engine) -> list[dict]:
    """One summary per seed."""
    out = []
    for seed in st.seeds:
        res = simulate(policy, wl, st.cost, seed, max_batch=st.max_batch, detok_batch=st.detok_batch,
                       **st.engine_options(), **engine)
        summary = summarize(res.timelines, startup_s=wl.startup_s)
        summary["ttfas_s"] = [t for t in map(ttfa, res.timelines) if t is not None]  # for the CDF plot
        out.append(summary)
    return out


def mean_ci(values: list[float | None]) -> tuple[float | None, float | None]:
    """Mean and the half-width of a 95% t interval (None with one value)."""
    v = [x for x in values if x is not None]
    if not v:
        return None, None
    if len(v) == 1:
        return float(v[0]), None
    t = {2: 12.71, 3: 4.30, 4: 3.18, 5: 2.78, 6: 2.57, 7: 2.45, 8: 2.36, 9: 2.31, 10: 2.26}.get(len(v), 1.96)
    return float(np.mean(v)), float(t * np.std(v, ddof=1) / math.sqrt(len(v)))


def fmt(values: list[float | None], scale: float) -> str:
    m, ci = mean_ci(values)
    if m is None:
        return "-"
    return f"{m * scale:.1f}" + (f" ± {ci * scale:.1f}" if ci is not None else "")


def cell_table(rows: dict[str, list[dict]]) -> str:
    head = "| policy | " + " | ".join(label for _, label, _ in METRICS) + " |"
    lines = [head, "|---" * (len(METRICS) + 1) + "|"]
    for policy, summaries in rows.items():
        cells = [fmt([s[key] for s in summaries], scale) for key, _, scale in METRICS]
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


class Study:
    def __init__(self, st: Settings, out_dir: Path, log=print):
        self.st, self.out_dir, self.log = st, out_dir, log
        self.raw: dict = {"settings": {**asdict(st), "cost": asdict(st.cost)}, "cells": {}}

    def sweep(self) -> dict[str, dict[float, list[dict]]]:
        """Poisson rate sweep per policy: summaries per rate (and seed)."""
        res: dict[str, dict[float, list[dict]]] = {p: {} for p in self.st.policies}
        for policy in self.st.policies:
            for rate in self.st.rates:
                res[policy][rate] = run_cell(self.st, Workload("poisson", rate, self.st.duration_s), policy)
                self.log(f"sweep {policy} {rate:g}/s: stall-free "
                         f"{fmt([s['stall_free_pct'] for s in res[policy][rate]], 1)} %")
        self.raw["cells"]["sweep"] = {p: {str(r): v for r, v in d.items()} for p, d in res.items()}
        return res

    def goodputs(self, sweep: dict[str, dict[float, list[dict]]]) -> dict[str, list[float | None]]:
        """Goodput per policy and seed (the targets are applied to each seed's run)."""
        out = {}
        for policy, by_rate in sweep.items():
            out[policy] = [goodput({r: s[i] for r, s in by_rate.items()}, self.st.ttfa_p90, self.st.stall_free)
                           for i in range(len(self.st.seeds))]
        return out

    def cell(self, name: str, wl: Workload, **engine) -> dict[str, list[dict]]:
        rows = {p: run_cell(self.st, wl, p, **engine) for p in self.st.policies}
        self.raw["cells"][name] = {"workload": asdict(wl), "engine": engine, "rows": rows}
        self.log(f"{name}: " + ", ".join(f"{p} {fmt([s['stall_free_pct'] for s in r], 1)}" for p, r in rows.items()))
        return rows


def knee(goodputs: list[float | None], rates: tuple[float, ...]) -> float:
    """The median goodput over seeds, or the lowest rate when none qualifies."""
    g = [x for x in goodputs if x is not None]
    return float(np.median(g)) if g else min(rates)


def plot_sweep(sweep, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for policy, by_rate in sweep.items():
        rates = sorted(by_rate)
        stats = [mean_ci([s["stall_free_pct"] for s in by_rate[r]]) for r in rates]
        ax.errorbar(rates, [m for m, _ in stats], yerr=[c or 0 for _, c in stats], marker="o", capsize=3,
                    label=policy)
    ax.set_xlabel("request rate (req/s, Poisson)")
    ax.set_ylabel("stall-free requests (%)")
    ax.set_ylim(-2, 102)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ttfa_cdf(rows: dict[str, list[dict]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for policy, summaries in rows.items():
        v = np.sort([t for s in summaries for t in s["ttfas_s"]])
        ax.plot(v * 1000, np.arange(1, len(v) + 1) / len(v), label=policy)
    ax.set_xlabel("time to first audio (ms)")
    ax.set_ylabel("fraction of requests (all seeds)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_timeline(st: Settings, wl: Workload, path: Path, policies=("online", "fcfs")) -> None:
    """Buffered audio of every stream over one run, per policy, with how many were pressing."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(policies), 1, figsize=(8, 3 * len(policies)), sharex=True)
    for ax, policy in zip(np.atleast_1d(axes), policies):
        res = simulate(policy, wl, st.cost, st.seeds[0], max_batch=st.max_batch, detok_batch=st.detok_batch,
                       **st.engine_options(), record=True)
        for points in res.buffers.values():
            t, b = zip(*points)
            ax.plot(t, b, lw=0.6, alpha=0.6)
        ax.axhline(0, color="k", lw=0.8)
        twin = ax.twinx()
        twin.plot([s.t for s in res.steps], [s.pressing for s in res.steps], color="k", lw=0.5, alpha=0.4)
        twin.set_ylabel("pressing requests")
        ax.set_ylabel("buffer (s)")
        ax.set_ylim(-1.0, 3.0)
        ax.set_title(f"{policy}: buffered audio per stream (below 0 = stalling)")
    np.atleast_1d(axes)[-1].set_xlabel("simulated time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calibrate", action="store_true", help="fit the cost model to the tiny model here")
    ap.add_argument("--profile", choices=sorted(PROFILES), default="fixed8ms", help="an analytic cost model")
    ap.add_argument("--cost", type=Path, help="a cost-model JSON (from a calibration) instead of --profile")
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per run (simulated)")
    ap.add_argument("--rates", default="", help="sweep rates (req/s); default: scaled to the cost model")
    ap.add_argument("--ttfa-p90", type=float, default=0.5)
    ap.add_argument("--stall-free", type=float, default=0.99)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--detok-batch", type=int, default=16)
    ap.add_argument("--detok-margin", type=float, default=EngineConfig.detok_margin_s,
                    help="the online policy's detok_margin_s")
    ap.add_argument("--detok-pace-floor", type=float, default=0.0,
                    help="the online policy's detok_pace_floor (default 0: never act as offline; the engine's "
                         "'auto' means 1.6 on a CPU, the simulated device is none)")
    ap.add_argument("--first-chunk", type=float, default=0.0, help="the engine's first_chunk_s")
    ap.add_argument("--delivery-jitter", type=float, default=0.0,
                    help="mean (exponential) delay of each chunk between the engine and the client, seconds")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "perf" / "results")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)  # the simulated model's tensors are tiny: threads only add overhead
    t_start = time.time()
    cost = PROFILES[a.profile]
    if a.calibrate:
        cost = calibrate()
    elif a.cost:
        cost = CostModel(**json.loads(a.cost.read_text()))
    seeds = (0,) if a.quick else tuple(int(s) for s in a.seeds.split(","))
    rates = tuple(float(r) for r in a.rates.split(",")) if a.rates else default_rates(cost, a.max_batch)
    st = Settings(cost, seeds, 10.0 if a.quick else a.duration, rates[::2] if a.quick else rates,
                  a.ttfa_p90, a.stall_free, a.max_batch, a.detok_batch, tuple(a.policies.split(",")),
                  a.detok_margin, a.detok_pace_floor, a.first_chunk, a.delivery_jitter)
    info = collect()
    tool = "policy" + (f"-detok-margin-{a.detok_margin:g}" if a.detok_margin != EngineConfig.detok_margin_s else "") + (
        f"-pace-floor-{a.detok_pace_floor:g}" if a.detok_pace_floor else "") + (
        f"-first-chunk-{a.first_chunk:g}" if a.first_chunk else "") + (
        f"-jitter-{a.delivery_jitter:g}" if a.delivery_jitter else "")
    stem = result_filename(tool, info)[: -len(".md")]
    out_dir = a.out / stem
    out_dir.mkdir(parents=True, exist_ok=True)
    study = Study(st, out_dir)

    sweep = study.sweep()
    gps = study.goodputs(sweep)
    ref = knee(gps["fcfs"] if "fcfs" in gps else next(iter(gps.values())), st.rates)
    step = st.rates[1] - st.rates[0] if len(st.rates) > 1 else ref * 0.25
    below, above = max(ref, min(st.rates)), ref + step
    cells = [
        ("just below the fcfs knee", Workload("poisson", below, st.duration_s), {}),
        ("just above the fcfs knee", Workload("poisson", above, st.duration_s), {}),
        ("bursts, CV 2 (Gamma shape 0.25)", Workload("gamma", below, st.duration_s, gamma_shape=0.25), {}),
        ("bursts, CV 4 (Gamma shape 0.0625)", Workload("gamma", below, st.duration_s, gamma_shape=0.0625), {}),
        ("mixed lengths (70% 0.5-1.5 s, 30% 10-20 s)", Workload("mixed", below, st.duration_s, lengths="mixed"),
         {}),
        ("player buffers 0.5 s before playing", Workload("poisson", above, st.duration_s, startup_s=0.5), {}),
        ("player buffers 1.0 s before playing", Workload("poisson", above, st.duration_s, startup_s=1.0), {}),
        ("window hop 4 frames (28 tokens)", Workload("poisson", below, st.duration_s, hop_frames=4), {}),
    ]
    if a.quick:
        cells = cells[:3]
    results = [(name, wl, study.cell(name, wl, **engine)) for name, wl, engine in cells]
    plot_sweep(sweep, out_dir / "stall_free_vs_rate.png")
    plot_ttfa_cdf(results[0][2], out_dir / "ttfa_cdf.png")
    plot_timeline(replace(st, seeds=st.seeds[:1]), replace(cells[1][1], duration_s=min(st.duration_s, 20.0)),
                  out_dir / "buffer_timeline.png", [p for p in ("online", "fcfs") if p in st.policies])
    (out_dir / "raw.json").write_text(json.dumps(study.raw, indent=1, default=str))
    md = report(st, info, sweep, gps, results, stem, time.time() - t_start, argv)
    path = a.out / f"{stem}.md"
    path.write_text(md)
    print(f"wrote {path}")
    return path


def default_rates(cost: CostModel, max_batch: int) -> tuple[float, ...]:
    """Rates around the load one LM batch can carry: max_batch streams of ~4 s each."""
    base = max_batch / 4.0
    return tuple(round(base * f, 3) for f in (0.25, 0.5, 0.625, 0.75, 0.875, 1.0, 1.25))


def report(st: Settings, info: dict, sweep, gps, results, stem: str, wall_s: float, argv) -> str:
    c = st.cost
    lines = [f"# Scheduling policies on a simulated clock ({info['date_slug']}, commit {info['commit_short']})", ""]
    lines += markdown_lines(info)
    lines += [
        f"- command: `python perf/policy_study.py {' '.join(argv or sys.argv[1:])}` ({wall_s:.0f} s)",
        "- model: Orpheus-shaped streams (7 tokens per 85.3 ms frame, SNAC windows of 4 frames) on the real "
        "Engine, Scheduler, KV pool and Detokenizer; the model itself is simulated (no weights)",
        f"- cost model: {c.name}: LM step {1000 * c.lm_fixed:.2f} ms + {1000 * c.lm_per_token:.3f} ms/token, "
        f"codec call {1000 * c.detok_fixed:.2f} ms + {1000 * c.detok_per_window:.3f} ms/window, engine "
        f"{1000 * c.step_overhead:.2f} ms/step ({c.source})",
        f"- engine: max_batch {st.max_batch}, detok_batch {st.detok_batch}, playback_margin_s 1.0, detok_margin_s "
        f"{st.detok_margin_s:g} and detok_pace_floor {st.detok_pace_floor:g} (online), first_chunk_s "
        f"{st.first_chunk_s:g}, defaults "
        "otherwise",
        "- dataset: lengths drawn per request (2-6 s of audio; 'mixed': 70% 0.5-1.5 s, 30% 10-20 s), 40-token "
        "prompts",
        "- delivery: " + (f"each chunk reaches the client after an exponential delay of mean "
                           f"{1000 * st.delivery_jitter_s:g} ms (in order)" if st.delivery_jitter_s else
                           "at once (no serving path modelled)"),
        f"- arrivals: open loop, {st.duration_s:g} s per run; seeds {list(st.seeds)}; mean ± 95% t-interval over "
        "seeds",
        f"- goodput targets: {goodput_label(st.ttfa_p90, st.stall_free)}",
        "",
        "## Goodput (Poisson sweep)",
        "",
        "| policy | goodput per seed (req/s) | median |",
        "|---|---|---|",
    ]
    for policy, g in gps.items():
        shown = ", ".join("none" if x is None else f"{x:g}" for x in g)
        med = [x for x in g if x is not None]
        lines.append(f"| {policy} | {shown} | {np.median(med):g} |" if med else f"| {policy} | {shown} | none |")
    lines += ["", f"Rates: {', '.join(f'{r:g}' for r in st.rates)} req/s. ![stall-free vs rate]"
              f"({stem}/stall_free_vs_rate.png)", ""]
    for rate in st.rates:
        lines += [f"### Poisson {rate:g} req/s", "", cell_table({p: sweep[p][rate] for p in sweep}), ""]
    for name, wl, rows in results:
        lines += [f"## {name}", "", f"{wl.gamma_shape and 'Gamma shape ' + format(wl.gamma_shape, 'g')} arrivals at "
                  f"{wl.rate:g} req/s, lengths {wl.lengths}, player startup {wl.startup_s:g} s, window hop "
                  f"{wl.hop_frames} frame(s).", "", cell_table(rows), ""]
    lines += ["## Plots", "", f"![TTFA CDF]({stem}/ttfa_cdf.png)", "",
              f"![buffer timeline]({stem}/buffer_timeline.png)", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
