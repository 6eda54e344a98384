"""Engine vs the Chatterbox reference on CPU (`python perf/engine_bench.py --model chatterbox [--quick]`).

The reference is what a user of `chatterbox-tts` 0.1.7 gets from `ChatterboxTTS.generate`, one request at a time:
upstream `T3.inference` (guided, sampled, its default parameters: cfg_weight 0.5, temperature 0.8, min_p 0.05,
top_p 1.0, repetition_penalty 1.2), the tokens >= 6561 dropped, then upstream `S3Token2Wav.inference` on the whole
utterance, so its first audio is its last (0.1.7 has no streaming). The engine serves a burst of N requests at once
(batched guided LM, sampling on device, streamed S3Gen windows batched across requests). Both run the same tiny
random checkpoint (voxbackend.models.chatterbox.tiny), its built-in voice (conds.pt, which upstream's
`Conditionals.load` reads the same way), the same text ids and the same token cap. Upstream is imported through
tests/chatterbox_oracle.py and tests/chatterbox_s3gen_oracle.py (installed --no-deps under the venv's oracles/).
"""
from __future__ import annotations

import dataclasses
import functools
import json
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
    ttfa: float  # from the request's own start (engine: its submit in the burst; reference: its inference call)
    service: float  # to its last audio
    audio_s: float
    tokens: int  # LM tokens sampled, the stop id included


@dataclass
class Job:
    """One request as both sides see it: the engine's prompt and the text ids inside it."""

    text_ids: list[int]  # start and end ids included
    seed: int
    prompt: object  # the engine's Prompt


def make_jobs(model, n: int, prompts: list[str], seed: int) -> list[Job]:
    """Request i: sentence i, the built-in voice, seed + i."""
    from voxbackend.models.chatterbox.t3_lm import COND_ROWS

    jobs = []
    for i in range(n):
        prompt = model.prepare(prompts[i % len(prompts)])
        jobs.append(Job(prompt.ids[COND_ROWS:-2], seed + i, prompt))  # [start, text..., end]
    return jobs


def upstream_s3gen(model_dir: Path, cfg):
    """Upstream S3Token2Wav at the checkpoint's sizes (cfg: our Token2WavConfig, read from s3gen.json), its flow and
    HiFT loaded strictly from s3gen.safetensors. Upstream hard-codes the official sizes (512 in its lookahead and
    upsample layers, 4 up blocks): its constructors are given ours while it builds. The voice front end (S3
    tokenizer, CAMPPlus) is stood in: `inference(ref_dict=...)` never calls it."""
    import torch
    from safetensors import safe_open

    from chatterbox_s3gen_oracle import load_s3gen

    up = load_s3gen()
    s3 = up.s3gen
    enc_mod = sys.modules[s3.UpsampleConformerEncoder.__module__]
    e, est, h = cfg.flow.encoder, cfg.flow.estimator, cfg.hift
    enc_cls, dec_cls, flow_cls = s3.UpsampleConformerEncoder, s3.ConditionalDecoder, s3.CausalMaskedDiffWithXvec
    hift_cls, f0_cls = s3.HiFTGenerator, s3.ConvRNNF0Predictor
    lookahead_cls, upsample_cls = enc_mod.PreLookaheadLayer, enc_mod.Upsample1D
    patches = {
        (s3, "UpsampleConformerEncoder"): lambda **kw: enc_cls(**{**kw, "input_size": e.size, "output_size": e.size,
                                                                  "attention_heads": e.heads,
                                                                  "linear_units": e.linear_units,
                                                                  "num_blocks": e.num_blocks}),
        (s3, "ConditionalDecoder"): lambda **kw: dec_cls(**{**kw, "channels": list(est.channels),
                                                            "attention_head_dim": est.attention_head_dim,
                                                            "n_blocks": est.n_blocks,
                                                            "num_mid_blocks": est.num_mid_blocks,
                                                            "num_heads": est.num_heads}),
        (s3, "CausalMaskedDiffWithXvec"): functools.partial(flow_cls, input_size=e.size),
        (s3, "HiFTGenerator"): functools.partial(hift_cls, base_channels=h.base_channels),
        (s3, "ConvRNNF0Predictor"): functools.partial(f0_cls, cond_channels=h.f0_channels),
        (s3, "S3Tokenizer"): lambda *a, **kw: torch.nn.Linear(1, 1),  # `device` reads its parameters
        (s3, "CAMPPlus"): lambda *a, **kw: torch.nn.Module(),
        (enc_mod, "PreLookaheadLayer"): lambda channels, pre_lookahead_len: lookahead_cls(e.size, pre_lookahead_len),
        (enc_mod, "Upsample1D"): lambda channels, out_channels, stride: upsample_cls(e.size, e.size, stride),
    }
    saved = {key: getattr(*key) for key in patches}
    for (owner, name), value in patches.items():
        setattr(owner, name, value)
    try:
        with torch.random.fork_rng():
            model = up.S3Token2Wav()
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)
    enc = model.flow.encoder
    enc.up_encoders = torch.nn.ModuleList(list(enc.up_encoders)[:e.num_up_blocks])
    with safe_open(str(model_dir / "s3gen.safetensors"), "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    for prefix, module in (("flow.", model.flow), ("mel2wav.", model.mel2wav)):
        module.load_state_dict({k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)},
                               strict=True)
    return model.eval()


class Reference:
    """Upstream T3 + S3Token2Wav on the checkpoint's files, `ChatterboxTTS.generate`'s steps."""

    def __init__(self, model_dir: Path, codec_cfg):
        import torch
        from safetensors.torch import load_file

        from chatterbox_oracle import upstream_t3
        from voxbackend.models.chatterbox.t3_lm import WEIGHTS_FILE

        self.oracle, self.t3 = upstream_t3(json.loads((model_dir / "t3.json").read_text()),
                                           load_file(str(model_dir / WEIGHTS_FILE)))
        # its sampling loop runs under a tqdm bar: kept (its cost is the user's), not drawn on the log
        self.oracle.t3.tqdm = functools.partial(self.oracle.t3.tqdm, disable=True)
        self.s3gen = upstream_s3gen(model_dir, codec_cfg)
        conds = torch.load(model_dir / "conds.pt", map_location="cpu", weights_only=True)  # Conditionals.load
        self.cond = self.oracle.T3Cond(**conds["t3"])
        self.ref_dict = conds["gen"]
        self.torch = torch

    def run(self, job: Job, max_tokens: int) -> Result:
        torch = self.torch
        ids = torch.tensor([job.text_ids, job.text_ids])  # generate(): the text twice, for guidance
        torch.manual_seed(job.seed)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.t3.inference(t3_cond=self.cond, text_tokens=ids, max_new_tokens=max_tokens, cfg_weight=0.5,
                                    temperature=0.8, repetition_penalty=1.2, min_p=0.05, top_p=1.0)[0]
            tokens = out[out < 6561]  # drop_invalid_tokens, then the < 6561 filter
            samples = 0
            if len(tokens):  # random weights may stop at once: upstream S3Gen cannot take 0 tokens
                wav, _ = self.s3gen.inference(speech_tokens=tokens, ref_dict=dict(self.ref_dict))
                samples = wav.shape[-1]
        wall = time.perf_counter() - t0
        return Result(wall, wall, samples / SAMPLE_RATE, len(out))


def run_engine_burst(engine, jobs: list[Job], max_tokens: int) -> tuple[float, list[Result]]:
    defaults = engine.model.default_sampling()
    wall, done = run_burst(engine, [(j.prompt, dataclasses.replace(defaults, max_tokens=max_tokens, seed=j.seed))
                                    for j in jobs])
    return wall, [Result(r.ttfa, r.service, r.samples / SAMPLE_RATE, len(r.final.token_ids or [])) for r in done]


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


@dataclass
class Row:
    streams: int
    system: str
    measured: str
    xrt: float  # audio s / wall s
    tok_s: float  # LM tokens (stop included) / wall s
    ttfa: list[float]
    tokens: float  # mean per request
    audio_s: float
    wall: float


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def row(n: int, system: str, measured: str, ttfa: list[float], res: list[Result], wall: float) -> Row:
    audio = sum(r.audio_s for r in res)
    return Row(n, system, measured, audio / wall, sum(r.tokens for r in res) / wall, ttfa,
               float(np.mean([r.tokens for r in res])), audio, wall)


def table(rows: list[Row], ratios: dict[int, float]) -> list[str]:
    lines = ["| streams | system | requests measured | x real time | tokens/s | TTFA p50 (s) | TTFA p90 (s) | "
             "tokens / request | audio (s) | wall (s) | ratio engine/reference |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = f"**{ratios[r.streams]:.2f}x**" if r.system == "engine" else "1.00"
        lines.append(f"| {r.streams} | {r.system} | {r.measured} | {r.xrt:.3f} | {r.tok_s:.1f} | "
                     f"{_pct(r.ttfa, 50):.3f} | {_pct(r.ttfa, 90):.3f} | {r.tokens:.1f} | {r.audio_s:.1f} | "
                     f"{r.wall:.2f} | {ratio} |")
    return lines


def measure(engine, ref: Reference, timers: Timers, n: int, prompts: list[str], args, log) -> tuple[Row, Row, str]:
    """One stream count: the reference serves a few of the burst's requests for real (spread over it), half before
    and half after the engine burst, since the shared machine drifts; at 1 stream both serve single_rounds."""
    cap = args.max_tokens
    jobs = make_jobs(engine.model, n, prompts, args.seed)
    k = args.single_rounds if n == 1 else min(n, args.naive_requests)
    picked = [jobs[round(j * (n - 1) / max(1, k - 1))] for j in range(k)]
    ref_res = [ref.run(j, cap) for j in picked[: k // 2]]
    walls, eng = 0.0, []
    timers.total.clear()
    for _ in range(args.single_rounds if n == 1 else 1):
        w, r = run_engine_burst(engine, jobs, cap)
        walls, eng = walls + w, eng + r
    share = f"- {n} streams: {timers.shares(walls)} of the engine's {walls:.1f} s"
    ref_res += [ref.run(j, cap) for j in picked[k // 2:]]
    rounds = args.single_rounds if n == 1 else 1
    engine_row = row(n, "engine", f"{len(eng)} ({rounds} burst{'s' if rounds > 1 else ''} of {n})",
                     [r.ttfa for r in eng if r.audio_s > 0], eng, walls)
    ref_wall = sum(r.service for r in ref_res)
    mean_s = float(np.mean([r.service for r in ref_res]))
    # request i waits for 0..i-1 to be served, then its own (whole-utterance) service: its first audio is its last
    queued = [i * mean_s + mean_s for i in range(n)] if n > 1 else [r.ttfa for r in ref_res if r.audio_s > 0]
    measured = f"{k} one at a time" if n == 1 else f"{k} served, {n - k} extrapolated"
    ref_row = row(n, "reference", measured, queued, ref_res, ref_wall)
    log(f"{n} streams: engine {engine_row.xrt:.2f}x real time, reference {ref_row.xrt:.2f}x "
        f"(ratio {engine_row.xrt / ref_row.xrt:.2f})")
    return engine_row, ref_row, share


def run(args, prompts: list[str], dataset: str, log) -> Path:
    import torch

    import voxbackend
    from voxbackend.models.chatterbox.tiny import ensure_default_chatterbox

    info = provenance.collect()
    started = time.perf_counter()
    cap = args.max_tokens
    cache = args.cache_dir or Path.home() / ".cache" / "voxbackend" / "bench"
    model_dir, _ = ensure_default_chatterbox(cache / "chatterbox-tiny")
    log(f"Chatterbox tiny checkpoint {model_dir}; at most {cap} tokens per request; streams {args.stream_counts}")
    n_max = max(args.stream_counts)
    # a guided request holds two rows of KV pages (conditioned and unconditioned); room for the whole burst at once
    longest = max(len(p) for p in prompts)  # letter-level tiny tokenizer: at most one id per character
    per_request = 2 * ((34 + longest + 4 + cap) // 16 + 2)
    engine = voxbackend.load(model_dir, policy=args.policy, max_batch=max(32, n_max), page_size=16,
                             kv_pages=max(1024, n_max * per_request))
    engine.start()
    ref = Reference(model_dir, engine.model.codec.cfg)
    log("warm-up (not measured)")
    warm = make_jobs(engine.model, 1, ["Hello there."], 1)
    ref.run(warm[0], min(cap, 40))
    run_engine_burst(engine, warm, min(cap, 40))
    timers = Timers(engine)

    rows, ratios, shares = [], {}, []
    for n in args.stream_counts:
        engine_row, ref_row, share = measure(engine, ref, timers, n, prompts, args, log)
        rows += [engine_row, ref_row]
        ratios[n] = engine_row.xrt / ref_row.xrt
        shares.append(share)
    engine.shutdown()

    g, lm_params = engine.model.cfg, sum(p.numel() for p in engine.model.lm.parameters())
    codec = engine.model.codec.cfg
    enc, est = codec.flow.encoder, codec.flow.estimator
    codec_params = sum(p.numel() for m in (engine.model.codec.flow, engine.model.codec.hift) for p in m.parameters())
    ttfa = {r.streams: r for r in rows if r.system == "engine"}
    sooner = {r.streams: _pct(r.ttfa, 50) / _pct(ttfa[r.streams].ttfa, 50) for r in rows if r.system == "reference"}
    cmd = " ".join(sys.argv[1:])
    md = [
        "# engine_bench --model chatterbox: engine vs the Chatterbox reference on CPU", "",
        *provenance.markdown_lines(info),
        f"- load average at end: {provenance.load_average()} (the machine is shared: compare ratios, not absolutes)",
        f"- model: tiny random Chatterbox (T3: Llama hidden {g.hidden_size} x {g.num_layers} layers, the real 704 "
        f"text / 8194 speech ids and positions, {lm_params / 1e6:.1f}M parameters; S3Gen: flow encoder "
        f"{enc.size} x {enc.num_blocks} blocks, estimator channels {list(est.channels)}, "
        f"HiFT {codec.hift.base_channels} channels, {codec_params / 1e6:.2f}M parameters, the real 25 Hz / 24 kHz "
        "timing and 10 Euler steps with guidance)",
        f"- weights: random, seed 0 (voxbackend.models.chatterbox.tiny), cached at {model_dir}; voice: its built-in "
        "conds.pt",
        f"- dataset: {dataset}; request i: sentence i, seed {args.seed} + i, the same text ids on both sides",
        f"- sampling (both): the reference's defaults, cfg_weight 0.5, temperature 0.8, min_p 0.05, top_p 1.0, "
        f"repetition_penalty 1.2; at most {cap} tokens ({cap * TOKEN_S:.2f} s) per request (upstream generate: 1000); "
        "each side draws its own random numbers, so equal seeds give equally distributed, not identical, tokens "
        "(compare the tokens column); random weights sometimes stop at once",
        f"- arrivals: a burst of N requests at t=0 (closed loop); engine policy {args.policy}; engine S3Gen windows "
        "of 25 tokens + 3 lookahead, re-encoding prompt + all tokens so far",
        "- reference: chatterbox-tts 0.1.7 `ChatterboxTTS.generate`'s steps (its text normalisation and watermark "
        "left out: both sides read the same ids, the engine has no watermark): `T3.inference` (transformers "
        "LlamaModel, guidance batch of 2), tokens >= 6561 dropped, `S3Token2Wav.inference` on the whole utterance; "
        "one request at a time. Upstream S3Gen hard-codes the official sizes; it is built at the checkpoint's "
        "(s3gen.json) and loaded strictly",
        "- reference TTFA under the burst: request i waits for 0..i-1, TTFA_i = (i + 1) x mean service (its first "
        "audio is its last); at 1 stream its own service. Requests with no audio are left out of TTFA",
        f"- torch {torch.__version__}, {torch.get_num_threads()} intra-op threads; x real time = audio s / wall s "
        "(higher is better); tokens/s = LM tokens sampled (stop included) / wall s; p50 / p90 = numpy linear; "
        f"whole run {time.perf_counter() - started:.0f} s; command: `python perf/engine_bench.py {cmd}`", "",
        *table(rows, ratios), "",
        "Ratio engine/reference (x real time): " + ", ".join(f"{n} streams {r:.2f}x" for n, r in ratios.items()), "",
        "TTFA p50, reference/engine: " + ", ".join(f"{n} streams {r:.1f}x" for n, r in sooner.items()), "",
        "Where the engine's wall goes (wrapped calls, every burst above):", "", *shares, "",
    ]
    text = "\n".join(md)
    print(text)
    out = args.out or Path(__file__).resolve().parent / "results" / provenance.result_filename("chatterbox_bench",
                                                                                             info)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    log(f"wrote {out}")
    return out
