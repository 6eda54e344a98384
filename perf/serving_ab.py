"""A/B of the served path: this checkout's `orpheus` model repository against another commit's, same load.

Both sides serve the tiny default Orpheus checkpoint (the same folder) through a real tritonserver, one side at a
time, and take the same seeded open-loop Poisson load (clients/loadgen.py); the sides alternate round by round,
so a noisy shared machine hits both alike. Written for the change from the `orpheus` ensemble (preprocess ->
engine -> audio_postprocess, one internal request per chunk) to the front model (its own engine, no internal
request).

    git worktree add /tmp/base 3ff87f8
    python perf/serving_ab.py --base /tmp/base --rates 0.8,1.6 --duration 30 --rounds 2
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
from clients.loadgen import load_prompts, run_load  # noqa: E402
from clients.stream_metrics import summarize  # noqa: E402
from voxbackend.models.orpheus.tiny import ensure_default_checkpoint  # noqa: E402
from voxbackend.deploy.server import TritonServer  # noqa: E402

METRICS = (("ttfa_p50_s", "TTFA p50 (s)"), ("ttfa_p90_s", "TTFA p90 (s)"), ("stall_free_pct", "stall-free %"),
           ("on_time_chunk_pct", "on-time chunks %"), ("x_real_time", "x real time"))


def side_repository(checkout: Path, dest: Path, model_dir: Path, codec_dir: Path) -> Path:
    """The checkout's committed orpheus folders (and the ensemble's audio_postprocess, where it has one) with the
    checkpoint filled in; each model.py first puts the checkout on sys.path, so its stubs run its own code (the
    venv's editable install points at this checkout)."""
    for folder in sorted((checkout / "model_repository").iterdir()):
        if folder.name.startswith("orpheus") and not folder.name.endswith("text_stream") \
                or folder.name == "audio_postprocess":
            shutil.copytree(folder, dest / folder.name, ignore=shutil.ignore_patterns("__pycache__"))
    for config in dest.glob("*/config.pbtxt"):
        text = config.read_text()
        text = text.replace('key: "checkpoint" value: { string_value: "" }',
                            f'key: "checkpoint" value: {{ string_value: "{model_dir}" }}')
        config.write_text(text.replace('key: "codec" value: { string_value: "" }',
                                       f'key: "codec" value: {{ string_value: "{codec_dir}" }}'))
    for shim in dest.glob("*/1/model.py"):
        shim.write_text(f"import sys\nsys.path.insert(0, {str(checkout)!r})\n" + shim.read_text())
    return dest


def run_side(repo: Path, work: Path, prompts: list[str], rates: list[float], duration: float,
             seed: int) -> dict[float, dict]:
    out = {}
    with TritonServer(repo, log_file=work / "tritonserver.log", work_dir=work) as server:
        for rate in rates:
            timelines = run_load(server.grpc_url, "orpheus", prompts, rate, duration, seed=seed)
            out[rate] = summarize(timelines)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, required=True, help="a checkout (git worktree) of the base commit")
    ap.add_argument("--rates", default="0.8,1.6", help="comma-separated request rates (req/s)")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per rate")
    ap.add_argument("--rounds", type=int, default=2, help="base/new alternations")
    ap.add_argument("--seed", type=int, default=0, help="arrival times and prompt choice")
    ap.add_argument("--out", type=Path, default=None,
                    help="markdown file (default perf/results/<date>-<commit>-<machine>-serving_ab.md)")
    args = ap.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    prompts = load_prompts(ROOT / "perf/data/prompts.txt")
    model_dir, codec_dir = ensure_default_checkpoint()
    tmp = Path(tempfile.mkdtemp(prefix="voxbackend-serving-ab-"))
    sides = {"base": args.base.resolve(), "new": ROOT}
    repos = {name: side_repository(path, tmp / name / "model_repository", model_dir, codec_dir)
             for name, path in sides.items()}
    results: dict[str, list[dict[float, dict]]] = {name: [] for name in sides}
    t0 = time.monotonic()
    for r in range(args.rounds):
        for name in (("base", "new") if r % 2 == 0 else ("new", "base")):
            print(f"round {r + 1}: {name}", flush=True)
            results[name].append(run_side(repos[name], tmp / name / f"work{r}", prompts, rates, args.duration,
                                          args.seed))
    lines = ["# Served path A/B: `orpheus` model repository, base vs this checkout", "",
             f"`python perf/serving_ab.py --base BASE --rates {args.rates} --duration {args.duration:g} "
             f"--rounds {args.rounds} --seed {args.seed}` (BASE: `git worktree add BASE "
             f"{provenance.git_commit(args.base.resolve(), short=True)}`), {(time.monotonic() - t0) / 60:.0f} "
             "min", "", *provenance.markdown_lines(provenance.collect()),
             f"- model: tiny default Orpheus (random weights), {model_dir}", f"- arrivals: Poisson, seed {args.seed}, "
             f"{args.duration:g} s per rate, prompts perf/data/prompts.txt; sides alternate, {args.rounds} rounds",
             f"- load average at end: {provenance.load_average()}", "",
             "Medians over rounds (each round's value in brackets).", "",
             "| rate (req/s) | metric | base | new | new / base |", "|---|---|---|---|---|"]
    for rate in rates:
        for key, label in METRICS:
            med, cells = median_cells({n: [run[rate][key] for run in results[n]] for n in sides})
            ratio = f"{med['new'] / med['base']:.2f}" if med["base"] and med["new"] is not None else "-"
            lines.append(f"| {rate:g} | {label} | {cells['base']} | {cells['new']} | {ratio} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = args.out or HERE / "results" / provenance.result_filename("serving_ab")
    out.write_text(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
