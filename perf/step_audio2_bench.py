"""Engine vs the composed Step-Audio 2 reference on CPU (`python perf/engine_bench.py --model step_audio2 [--quick]`).

The reference is the one tests/test_step_audio2.py holds the engine to, run one request at a time: the upstream
audio encoder + adapter forward (`upstream_rows` in tests/test_step_audio2_encoder.py, a plain torch transcription:
Whisper blocks, Step's tail-pad mask and pool, the adapter) on each clip piece, its rows at the prompt's
`<audio_patch>` ids, transformers' `Qwen2ForCausalLM.generate` on those embeddings (greedy), then upstream
step-audio2 `Token2wav.stream` (tests/step_audio2_token2wav_oracle.py) on the reply's audio ids, cut as a complete
reply is (25 ids + 3 of lookahead a chunk). stepaudio2.py's generate returns the whole reply, so the reference's
first audio comes after its last LM token. The engine serves a burst of N conversations at once (the encoder
batched in the engine, batched LM, streamed token2wav chunks). Both run the same tiny random checkpoint
(voxbackend.models.step_audio2.tiny), its default voice, the same prompt ids and spectrograms, the same cap.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import provenance  # perf/provenance.py (engine_bench put perf/ on sys.path)
from burst import run_burst  # perf/burst.py

sys.path.insert(0, str(provenance.REPO_ROOT / "tests"))
SAMPLE_RATE = 24000
CLIP_RATE = 16000
SYSTEM = "You are a helpful assistant."  # upstream's examples
VOICE_KEY = "default.wav"  # the reference's prompt cache key (upstream keys it by the prompt wav's path)
NOISE_FRAMES = 50 * 600  # upstream CausalConditionalCFM's fixed rand_noise buffer


@dataclass
class Result:
    ttfa: float  # from the request's own start (engine: its submit in the burst; reference: its encoder call)
    service: float  # to its last audio
    audio_s: float
    tokens: int  # LM tokens sampled (a stop id included)
    reply: list[int]
    lm_s: float = 0.0  # reference: encoder + generate, the rest is token2wav


@dataclass
class Job:
    """One conversation as both sides see it: the engine's prompt, and its ids and clip spectrograms."""

    seed: int
    prompt: object  # the engine's Prompt
    ids: list[int]  # upstream's: `<audio_patch>` at the placeholder rows
    mels: list  # one (128, frames) spectrogram per 25 s piece


def user_clip(index: int, seed: int) -> np.ndarray:
    """The user's turn, already complete: a voiced-sounding 2-4 s clip (the tiny voice's generator)."""
    from voxbackend.models.cosyvoice2.tiny import voice_clip

    seconds = 2.0 + 0.5 * ((seed + index) % 5)
    return voice_clip(seconds, CLIP_RATE, seed + index)


def make_jobs(model, n: int, prompts: list[str], seed: int, patch_id: int) -> list[Job]:
    """Conversation i: the system prompt, then sentence i with clip i, a spoken reply asked for; seed + i."""
    import torch

    from voxbackend.models.base import FEATURE

    jobs = []
    for i in range(n):
        prompt = model.prepare(prompts[i % len(prompts)], audio=user_clip(i, seed), sample_rate=CLIP_RATE,
                               system=SYSTEM)
        frames = [int(f) for f in prompt.conditioning["audio_mel_frames"]]
        mels = list(torch.split(torch.from_numpy(prompt.conditioning["audio_mels"]), frames, dim=1))
        jobs.append(Job(seed + i, prompt, [patch_id if t == FEATURE else t for t in prompt.ids], mels))
    return jobs


class Reference:
    """The composed reference on the checkpoint's files: its own encoder weights, Qwen2ForCausalLM and upstream
    Token2wav (flow and HiFT built at the checkpoint's sizes, loaded strictly), in the default voice."""

    def __init__(self, model_dir: Path):
        import torch
        from tokenizers import Tokenizer
        from transformers import Qwen2Config, Qwen2ForCausalLM

        from step_audio2_flow_oracle import upstream_flow
        from step_audio2_oracle import load_utils
        from step_audio2_token2wav_oracle import flash_hift, upstream_token2wav
        from voxbackend.models.checkpoint import load_safetensors, read_config
        from voxbackend.models.step_audio2.audio_encoder import load_audio_encoder
        from voxbackend.models.step_audio2.codec import CODEC_FOLDER, codec_config, load_voice

        config, weights = read_config(model_dir), load_safetensors(model_dir)
        self.encoder = load_audio_encoder(config, weights)  # holds the weights and sizes upstream_rows reads
        text = {k: v for k, v in config["text_config"].items() if k != "max_seq_len"}
        self.lm = Qwen2ForCausalLM(Qwen2Config(**text, tie_word_embeddings=False)).eval()
        self.lm.load_state_dict({k: v for k, v in weights.items() if k.startswith(("model.", "lm_head."))},
                                strict=True)
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.patch_id, self.eot = tokenizer.token_to_id("<audio_patch>"), tokenizer.token_to_id("<|EOT|>")
        self.placeholders = load_utils().compute_token_num  # upstream inserts the adapter's first rows

        codec, voice = codec_config(model_dir), load_voice(model_dir, "default")
        prompt_tokens = torch.as_tensor(voice["prompt_speech_tokens"], dtype=torch.long)
        folder = model_dir / CODEC_FOLDER
        # the DiT's stream caches hold the trimmed attention cache (prompt + 100 frames) plus a chunk
        flow = upstream_flow(codec.flow, stream_frames=2 * len(prompt_tokens) + 100 + 2 * codec.stream.max_chunk_tokens)
        flow.load_state_dict(torch.load(folder / "flow.pt", map_location="cpu", weights_only=True), strict=True)
        # upstream draws one noise buffer when it builds the flow and reads every request's noise from it
        flow.decoder.rand_noise = torch.randn(1, codec.flow.mel_bins, NOISE_FRAMES,
                                              generator=torch.Generator().manual_seed(0))
        hift_state = torch.load(folder / "hift.pt", map_location="cpu", weights_only=True)
        hift = flash_hift({k.removeprefix("generator."): v for k, v in hift_state.items()},
                          codec.hift.base_channels, codec.hift.f0_channels)
        self.t2w = upstream_token2wav(flow, hift, VOICE_KEY, prompt_tokens, torch.as_tensor(voice["prompt_feat"]),
                                      torch.as_tensor(voice["speaker_embedding"]))
        self.stream_cfg = codec.stream
        self.torch = torch

    def run(self, job: Job, max_tokens: int) -> Result:
        from step_audio2_token2wav_oracle import set_stream_cache_on_cpu, stream_on_cpu
        from test_step_audio2_encoder import upstream_rows
        from voxbackend.components.flow_hift.dit_token2wav import split_chunks
        from voxbackend.models.step_audio2.model import AUDIO_CODES, AUDIO_OFFSET

        torch = self.torch
        torch.manual_seed(job.seed)  # upstream's HiFT draws its excitation from the global generator
        t0 = time.perf_counter()
        with torch.inference_mode():
            rows = torch.cat([upstream_rows(self.encoder, m)[:self.placeholders(m.shape[1])] for m in job.mels])
            ids = torch.tensor(job.ids)
            embeds = self.lm.get_input_embeddings()(ids)
            embeds[ids == self.patch_id] = rows
            # input_ids with the embeddings, as upstream's generate has them (its logits processors see the prompt)
            out = self.lm.generate(input_ids=ids[None], inputs_embeds=embeds[None],
                                   attention_mask=torch.ones(1, len(ids), dtype=torch.long), do_sample=False,
                                   max_new_tokens=max_tokens, eos_token_id=self.eot, pad_token_id=self.eot)
        reply = out[0, len(ids):].tolist()
        lm_s = time.perf_counter() - t0
        codes = [t - AUDIO_OFFSET for t in reply if AUDIO_OFFSET <= t < AUDIO_OFFSET + AUDIO_CODES]
        first, samples = None, 0
        if codes:
            set_stream_cache_on_cpu(self.t2w, VOICE_KEY)
            for start, end, last in split_chunks(len(codes), self.stream_cfg):
                _, pcm = stream_on_cpu(self.t2w, codes[start:end], VOICE_KEY, last)
                first = first or time.perf_counter() - t0
                samples += len(pcm) // 2  # int16
        wall = time.perf_counter() - t0
        return Result(first or wall, wall, samples / SAMPLE_RATE, len(reply), reply, lm_s)


def run_engine_burst(engine, jobs: list[Job], max_tokens: int) -> tuple[float, list[Result]]:
    from voxbackend import SamplingParams

    wall, done = run_burst(engine, [(j.prompt, SamplingParams(temperature=0, max_tokens=max_tokens, seed=j.seed))
                                    for j in jobs])
    return wall, [Result(r.ttfa, r.service, r.samples / SAMPLE_RATE, len(r.final.token_ids or []),
                         list(r.final.token_ids or [])) for r in done]


class Timers:
    """Wall seconds inside the engine's audio encoder, LM forward, LM head (158720 ids) and token2wav chunks (CPU
    torch is synchronous)."""

    def __init__(self, engine):
        self.total: dict[str, float] = {}
        self._wrap(engine.model, "encode_features", "audio encoder")
        self._wrap(engine.model, "forward", "LM forward")
        self._wrap(engine.model, "logits", "LM head")
        self._wrap(engine.model.codec, "decode_chunk", "token2wav")

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
    tok_s: float  # LM tokens / wall s
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


def queued_ttfa(n: int, served: dict[int, Result]) -> list[float]:
    """Request i of a burst served one at a time: TTFA_i = sum_{j<i} S_j + T_i, with the measured service S and own
    TTFA T of the requests served, the means of those for the rest."""
    mean_s = float(np.mean([r.service for r in served.values()]))
    mean_t = float(np.mean([r.ttfa for r in served.values()]))
    service = [served[i].service if i in served else mean_s for i in range(n)]
    own = [served[i].ttfa if i in served else mean_t for i in range(n)]
    return [sum(service[:i]) + own[i] for i in range(n)]


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


@dataclass
class Level:
    """One stream count's outcome."""

    engine: Row
    reference: Row
    share: str  # where the engine's wall went
    same_replies: tuple[int, int]  # reference replies equal to the engine's, of those served
    lm_share: float  # of the reference's wall: encoder + generate (the rest: token2wav)


def measure(engine, ref: Reference, timers: Timers, n: int, prompts: list[str], args, log) -> Level:
    """One stream count: the reference serves a few of the burst's requests for real (spread over it), half before
    and half after the engine burst, since the shared machine drifts; at 1 stream both serve single_rounds."""
    cap = args.max_tokens
    jobs = make_jobs(engine.model, n, prompts, args.seed, ref.patch_id)
    k = args.single_rounds if n == 1 else min(n, args.naive_requests)
    picked = [round(j * (n - 1) / max(1, k - 1)) for j in range(k)]
    ref_res = [ref.run(jobs[i], cap) for i in picked[: k // 2]]
    rounds = args.single_rounds if n == 1 else 1
    walls, eng = 0.0, []
    timers.total.clear()
    for _ in range(rounds):
        w, r = run_engine_burst(engine, jobs, cap)
        walls, eng = walls + w, eng + r
    share = f"- {n} streams: {timers.shares(walls)} of the engine's {walls:.1f} s"
    ref_res += [ref.run(jobs[i], cap) for i in picked[k // 2:]]
    same = sum(r.reply == eng[i].reply for i, r in zip(picked, ref_res))
    engine_row = row(n, "engine", f"{len(eng)} ({rounds} burst{'s' if rounds > 1 else ''} of {n})",
                     [r.ttfa for r in eng if r.audio_s > 0], eng, walls)
    ref_wall = sum(r.service for r in ref_res)
    if n == 1:  # the same request, served single_rounds times
        queued = [r.ttfa for r in ref_res if r.audio_s > 0]
    else:
        voiced = {i: r for i, r in zip(picked, ref_res) if r.audio_s > 0}
        queued = queued_ttfa(n, voiced) if voiced else []
    measured = f"{k} one at a time" if n == 1 else f"{k} served, {n - k} extrapolated"
    ref_row = row(n, "reference", measured, queued, ref_res, ref_wall)
    log(f"{n} streams: engine {engine_row.xrt:.2f}x real time, reference {ref_row.xrt:.2f}x "
        f"(ratio {engine_row.xrt / ref_row.xrt:.2f}); replies equal {same}/{k}")
    return Level(engine_row, ref_row, share, (same, k), sum(r.lm_s for r in ref_res) / ref_wall)


def run(args, prompts: list[str], dataset: str, log) -> Path:
    import torch

    import voxbackend
    from voxbackend.models.step_audio2.tiny import ensure_default_step_audio2

    info = provenance.collect()
    started = time.perf_counter()
    cap = args.max_tokens
    cache = args.cache_dir or Path.home() / ".cache" / "voxbackend" / "bench"
    model_dir, _ = ensure_default_step_audio2(cache / "step_audio2-tiny")
    log(f"Step-Audio 2 tiny checkpoint {model_dir}; at most {cap} tokens per request; streams {args.stream_counts}")
    n_max = max(args.stream_counts)
    # room for the whole burst at once: the prompt (template, sentence, up to 4 s of placeholders) and the reply
    per_request = (200 + max(len(p) for p in prompts) + cap) // 16 + 2
    engine = voxbackend.load(model_dir, policy=args.policy, max_batch=max(32, n_max), page_size=16,
                             kv_pages=max(1024, n_max * per_request))
    engine.start()
    ref = Reference(model_dir)
    log("warm-up (not measured)")
    warm = make_jobs(engine.model, 1, ["Hello there."], 1, ref.patch_id)
    ref.run(warm[0], min(cap, 40))
    run_engine_burst(engine, warm, min(cap, 40))
    timers = Timers(engine)

    levels = [measure(engine, ref, timers, n, prompts, args, log) for n in args.stream_counts]
    engine.shutdown()

    rows = [r for lv in levels for r in (lv.engine, lv.reference)]
    ratios = {lv.engine.streams: lv.engine.xrt / lv.reference.xrt for lv in levels}
    sooner = {lv.engine.streams: _pct(lv.reference.ttfa, 50) / _pct(lv.engine.ttfa, 50) for lv in levels}
    model = engine.model
    g, lm_params = model.cfg, sum(p.numel() for p in model.backbone.parameters())
    enc = model.audio_encoder.cfg
    enc_params = sum(p.numel() for p in model.audio_encoder.parameters())
    flow = model.codec.flow.cfg
    codec_params = sum(p.numel() for m in (model.codec.flow, model.codec.hift) for p in m.parameters())
    same = sum(lv.same_replies[0] for lv in levels), sum(lv.same_replies[1] for lv in levels)
    cmd = " ".join(sys.argv[1:])
    md = [
        "# engine_bench --model step_audio2: engine vs the composed Step-Audio 2 reference on CPU", "",
        *provenance.markdown_lines(info),
        f"- load average at end: {provenance.load_average()} (the machine is shared: compare ratios, not absolutes)",
        f"- model: tiny random Step-Audio 2 mini (LM: Qwen2 hidden {g.hidden_size} x {g.num_layers} layers, the real "
        f"158720 ids with the 6561 audio ids at 151696, {lm_params / 1e6:.1f}M parameters; audio encoder: Whisper "
        f"width {enc.n_audio_state} x {enc.n_audio_layer} layers + adapter, {enc_params / 1e6:.2f}M; token2wav: DiT "
        f"flow (encoder {flow.encoder.size} x {flow.encoder.num_blocks} blocks, DiT {flow.estimator.hidden_size} x "
        f"{flow.estimator.depth}) + HiFT {model.codec.hift.cfg.base_channels} channels, {codec_params / 1e6:.2f}M; "
        "the real 25 Hz / 24 kHz timing, 10 Euler steps with guidance)",
        f"- weights: random, seed 0 (voxbackend.models.step_audio2.tiny), cached at {model_dir}; voice: its "
        "default voice (voices/default.safetensors, the reference's prompt cache entry made from it)",
        f"- dataset: {dataset}; conversation i: system prompt \"{SYSTEM}\", then the user's turn: sentence i as "
        f"text and clip i, a synthetic voiced clip of 2.0 + 0.5 x ((seed + i) mod 5) s at 16 kHz "
        f"(cosyvoice2.tiny.voice_clip, noise seed {args.seed} + i); a spoken reply asked for (`<tts_start>`); "
        "both sides read the same prompt ids and spectrograms (the chat template's parity with upstream's "
        "apply_chat_template: tests/test_step_audio2.py)",
        f"- sampling (both): greedy, at most {cap} tokens per request (upstream's cap for a spoken reply: 4096). "
        "Not the model's default (temperature 0.7, top-p 0.9, repetition penalty 1.05): on the tiny head, whose "
        "rows of the ~150k ids its toy vocabulary leaves unused are zero, that draws those ids ~9 times in 10, where "
        "greedy gives the mix the checkpoint is built for (text ~4/5, audio ids ~1/5), and lets both sides' replies "
        f"be compared id for id: the reference's reply equals the engine's for {same[0]} of the {same[1]} requests "
        "both served",
        f"- arrivals: a burst of N conversations at t=0 (closed loop); each user clip is complete when its request "
        f"is sent, so TTFA counts from the end of the user's clip (the submit, or the reference's start) to the "
        f"reply's first audio; engine policy {args.policy}; engine token2wav chunks of 25 audio ids + 3 lookahead, "
        "streamed as the ids come",
        "- reference: the upstream encoder + adapter forward (tests/test_step_audio2_encoder.py `upstream_rows`, "
        "its rows at the `<audio_patch>` ids), transformers `Qwen2ForCausalLM.generate` (input ids and those "
        "embeddings, as upstream's generate sees them; stop `<|EOT|>`), then upstream step-audio2 1.0.0 "
        "`Token2wav.set_stream_cache` + `stream` (tests/step_audio2_token2wav_oracle.py: its flow and HiFT at the "
        "checkpoint's sizes, loaded strictly from token2wav/) on the reply's audio ids, chunked as the engine cuts a "
        "complete reply; stepaudio2.py's generate returns the whole reply, so chunking only brings the first "
        "chunk forward of the rest of token2wav; one request at a time",
        "- reference TTFA under the burst: request i waits for 0..i-1 to be served, TTFA_i = sum_{j<i} S_j + T_i "
        "(S: service, T: own TTFA, measured for the requests served, their means for the rest); at 1 stream its "
        "own TTFA. Requests with no audio are left out of TTFA. Share of the reference's wall in encoder + "
        "generate: " + ", ".join(f"{lv.engine.streams} streams {100 * lv.lm_share:.0f}%" for lv in levels),
        f"- torch {torch.__version__}, {torch.get_num_threads()} intra-op threads; x real time = audio s / wall s "
        "(higher is better); tokens/s = LM tokens (stop included) / wall s; p50 / p90 = numpy linear; whole run "
        f"{time.perf_counter() - started:.0f} s; command: `python perf/engine_bench.py {cmd}`", "",
        *table(rows, ratios), "",
        "Ratio engine/reference (x real time): " + ", ".join(f"{n} streams {r:.2f}x" for n, r in ratios.items()), "",
        "TTFA p50, reference/engine: " + ", ".join(f"{n} streams {r:.1f}x" for n, r in sooner.items()), "",
        "Where the engine's wall goes (wrapped calls, every burst above):", "", *[lv.share for lv in levels], "",
    ]
    text = "\n".join(md)
    print(text)
    out = args.out or Path(__file__).resolve().parent / "results" / provenance.result_filename("step_audio2_bench",
                                                                                             info)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    log(f"wrote {out}")
    return out
