"""Engine vs naive CSM on CPU (`python perf/engine_bench.py --model csm [--quick]`).

The naive baseline is what a CSM user writes with transformers: CsmForConditionalGeneration.generate (backbone
and depth decoder, one request at a time), then its Mimi decode of the whole utterance, so its first audio is its
last. The engine serves a burst of N requests at once (batched backbone, on-device
depth loop, streaming Mimi windows). Both run the same tiny random checkpoint (voxbackend.models.csm.tiny) with
CSM's default sampling (temperature 0.9, top_k 50 on backbone and depth decoder) and the same frame budget.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import provenance  # perf/provenance.py (engine_bench put perf/ on sys.path)
from burst import run_burst  # perf/burst.py

SAMPLE_RATE = 24000
FRAME_S = 0.08
SAMPLING = dict(temperature=0.9, top_k=50)


@dataclass
class Result:
    ttfa: float  # from the request's own start (engine: its submit in the burst; naive: its generate call)
    service: float  # to its last audio
    audio_s: float


def requests(n: int, prompts: list[str], seed: int) -> list[tuple[str, int, int]]:
    """(text, speaker, seed) of request i: sentence i, speakers alternate, seeds differ."""
    return [(prompts[i % len(prompts)], i % 2, seed + i) for i in range(n)]


def run_naive(model, prepare, req: tuple[str, int, int], frames: int) -> Result:
    import torch

    text, speaker, seed = req
    ids = [row[-1] for row in prepare(text, speaker)]  # a text-only prompt: the text column
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=frames, do_sample=True, depth_decoder_do_sample=True,
                             return_dict_in_generate=True, **SAMPLING,
                             **{f"depth_decoder_{k}": v for k, v in SAMPLING.items()})
        codes = out.sequences[0]  # [frames, 32], the stop frame included when it came
        codes = codes[~(codes[:, :-1] == model.config.codebook_eos_token_id).all(1)]
        # random weights may sample the 3 special ids above the Mimi codebook; generate(output_audio=True) then
        # fails inside Mimi, so they are clamped here (a trained CSM does not emit them)
        codes = codes.clamp(max=model.config.codec_config.codebook_size - 1)
        audio = model.codec_model.decode(codes.T[None]).audio_values[0, 0] if len(codes) else torch.zeros(0)
    wall = time.perf_counter() - t0
    return Result(wall, wall, audio.numel() / SAMPLE_RATE)


def run_engine_burst(engine, reqs: list[tuple[str, int, int]], frames: int) -> tuple[float, list[Result]]:
    from voxbackend import SamplingParams

    wall, done = run_burst(engine, [(engine.model.prepare(text, speaker),
                                     SamplingParams(max_tokens=frames, seed=seed, **SAMPLING))
                                    for text, speaker, seed in reqs])
    return wall, [Result(r.ttfa, r.service, r.samples / SAMPLE_RATE) for r in done]


def _p90(xs: list[float]) -> float:
    return float(np.percentile(xs, 90)) if xs else float("nan")


def run(args, prompts: list[str], dataset: str, log) -> Path:
    import torch
    import transformers

    import voxbackend
    from voxbackend.models.csm.tiny import ensure_default_csm

    info = provenance.collect()
    frames = args.max_tokens  # CSM: one LM step per 80 ms frame
    cache = args.cache_dir or Path.home() / ".cache" / "voxbackend" / "bench"
    model_dir, _ = ensure_default_csm(cache / f"csm-tiny-{args.seed}" if args.seed else cache / "csm-tiny")
    log(f"CSM tiny checkpoint {model_dir}; {frames} frames per request; streams {args.stream_counts}")
    n_max = max(args.stream_counts)
    engine = voxbackend.load(model_dir, policy=args.policy, max_batch=max(32, n_max), page_size=16,
                             kv_pages=max(1024, n_max * ((frames + 64) // 16 + 2)))
    engine.start()
    naive = transformers.CsmForConditionalGeneration.from_pretrained(str(model_dir)).eval()
    prepare = engine.model.prepare
    log("warm-up (not measured)")
    run_naive(naive, prepare, ("Hello there.", 0, 1), 4)
    run_engine_burst(engine, [("Hello there.", 0, 1)], 4)

    rows, ratios = [], {}
    for n in args.stream_counts:
        reqs = requests(n, prompts, args.seed)
        # naive is sequential: serve a few requests for real (spread over the burst), half before and half after
        # the engine burst, since the shared machine drifts; at 1 stream both sides serve single_rounds requests
        k = args.single_rounds if n == 1 else min(n, args.naive_requests)
        picked = [reqs[round(j * (n - 1) / max(1, k - 1))] for j in range(k)]
        naive_res = [run_naive(naive, prepare, r, frames) for r in picked[: k // 2]]
        walls, eng = 0.0, []
        for _ in range(args.single_rounds if n == 1 else 1):
            w, r = run_engine_burst(engine, reqs, frames)
            walls, eng = walls + w, eng + r
        naive_res += [run_naive(naive, prepare, r, frames) for r in picked[k // 2:]]
        e_xrt = sum(r.audio_s for r in eng) / walls
        n_xrt = sum(r.audio_s for r in naive_res) / sum(r.service for r in naive_res)
        # the naive server is sequential: request i waits for 0..i-1 (mean service of those served for real)
        mean_s = float(np.mean([r.service for r in naive_res]))
        naive_ttfa = [i * mean_s + mean_s for i in range(n)]
        rows.append(f"| {n} | engine | {e_xrt:.2f} | {np.mean([r.ttfa for r in eng]):.3f} | "
                    f"{_p90([r.ttfa for r in eng]):.3f} | {sum(r.audio_s for r in eng):.1f} | {walls:.2f} |")
        rows.append(f"| {n} | naive | {n_xrt:.2f} | {np.mean(naive_ttfa):.3f} | {_p90(naive_ttfa):.3f} | "
                    f"{sum(r.audio_s for r in naive_res):.1f} | {sum(r.service for r in naive_res):.2f} |")
        ratios[n] = e_xrt / n_xrt
        log(f"{n} streams: engine {e_xrt:.2f}x real time, naive {n_xrt:.2f}x, ratio {ratios[n]:.2f}")
    engine.shutdown()

    md = [
        "# engine_bench --model csm: engine vs naive CSM on CPU", "",
        *provenance.markdown_lines(info),
        "- model: tiny random CSM-1B architecture (backbone hidden 64 x 2 layers, depth 32 x 2, 32 Mimi codebooks, "
        "tiny Mimi), random weights, seed 0 (voxbackend.models.csm.tiny)",
        f"- dataset: {dataset}; request i: sentence i, speaker i % 2, seed {args.seed} + i; {frames} frames "
        f"({frames * FRAME_S:.2f} s) max per request; sampling temperature 0.9, top_k 50 (backbone and depth)",
        "- arrivals: a burst of N requests at t=0 (closed loop); engine policy " + args.policy,
        f"- naive: transformers {transformers.__version__} CsmForConditionalGeneration.generate, then its codec_model "
        "(Mimi) decodes the whole utterance; one request at a time; its TTFA under the burst is (i + 1) x its mean "
        "service time",
        f"- torch {torch.__version__}; x real time = audio s / wall s (higher is better); p90 = numpy linear", "",
        "| streams | system | x real time | TTFA mean (s) | TTFA p90 (s) | audio (s) | wall (s) |",
        "|---:|---|---:|---:|---:|---:|---:|",
        *rows, "",
        "Ratio engine/naive (x real time): " + ", ".join(f"{n} streams {r:.2f}x" for n, r in ratios.items()), "",
    ]
    text = "\n".join(md)
    print(text)
    out = args.out or Path(__file__).resolve().parent / "results" / provenance.result_filename("csm_bench", info)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    log(f"wrote {out}")
    return out
