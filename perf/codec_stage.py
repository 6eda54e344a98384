"""Colocated codec vs the codec as its own model, served by Triton, side by side under the same load.

Each side serves one model with 2 engine instances: "colocated", each engine decoding its own windows (the
default), and "codec stage", both engines sending their windows to one `<model>_codec` instance
(`--set instances=2 --set codec_instances=1`). Both take the same seeded open-loop Poisson load (clients/loadgen.py)
at each rate; the sides alternate round by round, so a noisy shared machine hits both alike. The tiny default
checkpoints (random weights) are the models.

    python perf/codec_stage.py --models orpheus,cosyvoice2 --rates orpheus=0.8,1.6 --rates cosyvoice2=0.4,0.8
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]

import provenance  # noqa: E402  (perf/provenance.py)
from rounds import median_cells  # noqa: E402  (perf/rounds.py)
from clients.loadgen import RequestOptions, load_prompts, run_load  # noqa: E402
from clients.stream_metrics import summarize  # noqa: E402
from voxbackend.deploy import configs  # noqa: E402
from voxbackend.deploy.server import TritonServer  # noqa: E402

SIDES = {"colocated": {"instances": "2"}, "codec stage": {"instances": "2", "codec_instances": "1"}}
METRICS = (("ttfa_p50_s", "TTFA p50 (s)"), ("ttfa_p90_s", "TTFA p90 (s)"), ("stall_free_pct", "stall-free %"),
           ("on_time_chunk_pct", "on-time chunks %"), ("x_real_time", "x real time"), ("errors", "errors"))


def side_repository(model: str, settings: dict[str, str], dest: Path) -> Path:
    """The front model (and its codec stage) only: the engine and preprocess models would load engines no load
    reaches."""
    configs.write_repository(dest, settings, models=[model])
    for folder in (f"{model}_engine", f"{model}_preprocess", f"{model}_text_stream"):
        shutil.rmtree(dest / folder, ignore_errors=True)
    return dest


def run_side(repo: Path, work: Path, model: str, prompts: list[str], rates: list[float], duration: float,
             seed: int, max_tokens: int) -> dict[float, dict]:
    out = {}
    opts = RequestOptions(max_tokens=max_tokens, sampling_seed=seed)
    with TritonServer(repo, log_file=work / "tritonserver.log", work_dir=work) as server:
        for rate in rates:
            out[rate] = summarize(run_load(server.grpc_url, model, prompts, rate, duration, seed=seed, opts=opts))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="orpheus,cosyvoice2")
    ap.add_argument("--rates", action="append", default=[],
                    help="MODEL=comma-separated request rates (req/s); default 0.8,1.6 (orpheus), 0.4,0.8 (others)")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per rate")
    ap.add_argument("--rounds", type=int, default=2, help="colocated / codec stage alternations")
    ap.add_argument("--max-tokens", type=int, default=200, help="MAX_TOKENS of every request")
    ap.add_argument("--seed", type=int, default=0, help="arrival times, prompt choice and sampling seeds")
    ap.add_argument("--out", type=Path, default=None,
                    help="markdown file (default perf/results/<date>-<commit>-<machine>-codec_stage.md)")
    args = ap.parse_args(argv)
    models = args.models.split(",")
    rates = {m: [0.8, 1.6] if m == "orpheus" else [0.4, 0.8] for m in models}
    for item in args.rates:
        name, _, values = item.partition("=")
        rates[name] = [float(r) for r in values.split(",")]
    prompts = load_prompts(ROOT / "perf/data/prompts.txt")
    tmp = Path(tempfile.mkdtemp(prefix="voxbackend-codec-stage-"))
    results = {(m, side): [] for m in models for side in SIDES}
    t0 = time.monotonic()
    for model in models:
        repos = {side: side_repository(model, settings, tmp / model / side.replace(" ", "_") / "model_repository")
                 for side, settings in SIDES.items()}
        for r in range(args.rounds):
            for side in (list(SIDES) if r % 2 == 0 else list(SIDES)[::-1]):
                print(f"{model}, round {r + 1}: {side}", flush=True)
                work = tmp / model / side.replace(" ", "_") / f"work{r}"
                results[model, side].append(run_side(repos[side], work, model, prompts, rates[model], args.duration,
                                                     args.seed, args.max_tokens))
    rate_args = " ".join(f"--rates {m}={','.join(f'{x:g}' for x in rates[m])}" for m in models)
    lines = ["# Colocated codec vs the codec as its own model (`<model>_codec`), 2 engine instances, through Triton",
             "", f"`python perf/codec_stage.py --models {args.models} {rate_args} --duration {args.duration:g} "
             f"--rounds {args.rounds} --max-tokens {args.max_tokens} --seed {args.seed}`, "
             f"{(time.monotonic() - t0) / 60:.0f} min", "", *provenance.markdown_lines(provenance.collect()),
             "- models: the tiny default checkpoints (random weights), built by the servers",
             "- sides: `colocated` = `--set instances=2`; `codec stage` = `--set instances=2 --set codec_instances=1` "
             "(both engines send their windows to one codec instance)",
             f"- arrivals: Poisson, seed {args.seed}, {args.duration:g} s per rate, prompts perf/data/prompts.txt, "
             f"MAX_TOKENS {args.max_tokens}, sampling seeds from {args.seed}; sides alternate, {args.rounds} rounds",
             f"- load average at end: {provenance.load_average()}", "",
             "Medians over rounds (each round's value in brackets).", "",
             "| model | rate (req/s) | metric | colocated | codec stage | stage / colocated |",
             "|---|---|---|---|---|---|"]
    for model in models:
        for rate in rates[model]:
            for key, label in METRICS:
                med, cells = median_cells({s: [run[rate][key] for run in results[model, s]] for s in SIDES})
                a, b = med["colocated"], med["codec stage"]
                ratio = f"{b / a:.2f}" if a and b is not None and key != "errors" else "-"
                lines.append(f"| {model} | {rate:g} | {label} | {cells['colocated']} | {cells['codec stage']} | "
                             f"{ratio} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = args.out or HERE / "results" / provenance.result_filename("codec_stage")
    out.write_text(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
