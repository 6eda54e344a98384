"""Engine vs naive Qwen3-TTS on CPU (`python perf/engine_bench.py --model qwen3_tts [--quick]`).

The naive baseline is what a qwen-tts user runs: the reference `Qwen3TTSForConditionalGeneration.generate`
(non_streaming_mode=False: the dual track; talker and code predictor, one request at a time), then the reference
12 Hz decoder on the whole utterance, so its first audio is its last. The engine serves a burst of N requests at
once (batched talker, on-device code predictor, exactly streaming codec windows from the first frame). Both run
the same tiny random CustomVoice checkpoint (voxbackend.models.qwen3_tts.tiny) with the official sampling defaults
(temperature 0.9, top-k 50, top-p 1, repetition penalty 1.05; the predictor the same without penalty) and the same
frame budget. The reference is imported through tests/qwen_tts_oracle.py (qwen-tts-hf, installed --no-deps).
"""
from __future__ import annotations

import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import provenance  # perf/provenance.py (engine_bench put perf/ on sys.path)
from burst import run_burst  # perf/burst.py

sys.path.insert(0, str(provenance.REPO_ROOT / "tests"))
SAMPLE_RATE = 24000
FRAME_S = 0.08
VOICES = ("vivian", "ryan")


@dataclass
class Result:
    ttfa: float  # from the request's own start (engine: its submit in the burst; naive: its generate call)
    service: float  # to its last audio
    audio_s: float


def requests(n: int, prompts: list[str], seed: int) -> list[tuple[str, str, int]]:
    """(text, voice, seed) of request i: sentence i, voices alternate, seeds differ."""
    return [(prompts[i % len(prompts)], VOICES[i % 2], seed + i) for i in range(n)]


class Naive:
    """The reference model, processor and decoder on the tiny checkpoint (weights loaded strictly)."""

    def __init__(self, model_dir: Path):
        import torch
        from safetensors.torch import load_file
        from transformers import AutoTokenizer

        from qwen_tts_oracle import import_qwen_tts, reference_rope  # tests/qwen_tts_oracle.py
        from voxbackend.components.mimi.weights import read_codec_tensors

        import_qwen_tts()
        from qwen_tts.core import Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model
        from qwen_tts.core.models import configuration_qwen3_tts, modeling_qwen3_tts
        from qwen_tts.core.models.processing_qwen3_tts import Qwen3TTSProcessor
        from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Decoder

        config = configuration_qwen3_tts.Qwen3TTSConfig.from_pretrained(model_dir)
        codec_dir = model_dir / "speech_tokenizer"
        codec_cfg = Qwen3TTSTokenizerV2Config.from_pretrained(codec_dir)
        with reference_rope():
            self.model = modeling_qwen3_tts.Qwen3TTSForConditionalGeneration(config).eval()
            decoder = Qwen3TTSTokenizerV2Decoder._from_config(codec_cfg.decoder_config).eval()
        self.model.load_state_dict(load_file(str(model_dir / "model.safetensors")), strict=True)
        decoder.load_state_dict(read_codec_tensors(codec_dir, "decoder."), strict=True)
        self.codec = types.SimpleNamespace(decoder=decoder, decode_upsample_rate=codec_cfg.decode_upsample_rate,
                                           config=codec_cfg)
        self.decode = Qwen3TTSTokenizerV2Model.decode
        self.processor = Qwen3TTSProcessor(tokenizer=AutoTokenizer.from_pretrained(str(model_dir)))
        self.torch = torch

    def run(self, req: tuple[str, str, int], frames: int) -> Result:
        torch = self.torch
        text, voice, seed = req
        template = f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        with torch.inference_mode():
            ids = self.processor(text=template, return_tensors="pt")["input_ids"]
            codes, _ = self.model.generate(input_ids=[ids], languages=["auto"], speakers=[voice],
                                           non_streaming_mode=False, max_new_tokens=frames)
            audio = self.decode(self.codec, codes[0][None]).audio_values[0] if len(codes[0]) else torch.zeros(0)
        wall = time.perf_counter() - t0
        return Result(wall, wall, audio.numel() / SAMPLE_RATE)


def run_engine_burst(engine, reqs: list[tuple[str, str, int]], frames: int) -> tuple[float, list[Result]]:
    import dataclasses

    defaults = engine.model.default_sampling()
    wall, done = run_burst(engine, [(engine.model.prepare(text, voice),
                                     dataclasses.replace(defaults, max_tokens=frames, seed=seed))
                                    for text, voice, seed in reqs])
    return wall, [Result(r.ttfa, r.service, r.samples / SAMPLE_RATE) for r in done]


def _p90(xs: list[float]) -> float:
    return float(np.percentile(xs, 90)) if xs else float("nan")


def run(args, prompts: list[str], dataset: str, log) -> Path:
    import torch

    import voxbackend
    from voxbackend.models.qwen3_tts.tiny import ensure_default_qwen3_tts

    info = provenance.collect()
    frames = args.max_tokens  # one talker step per 80 ms frame
    cache = args.cache_dir or Path.home() / ".cache" / "voxbackend" / "bench"
    model_dir, _ = ensure_default_qwen3_tts(cache / "qwen3-tts-tiny")
    log(f"Qwen3-TTS tiny checkpoint {model_dir}; {frames} frames per request; streams {args.stream_counts}")
    n_max = max(args.stream_counts)
    engine = voxbackend.load(model_dir, policy=args.policy, max_batch=max(32, n_max), page_size=16,
                             kv_pages=max(1024, n_max * ((frames + 96) // 16 + 2)))
    engine.start()
    naive = Naive(model_dir)
    log("warm-up (not measured)")
    naive.run(("Hello there.", "ryan", 1), 4)
    run_engine_burst(engine, [("Hello there.", "ryan", 1)], 4)

    rows, ratios = [], {}
    for n in args.stream_counts:
        reqs = requests(n, prompts, args.seed)
        # naive is sequential: a few requests served for real (spread over the burst), half before and half after
        # the engine burst, since the shared machine drifts; at 1 stream both sides serve single_rounds requests
        k = args.single_rounds if n == 1 else min(n, args.naive_requests)
        picked = [reqs[round(j * (n - 1) / max(1, k - 1))] for j in range(k)]
        naive_res = [naive.run(r, frames) for r in picked[: k // 2]]
        walls, eng = 0.0, []
        for _ in range(args.single_rounds if n == 1 else 1):
            w, r = run_engine_burst(engine, reqs, frames)
            walls, eng = walls + w, eng + r
        naive_res += [naive.run(r, frames) for r in picked[k // 2:]]
        e_xrt = sum(r.audio_s for r in eng) / walls
        n_xrt = sum(r.audio_s for r in naive_res) / sum(r.service for r in naive_res)
        mean_s = float(np.mean([r.service for r in naive_res]))
        naive_ttfa = [i * mean_s + mean_s for i in range(n)]  # request i waits for 0..i-1
        rows.append(f"| {n} | engine | {e_xrt:.2f} | {np.mean([r.ttfa for r in eng]):.3f} | "
                    f"{_p90([r.ttfa for r in eng]):.3f} | {sum(r.audio_s for r in eng):.1f} | {walls:.2f} |")
        rows.append(f"| {n} | naive | {n_xrt:.2f} | {np.mean(naive_ttfa):.3f} | {_p90(naive_ttfa):.3f} | "
                    f"{sum(r.audio_s for r in naive_res):.1f} | {sum(r.service for r in naive_res):.2f} |")
        ratios[n] = e_xrt / n_xrt
        log(f"{n} streams: engine {e_xrt:.2f}x real time, naive {n_xrt:.2f}x, ratio {ratios[n]:.2f}")
    engine.shutdown()

    md = [
        "# engine_bench --model qwen3_tts: engine vs naive Qwen3-TTS on CPU", "",
        *provenance.markdown_lines(info),
        "- model: tiny random Qwen3-TTS-12Hz CustomVoice architecture (talker hidden 64 x 2 layers, code predictor "
        "32 x 1, 16 codebooks, tiny 12 Hz codec at the real 24 kHz / 1920-sample timing), random weights, seed 0 "
        "(voxbackend.models.qwen3_tts.tiny)",
        f"- dataset: {dataset}; request i: sentence i, voice {VOICES[0]} / {VOICES[1]} alternating, language auto, "
        f"seed {args.seed} + i; {frames} frames ({frames * FRAME_S:.2f} s) max per request; official sampling "
        "defaults (temperature 0.9, top-k 50, top-p 1, repetition penalty 1.05)",
        "- arrivals: a burst of N requests at t=0 (closed loop); engine policy " + args.policy + "; engine codec "
        "windows: the first frame alone, then 4 frames",
        "- naive: qwen-tts-hf Qwen3TTSForConditionalGeneration.generate(non_streaming_mode=False), then the reference "
        "12 Hz decoder on the whole utterance; one request at a time; its TTFA under the burst is (i + 1) x its "
        "mean service time",
        f"- torch {torch.__version__}; x real time = audio s / wall s (higher is better); p90 = numpy linear", "",
        "| streams | system | x real time | TTFA mean (s) | TTFA p90 (s) | audio (s) | wall (s) |",
        "|---:|---|---:|---:|---:|---:|---:|",
        *rows, "",
        "Ratio engine/naive (x real time): " + ", ".join(f"{n} streams {r:.2f}x" for n, r in ratios.items()), "",
    ]
    text = "\n".join(md)
    print(text)
    out = args.out or Path(__file__).resolve().parent / "results" / provenance.result_filename("qwen3_tts_bench",
                                                                                             info)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    log(f"wrote {out}")
    return out
