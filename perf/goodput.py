"""Goodput benchmark: open-loop Poisson rate sweeps (clients/loadgen) against one or more served models.

Goodput (docs/metrics.md) = the highest tested rate with p90 TTFA <= --ttfa-p90 and a stall-free
share >= --stall-free; the targets are printed next to every number. With several targets, the table
gives each one's goodput as a ratio to the baseline target (the last one unless --baseline).

    python perf/goodput.py --target engine=localhost:8001/orpheus --target naive=localhost:9001/orpheus_naive \
        --rates 0.25,0.5,1,2,4 --duration 30 --ttfa-p90 1.0 --stall-free 0.99 --weights random \
        --model-desc "orpheus tiny (hidden 128)" --out perf/results/goodput
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from clients.loadgen import (RequestOptions, arrival_label, git_commit, load_prompts, machine,  # noqa: E402
                             parse_rates, run_load)
from clients.stream_metrics import goodput, goodput_label, markdown_table, meets_targets, summarize  # noqa: E402


@dataclass
class Target:
    name: str
    url: str
    model: str


def parse_target(s: str) -> Target:
    """'name=host:port/model' -> Target."""
    name, sep, rest = s.partition("=")
    url, sep2, model = rest.rpartition("/")
    if not sep or not sep2 or not name or not url or not model:
        raise ValueError(f"bad --target {s!r}; expected name=host:port/model")
    return Target(name, url, model)


def sweep(targets: list[Target], rates: list[float], prompts: list[str], duration: float, *, seed: int,
          burstiness: float, opts: RequestOptions, ttfa_p90: float, stall_free: float,
          stop_after_failures: int, request_timeout: float, log=print) -> tuple[dict[str, dict], dict[str, dict]]:
    """Rates in increasing order, the targets taking turns at each rate, so that every ratio compares runs made
    minutes apart (this shared machine's speed drifts over a sweep). A target leaves the sweep after
    `stop_after_failures` consecutive rates miss the targets (load past saturation only takes longer and tells
    nothing new). Returns {target name: {rate: summary}} and {target name: {rate: raw timelines}}."""
    results = {t.name: {} for t in targets}
    raw = {t.name: {} for t in targets}
    misses = {t.name: 0 for t in targets}
    for rate in sorted(rates):
        for t in targets:
            if stop_after_failures and misses[t.name] >= stop_after_failures:
                continue
            tls = run_load(t.url, t.model, prompts, rate, duration, burstiness=burstiness, seed=seed,
                           opts=opts, request_timeout=request_timeout)
            s = summarize(tls)
            results[t.name][rate], raw[t.name][rate] = s, [x.to_dict() for x in tls]
            ok = meets_targets(s, ttfa_p90, stall_free)
            log(f"[{t.name}] rate {rate:g}: n={s['count']} err={s['errors']} "
                f"ttfa p90={s['ttfa_p90_s']} stall-free={s['stall_free_pct']} -> {'ok' if ok else 'miss'}")
            misses[t.name] = 0 if ok else misses[t.name] + 1
    return results, raw


def goodput_table(results: dict[str, dict[float, dict]], ttfa_p90: float, stall_free: float,
                  baseline: str | None) -> str:
    gp = {name: goodput(r, ttfa_p90, stall_free) for name, r in results.items()}
    base = gp.get(baseline) if baseline else None
    lines = [f"Goodput targets: {goodput_label(ttfa_p90, stall_free)}", "",
             "| target | goodput (req/s) | highest rate tested | ratio to " + (baseline or "-") + " |",
             "|---|---|---|---|"]
    for name, g in gp.items():
        if g is None:
            ratio = "-"
        elif base:
            ratio = f"{g / base:.2f}x"
        else:
            ratio = "n/a (baseline meets the targets at no tested rate)" if baseline and name != baseline else "-"
        top = max(results[name])
        shown = "none" if g is None else f"{g:g}" + (" (highest tested: a lower bound)" if g == top else "")
        lines.append(f"| {name} | {shown} | {top:g} | {ratio} |")
    return "\n".join(lines)


def plot(results: dict[str, dict[float, dict]], png: Path, ttfa_p90: float, stall_free: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (name, res) in enumerate(results.items()):
        rates, color = sorted(res), f"C{i}"  # one color per target, one line style per percentile
        for q, style in (("p50", ":"), ("p90", "-"), ("p99", "--")):
            ax1.plot(rates, [res[r][f"ttfa_{q}_s"] if res[r][f"ttfa_{q}_s"] is not None else float("nan")
                             for r in rates], style, marker="o", color=color, label=f"{name} {q}")
        ax2.plot(rates, [res[r]["stall_free_pct"] for r in rates], "-o", color=color, label=name)
    ax1.axhline(ttfa_p90, color="red", lw=0.8, label=f"p90 target {ttfa_p90:g} s")
    ax1.set(xlabel="request rate (req/s, Poisson)", ylabel="TTFA (s)", title="Time to first audio")
    ax1.set_yscale("log")
    ax2.axhline(100 * stall_free, color="red", lw=0.8, label=f"target {100 * stall_free:g}%")
    ax2.set(xlabel="request rate (req/s, Poisson)", ylabel="stall-free requests (%)", title="Stall-free streams",
            ylim=(0, 105))
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def provenance(a: argparse.Namespace, targets: list[Target]) -> dict:
    return {"git_commit": git_commit(ROOT), "machine": machine(),
            "targets": {t.name: f"{t.url}/{t.model}" for t in targets},
            "model": a.model_desc, "weights": a.weights, "dataset": a.prompts,
            "arrival": arrival_label(a.burstiness), "seed": a.seed, "duration_per_rate_s": a.duration,
            "max_tokens": a.max_tokens, "targets_goodput": goodput_label(a.ttfa_p90, a.stall_free),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", action="append", required=True, help="name=host:port/model (repeatable)")
    ap.add_argument("--baseline", default=None, help="target name for the ratio (default: the last target)")
    ap.add_argument("--rates", default="0.25,0.5,1,2,4")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per rate")
    ap.add_argument("--prompts", default=str(ROOT / "perf/data/prompts.txt"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--burstiness", type=float, default=1.0,
                    help="Gamma shape; 1 = Poisson (the goodput of docs/metrics.md)")
    ap.add_argument("--ttfa-p90", type=float, default=1.0, help="p90 TTFA target in seconds")
    ap.add_argument("--stall-free", type=float, default=0.99, help="stall-free request share target (0-1)")
    ap.add_argument("--stop-after-failures", type=int, default=2, help="0 = always run every rate")
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--voice", default=None)
    ap.add_argument("--temperature", type=float, default=None)
    ap.add_argument("--sampling-seed", type=int, default=None)
    ap.add_argument("--weights", default="random", choices=["random", "real"])
    ap.add_argument("--model-desc", default="orpheus (size not given)", help="model and size, for provenance")
    ap.add_argument("--save-timelines", action="store_true", help="keep raw timelines in the JSON")
    ap.add_argument("--out", default=str(ROOT / "perf/results/goodput"), help="prefix for .json/.md/.png")
    a = ap.parse_args(argv)

    targets = [parse_target(t) for t in a.target]
    baseline = a.baseline or (targets[-1].name if len(targets) > 1 else None)
    opts = RequestOptions(voice=a.voice, max_tokens=a.max_tokens, sampling_seed=a.sampling_seed,
                          sampling={"TEMPERATURE": a.temperature})
    prompts, rates = load_prompts(a.prompts), parse_rates(a.rates)
    results, raw = sweep(targets, rates, prompts, a.duration, seed=a.seed, burstiness=a.burstiness, opts=opts,
                         ttfa_p90=a.ttfa_p90, stall_free=a.stall_free, stop_after_failures=a.stop_after_failures,
                         request_timeout=a.request_timeout)

    prov = provenance(a, targets)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"provenance": prov, "results": {n: {str(r): s for r, s in res.items()} for n, res in results.items()},
           "goodput": {n: goodput(res, a.ttfa_p90, a.stall_free) for n, res in results.items()}}
    if a.save_timelines:
        doc["timelines"] = {n: {str(r): tl for r, tl in res.items()} for n, res in raw.items()}
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    png = out.with_suffix(".png")
    plot(results, png, a.ttfa_p90, a.stall_free)
    md = ["## Goodput", "", *[f"- {k}: {v}" for k, v in prov.items()],
          "- TTFA in ms; percentiles: numpy linear; x real time = audio s / wall s (higher is better)", "",
          goodput_table(results, a.ttfa_p90, a.stall_free, baseline), ""]
    for name, res in results.items():
        md += [f"### {name}", "", markdown_table(res), ""]
    md += [f"![goodput]({png.name})", ""]
    out.with_suffix(".md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
