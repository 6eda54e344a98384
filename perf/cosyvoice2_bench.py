"""Engine vs naive CosyVoice2 on CPU (`python perf/engine_bench.py --model cosyvoice2 [--quick]`).

The naive baseline is what an upstream CosyVoice2 user runs, one request at a time: the upstream LM
(`Qwen2LM.inference` on transformers' Qwen2ForCausalLM, sampling = cosyvoice2.yaml's ras_sampling), then the
upstream flow + HiFT through `CosyVoice2Model.tts(stream=False)` on the whole utterance. stream=False is the
default of `CosyVoice2Model.tts` and of every `CosyVoice2.inference_*` entry point; with it `tts` joins the LM
job and runs token2wav once on all tokens, which is what this baseline does without the thread, so its first
audio is its last. The engine serves a burst of N requests at once (batched LM, ras sampling on device, streamed
flow + HiFT windows, batched across requests). Both run the same tiny random checkpoint
(voxbackend.models.cosyvoice2.tiny), the same stored voice, the same token ids and the same length rules (min
2 x, max 20 x the text's tokens, both capped at the same --max-tokens). The reference is imported through
tests/cosyvoice_oracle.py (cosyvoice-minicpmo, installed --no-deps under the venv's oracles/).
"""
from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import provenance  # perf/provenance.py (engine_bench put perf/ on sys.path)
from burst import run_burst  # perf/burst.py

sys.path.insert(0, str(provenance.REPO_ROOT / "tests"))
SAMPLE_RATE = 24000
TOKEN_S = 0.04  # 25 Hz speech tokens


@dataclass
class Result:
    ttfa: float  # from the request's own start (engine: its submit in the burst; naive: its inference call)
    service: float  # to its last audio
    audio_s: float
    tokens: int  # speech tokens generated (the end id not counted)


@dataclass
class Job:
    """One request as both sides see it: the same token ids, voice arrays and length rules."""

    text_ids: list[int]
    min_tokens: int
    max_tokens: int
    seed: int
    prompt: object  # the engine's Prompt


def make_jobs(model, voice, n: int, prompts: list[str], seed: int, cap: int) -> list[Job]:
    """Request i: sentence i, the stored voice, seed + i; the reference's length rules capped at `cap` tokens."""
    transcript = model.text_tokenizer.encode(voice.transcript)
    speech = voice.speech_tokens.tolist()
    jobs = []
    for i in range(n):
        text_ids = model.text_tokenizer.encode(prompts[i % len(prompts)])
        prompt = model.build_prompt(text_ids, transcript, speech, voice.speech_feat.numpy(), voice.embedding.numpy())
        prompt = dataclasses.replace(prompt, max_tokens=min(prompt.max_tokens, cap))
        jobs.append(Job(text_ids, prompt.min_tokens, prompt.max_tokens, seed + i, prompt))
    return jobs


class Naive:
    """Upstream Qwen2LM + CosyVoice2Model (flow + HiFT) on the checkpoint's files, loaded strictly."""

    def __init__(self, model_dir: Path, codec_cfg, voice):
        import torch

        from cosyvoice_oracle import upstream_cosyvoice2_model, upstream_qwen2lm, upstream_ras_sampling

        self.lm = upstream_qwen2lm(model_dir, sampling=upstream_ras_sampling())
        self.lm.sampling_ids = self._sampling_ids
        self.pipeline = upstream_cosyvoice2_model(model_dir, codec_cfg)
        self.voice = voice
        self.torch = torch

    def _sampling_ids(self, scores, decoded: list[int], top_k: int, ignore_eos: bool = True):
        # Upstream redraws while the end id comes before min_len and raises after 100 draws. Random weights often
        # give the end id more than top-p 0.8 alone, so every redraw is the end id again: like the engine, mask
        # it instead (ras then draws from the same distribution on both sides).
        if ignore_eos:
            scores = scores.clone()
            scores[self.lm.speech_token_size] = float("-inf")
        return self.lm.sampling(scores, decoded, top_k)

    def run(self, job: Job, transcript: list[int]) -> Result:
        torch, v = self.torch, self.voice
        t = lambda ids: torch.tensor([ids], dtype=torch.int32)  # noqa: E731
        n_text = len(job.text_ids)
        torch.manual_seed(job.seed)
        t0 = time.perf_counter()
        # upstream's ratios give int(n_text x ratio): these give exactly our min_tokens and max_tokens
        tokens = [int(x) for x in self.lm.inference(
            text=t(job.text_ids), text_len=torch.tensor([n_text]), prompt_text=t(transcript),
            prompt_text_len=torch.tensor([len(transcript)]), prompt_speech_token=v.speech_tokens[None].int(),
            prompt_speech_token_len=torch.tensor([len(v.speech_tokens)]), embedding=torch.zeros(1, 192),
            min_token_text_ratio=(job.min_tokens + 0.5) / n_text, max_token_text_ratio=(job.max_tokens + 0.5) / n_text)]
        chunks = [c["tts_speech"][0] for c in self.pipeline.tts(
            source_speech_token=t(tokens), flow_prompt_speech_token=v.speech_tokens[None].int(),
            prompt_speech_feat=v.speech_feat[None], flow_embedding=v.embedding[None], stream=False)]
        wall = time.perf_counter() - t0
        return Result(wall, wall, sum(len(c) for c in chunks) / SAMPLE_RATE, len(tokens))

    def run_streaming(self, job: Job, transcript: list[int]) -> Result:
        """The upstream streaming path: tts(text=..., stream=True) runs its llm_job (the same LM inference) in a
        thread and windows the tokens as they come (polling every 0.1 s, as upstream does)."""
        torch, v = self.torch, self.voice
        t = lambda ids: torch.tensor([ids], dtype=torch.int32)  # noqa: E731
        n_text = len(job.text_ids)
        lm = self.lm
        tokens: list[int] = []

        def inference(**kw):  # llm_job calls llm.inference(...); these are the same length rules as run()
            for x in lm.inference(**kw, min_token_text_ratio=(job.min_tokens + 0.5) / n_text,
                                  max_token_text_ratio=(job.max_tokens + 0.5) / n_text):
                tokens.append(int(x))
                yield x

        self.pipeline.llm = type("LM", (), {"inference": staticmethod(inference)})()  # the fork drops its llm
        torch.manual_seed(job.seed)
        first, samples = None, 0
        t0 = time.perf_counter()
        for c in self.pipeline.tts(text=t(job.text_ids), prompt_text=t(transcript),
                                   llm_prompt_speech_token=v.speech_tokens[None].int(),
                                   flow_prompt_speech_token=v.speech_tokens[None].int(),
                                   prompt_speech_feat=v.speech_feat[None], flow_embedding=v.embedding[None],
                                   llm_embedding=torch.zeros(1, 192), stream=True):
            first = first or time.perf_counter() - t0
            samples += c["tts_speech"].shape[1]
        wall = time.perf_counter() - t0
        return Result(first if first is not None else wall, wall, samples / SAMPLE_RATE, len(tokens))


def run_engine_burst(engine, jobs: list[Job]) -> tuple[float, list[Result]]:
    defaults = engine.model.default_sampling()
    wall, done = run_burst(engine, [(j.prompt, dataclasses.replace(defaults, max_tokens=j.max_tokens, seed=j.seed))
                                    for j in jobs])
    stop = engine.model.is_stop
    return wall, [Result(r.ttfa, r.service, r.samples / SAMPLE_RATE,
                         sum(1 for t in r.final.token_ids or [] if not stop(t))) for r in done]


class Timers:
    """Wall seconds inside the engine's LM forward, the flow and HiFT (CPU torch is synchronous)."""

    def __init__(self, engine):
        self.total: dict[str, float] = {}
        codec = engine.model.codec
        self._wrap(engine.model, "forward", "LM forward")
        self._wrap(codec.flow, "forward", "flow")  # nn.Module.__call__ looks forward up on the instance
        self._wrap(codec, "_vocode", "HiFT")

    def _wrap(self, owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[name] = self.total.get(name, 0.0) + time.perf_counter() - t0

        setattr(owner, attr, timed)

    def shares(self, wall: float) -> str:
        parts = [f"{k} {100 * v / wall:.0f}%" for k, v in self.total.items()]
        return ", ".join(parts + [f"elsewhere {100 * (wall - sum(self.total.values())) / wall:.0f}%"])


def _p90(xs: list[float]) -> float:
    return float(np.percentile(xs, 90)) if xs else float("nan")


def _row(n: int, system: str, xrt: float, ttfa: list[float], res: list[Result], wall: float) -> str:
    return (f"| {n} | {system} | {xrt:.2f} | {np.mean(ttfa):.3f} | {_p90(ttfa):.3f} | "
            f"{np.mean([r.tokens for r in res]):.1f} | {sum(r.audio_s for r in res):.1f} | {wall:.2f} |")


def run(args, prompts: list[str], dataset: str, log) -> Path:
    import torch

    import voxbackend
    from voxbackend.models.cosyvoice2.cloning import VoicePrompt
    from voxbackend.models.cosyvoice2.tiny import DEFAULT_VOICE, ensure_default_cosyvoice2

    info = provenance.collect()
    started = time.perf_counter()
    cap = args.max_tokens
    cache = args.cache_dir or Path.home() / ".cache" / "voxbackend" / "bench"
    model_dir, _ = ensure_default_cosyvoice2(cache / "cosyvoice2-tiny")
    log(f"CosyVoice2 tiny checkpoint {model_dir}; at most {cap} tokens per request; streams {args.stream_counts}")
    n_max = max(args.stream_counts)
    engine = voxbackend.load(model_dir, policy=args.policy, max_batch=max(32, n_max), page_size=16,
                             kv_pages=max(1024, n_max * ((cap + 160) // 16 + 2)))
    engine.start()
    voice = VoicePrompt.load(model_dir / "voices" / f"{DEFAULT_VOICE}.safetensors")
    transcript = engine.model.text_tokenizer.encode(voice.transcript)
    naive = Naive(model_dir, engine.model.codec.cfg, voice)
    log("warm-up (not measured)")
    warm = make_jobs(engine.model, voice, 1, ["Hello there."], 1, 8)
    naive.run(warm[0], transcript)
    naive.run_streaming(warm[0], transcript)
    run_engine_burst(engine, warm)
    timers = Timers(engine)

    rows, ratios, stream_ratios, shares = [], {}, {}, []
    for n in args.stream_counts:
        jobs = make_jobs(engine.model, voice, n, prompts, args.seed, cap)
        # naive is sequential: a few requests served for real (spread over the burst), half before and half after
        # the engine burst, since the shared machine drifts; at 1 stream both sides serve single_rounds requests
        k = args.single_rounds if n == 1 else min(n, args.naive_requests)
        picked = [jobs[round(j * (n - 1) / max(1, k - 1))] for j in range(k)]
        naive_res = [naive.run(j, transcript) for j in picked[: k // 2]]
        stream_res = [naive.run_streaming(j, transcript) for j in picked[: k // 2]]
        walls, eng = 0.0, []
        timers.total.clear()
        for _ in range(args.single_rounds if n == 1 else 1):
            w, r = run_engine_burst(engine, jobs)
            walls, eng = walls + w, eng + r
        shares.append(f"- {n} streams: {timers.shares(walls)} of the engine's {walls:.1f} s")
        stream_res += [naive.run_streaming(j, transcript) for j in picked[k // 2:]]
        naive_res += [naive.run(j, transcript) for j in picked[k // 2:]]
        e_xrt = sum(r.audio_s for r in eng) / walls
        rows.append(_row(n, "engine", e_xrt, [r.ttfa for r in eng], eng, walls))
        xrt = {}
        for system, res in (("naive", naive_res), ("naive stream=True", stream_res)):
            wall = sum(r.service for r in res)
            xrt[system] = sum(r.audio_s for r in res) / wall
            mean_s, mean_t = float(np.mean([r.service for r in res])), float(np.mean([r.ttfa for r in res]))
            queued = [i * mean_s + mean_t for i in range(n)]  # request i waits for 0..i-1, then its own TTFA
            rows.append(_row(n, system, xrt[system], queued, res, wall))
        ratios[n] = e_xrt / xrt["naive"]
        stream_ratios[n] = e_xrt / xrt["naive stream=True"]
        log(f"{n} streams: engine {e_xrt:.2f}x real time, naive {xrt['naive']:.2f}x (ratio {ratios[n]:.2f}), "
            f"naive streaming {xrt['naive stream=True']:.2f}x (ratio {stream_ratios[n]:.2f})")
    engine.shutdown()

    g = engine.model.cfg
    cmd = " ".join(sys.argv[1:])
    md = [
        "# engine_bench --model cosyvoice2: engine vs naive CosyVoice2 on CPU", "",
        *provenance.markdown_lines(info),
        f"- load average at end: {provenance.load_average()} (the machine is shared: compare ratios, not absolutes)",
        f"- model: tiny random CosyVoice2-0.5B architecture (Qwen2 LM hidden {g.hidden_size} x {g.num_layers} "
        "layers, the real 6561 + 3 speech ids; tiny flow + HiFT at the real 25 Hz / 24 kHz timing), random "
        "weights, seed 0 (voxbackend.models.cosyvoice2.tiny); voice: its stored voice " + DEFAULT_VOICE,
        f"- dataset: {dataset}; request i: sentence i, seed {args.seed} + i; length rules of the reference (min 2 x, "
        f"max 20 x the text's tokens) capped at {cap} tokens ({cap * TOKEN_S:.2f} s); sampling: ras (top-p 0.8, "
        "top-k 25, window 10, tau_r 0.1) on both sides, the end id masked before min_len on both (upstream redraws "
        "instead, and gives up after 100 draws: on random weights the end id alone often holds top-p 0.8); each "
        "side draws its own random numbers, so equal seeds give equally distributed, not identical, tokens "
        "(compare the tokens column)",
        "- arrivals: a burst of N requests at t=0 (closed loop); engine policy " + args.policy + "; engine codec "
        "windows as the reference's streaming cuts them (25 + pad tokens, then 25, 3 of lookahead)",
        "- naive: cosyvoice-minicpmo Qwen2LM.inference (transformers Qwen2ForCausalLM, ras_sampling), then "
        "CosyVoice2Model.tts(stream=False) (the default of tts and of every CosyVoice2.inference_* call) on the "
        "whole utterance, so its first audio is its last; one request at a time. The ratio is against it",
        "- naive stream=True (for reference): CosyVoice2Model.tts(text=..., stream=True), the same LM in "
        "upstream's llm_job thread, windows cut as the engine cuts them (upstream polls every 0.1 s); one request "
        "at a time",
        "- naive TTFA under the burst: request i waits for 0..i-1 to be served, TTFA_i = i x mean service + mean "
        "own TTFA (stream=False: own TTFA = service)",
        f"- torch {torch.__version__}; x real time = audio s / wall s (higher is better); p90 = numpy linear; "
        f"tokens = speech tokens per request (mean); whole run {time.perf_counter() - started:.0f} s; command: "
        f"`python perf/engine_bench.py {cmd}`", "",
        "| streams | system | x real time | TTFA mean (s) | TTFA p90 (s) | tokens | audio (s) | wall (s) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
        *rows, "",
        "Ratio engine/naive (x real time): " + ", ".join(f"{n} streams {r:.2f}x" for n, r in ratios.items()), "",
        "Ratio engine/naive stream=True (x real time): "
        + ", ".join(f"{n} streams {r:.2f}x" for n, r in stream_ratios.items()), "",
        "Where the engine's wall goes (wrapped calls, every burst above):", "", *shares, "",
    ]
    text = "\n".join(md)
    print(text)
    out = args.out or Path(__file__).resolve().parent / "results" / provenance.result_filename("cosyvoice2_bench",
                                                                                             info)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    log(f"wrote {out}")
    return out
