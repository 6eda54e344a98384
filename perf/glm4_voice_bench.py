"""Engine vs the composed GLM-4-Voice reference on CPU (`python perf/engine_bench.py --model glm4_voice [--quick]`).

The reference is the one tests/test_glm4_voice.py and tests/test_glm4_voice_flow.py hold the engine to, run one
request at a time: the speech tokenizer on the user's clip (ours: its parity with upstream's is
tests/test_glm4_voice_tokenizer.py's, so both sides read the same prompt ids), transformers' `GlmForCausalLM.generate`
on those ids (`reference_lm`, greedy), and upstream CosyVoice's flow + HiFT driven as GLM-4-Voice's web_demo.py drives
them (tests/glm4_voice_flow_oracle.py: `upstream_decoder`, `GlmAudioDecoder.token2wav`, the cut of
`glm_serving_blocks`). Upstream's server streams: its decoder takes a block of 25, 50, 100, 150, then 200 speech ids
as the LM hands them over; here generate's `streamer` hands each token to the same cut on the same thread, so the
reference's first audio comes with its 25th speech id (+ 1), not after the whole reply. The engine serves a burst of
N conversations at once (the speech tokenizer batched in the engine, batched LM, the decoder's blocks batched across
requests). Both run the same tiny random checkpoint (voxbackend.models.glm4_voice.tiny), the same prompt ids, the
same cap.
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
CLIP_RATE = 16000


@dataclass
class Result:
    ttfa: float  # from the request's own start (engine: its submit in the burst; reference: its speech tokenizer)
    service: float  # to its last audio
    audio_s: float
    tokens: int  # LM tokens generated (a stop id included)
    reply: list[int]
    lm_s: float = 0.0  # reference: speech tokenizer + generate, without the decoder's blocks


@dataclass
class Job:
    """One conversation: the engine's prompt (FEATURE rows where the clip's speech ids go) and its seed."""

    seed: int
    prompt: object  # the engine's Prompt


def user_clip(index: int, seed: int) -> np.ndarray:
    """The user's turn, already complete: a voiced-sounding 2-4 s clip at 16 kHz."""
    from voxbackend.models.cosyvoice2.tiny import voice_clip

    seconds = 2.0 + 0.5 * ((seed + index) % 5)
    return voice_clip(seconds, CLIP_RATE, seed + index)


def make_jobs(model, n: int, prompts: list[str], seed: int) -> list[Job]:
    """Conversation i: upstream's default (speech) system prompt, then clip i, with sentence i typed after it for
    even i (web_demo's speech-only turn for odd i); seed + i."""
    return [Job(seed + i, model.prepare(prompts[i % len(prompts)] if i % 2 == 0 else None,
                                        audio=user_clip(i, seed), sample_rate=CLIP_RATE))
            for i in range(n)]


class BlockStreamer:
    """generate's streamer: web_demo.py's loop over the model server's tokens, on generate's thread. A speech id
    joins the open block; a full block is cut, not final, when the next speech id arrives; the reply's end (a stop
    id, or the cap) cuts the open block as the final one (glm4_voice_flow_oracle.glm_serving_blocks, run as the
    tokens come). Each block goes through GlmAudioDecoder.token2wav with every earlier speech id as its prompt
    tokens and the earlier blocks' mels as its prompt mel, as glm_stream does."""

    def __init__(self, ref: "Reference", t0: float):
        from glm4_voice_flow_oracle import GlmAudioDecoder

        torch = ref.torch
        self.ref, self.t0 = ref, t0
        self.decoder = GlmAudioDecoder(ref.flow, ref.hift, ref.cfg)
        self.prompt_token = torch.zeros(1, 0, dtype=torch.int64)
        self.embedding = torch.zeros(1, ref.cfg.flow.spk_embed_dim)
        self.mels: list = []
        self.pending: list[int] = []
        self.index, self.finalize, self.seen_prompt = 0, False, False
        self.first: float | None = None
        self.samples, self.decode_s = 0, 0.0
        self.blocks: list[tuple[int, bool]] = []  # (speech ids, final) of each block decoded

    def put(self, value) -> None:
        if not self.seen_prompt:  # generate hands over the prompt first
            self.seen_prompt = True
            return
        for t in value.reshape(-1).tolist():
            self.token(t)

    def end(self) -> None:
        self.token(None)  # the reply's end: a no-op when its stop id already finalized

    def token(self, t: int | None) -> None:
        ref = self.ref
        if self.finalize:
            return
        speech = t is not None and ref.audio_offset <= t < ref.audio_offset + ref.speech_codes
        if t is None or t in ref.stop_ids:
            self.finalize = True
        elif not speech:
            return  # a text id: the decoder never sees it
        sizes = ref.cfg.block_sizes
        if len(self.pending) >= sizes[self.index] or (self.finalize and self.pending):
            self.index = min(self.index + 1, len(sizes) - 1)
            self._decode(self.pending, self.finalize)
            self.pending = []
        if not self.finalize:
            self.pending.append(t - ref.audio_offset)

    def _decode(self, block: list[int], final: bool) -> None:
        torch = self.ref.torch
        start = time.perf_counter()
        token = torch.tensor(block)[None]
        prompt_feat = (torch.cat(self.mels, dim=-1).transpose(1, 2) if self.mels
                       else torch.zeros(1, 0, self.ref.cfg.flow.mel_bins))
        speech, mel = self.decoder.token2wav(token, self.prompt_token, prompt_feat, self.embedding, final)
        self.mels.append(mel)
        self.prompt_token = torch.cat((self.prompt_token, token), dim=-1)
        self.samples += speech.shape[-1]
        now = time.perf_counter()
        self.first = self.first or now - self.t0
        self.decode_s += now - start
        self.blocks.append((len(block), final))


class Reference:
    """The composed reference on the checkpoint's files: GlmForCausalLM with its LM weights (GLM-4's fused q/k/v and
    gate/up split back out, loaded strictly) and upstream CosyVoice's MaskedDiffWithXvec + HiFTGenerator at the
    decoder folder's sizes (flow.pt and hift.pt loaded strictly)."""

    def __init__(self, model_dir: Path, model):
        import torch
        from glm4_voice_flow_oracle import upstream_decoder
        from test_glm4_voice import reference_lm

        from voxbackend.models.glm4_voice.chat import SPEECH_CODES
        from voxbackend.models.glm4_voice.codec import decoder_config

        self.model = model  # the engine's model: its speech tokenizer makes the prompt ids (see the module doc)
        self.lm = reference_lm(model_dir)
        folder = model.decoder_dir
        self.cfg = decoder_config(folder)
        flow_state, hift_state = (torch.load(folder / f"{name}.pt", map_location="cpu", weights_only=True)
                                  for name in ("flow", "hift"))
        self.flow, self.hift = upstream_decoder(self.cfg, flow_state, hift_state)
        self.audio_offset, self.speech_codes = model.template.audio_offset, SPEECH_CODES
        self.stop_ids = tuple(model.spec.stop_ids)  # <|endoftext|>, <|user|> (web_demo's end), <|observation|>
        self.sample_rate = self.cfg.sample_rate
        self.torch = torch

    def run(self, job: Job, max_tokens: int) -> Result:
        from glm4_voice_flow_oracle import END, glm_serving_blocks
        from test_glm4_voice import with_speech_ids

        torch = self.torch
        with torch.random.fork_rng(), torch.inference_mode():  # the flow reseeds torch's generator each block
            t0 = time.perf_counter()
            ids = with_speech_ids(self.model, job.prompt)  # the speech tokenizer on the clip, ids at its rows
            streamer = BlockStreamer(self, t0)
            out = self.lm.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   do_sample=False, max_new_tokens=max_tokens, eos_token_id=list(self.stop_ids),
                                   pad_token_id=self.stop_ids[0], streamer=streamer)
            wall = time.perf_counter() - t0
        reply = out[0, len(ids):].tolist()
        codes = [t - self.audio_offset for t in reply if self.audio_offset <= t < self.audio_offset + self.speech_codes]
        cut = [(len(b), final) for b, final in glm_serving_blocks(codes + [END], self.cfg.block_sizes)]
        if streamer.blocks != cut:
            raise RuntimeError(f"the streamed blocks {streamer.blocks} are not glm_serving_blocks' {cut}")
        return Result(streamer.first or wall, wall, streamer.samples / self.sample_rate, len(reply), reply,
                      wall - streamer.decode_s)


def run_engine_burst(engine, jobs: list[Job], max_tokens: int) -> tuple[float, list[Result]]:
    from voxbackend import SamplingParams

    rate = engine.model.spec.sample_rate
    wall, done = run_burst(engine, [(j.prompt, SamplingParams(temperature=0, max_tokens=max_tokens, seed=j.seed))
                                    for j in jobs])
    return wall, [Result(r.ttfa, r.service, r.samples / rate, len(r.final.token_ids or []),
                         list(r.final.token_ids or [])) for r in done]


class Timers:
    """Wall seconds inside the engine's speech tokenizer, LM forward, LM head (the padded 17536 ids) and speech
    decoder blocks (CPU torch is synchronous)."""

    def __init__(self, engine):
        self.total: dict[str, float] = {}
        self._wrap(engine.model, "encode_features", "speech tokenizer")
        self._wrap(engine.model, "forward", "LM forward")
        self._wrap(engine.model, "logits", "LM head")
        self._wrap(engine.model.codec, "decode", "decoder (flow + HiFT)")

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
    same_replies: tuple[int, int]  # reference replies equal to the engine's (and as long in audio), of those served
    lm_share: float  # of the reference's wall: speech tokenizer + generate (the rest: the decoder's blocks)


def measure(engine, ref: Reference, timers: Timers, n: int, prompts: list[str], args, log) -> Level:
    """One stream count: the reference serves a few of the burst's requests for real (spread over it), half before
    and half after the engine burst, since the shared machine drifts; at 1 stream both serve single_rounds."""
    cap = args.max_tokens
    jobs = make_jobs(engine.model, n, prompts, args.seed)
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
    same = sum(r.reply == eng[i].reply and abs(r.audio_s - eng[i].audio_s) < 1e-9
               for i, r in zip(picked, ref_res))
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
    from voxbackend.models.glm4_voice.chat import SPEECH_SYSTEM
    from voxbackend.models.glm4_voice.tiny import ensure_default_glm4_voice

    info = provenance.collect()
    started = time.perf_counter()
    cap = args.max_tokens
    cache = args.cache_dir or Path.home() / ".cache" / "voxbackend" / "bench"
    model_dir, _ = ensure_default_glm4_voice(cache / "glm4_voice-tiny")
    log(f"GLM-4-Voice tiny checkpoint {model_dir}; at most {cap} tokens per request; streams {args.stream_counts}")
    n_max = max(args.stream_counts)
    # room for the whole burst at once: the prompt (system prompt, up to 4 s of speech ids, a sentence) and the reply
    per_request = (300 + max(len(p) for p in prompts) + cap) // 16 + 2
    engine = voxbackend.load(model_dir, policy=args.policy, max_batch=max(32, n_max), page_size=16,
                             kv_pages=max(1024, n_max * per_request))
    engine.start()
    ref = Reference(model_dir, engine.model)
    log("warm-up (not measured)")
    warm = make_jobs(engine.model, 1, ["Hello there."], 1)
    ref.run(warm[0], min(cap, 60))
    run_engine_burst(engine, warm, min(cap, 60))
    timers = Timers(engine)

    levels = [measure(engine, ref, timers, n, prompts, args, log) for n in args.stream_counts]
    engine.shutdown()

    rows = [r for lv in levels for r in (lv.engine, lv.reference)]
    ratios = {lv.engine.streams: lv.engine.xrt / lv.reference.xrt for lv in levels}
    sooner = {lv.engine.streams: _pct(lv.reference.ttfa, 50) / _pct(lv.engine.ttfa, 50) for lv in levels}
    model = engine.model
    g, lm_params = model.cfg, sum(p.numel() for p in model.backbone.parameters())
    tok_params = sum(p.numel() for p in model.speech_tokenizer.parameters())
    codec = model.codec.cfg
    codec_params = sum(p.numel() for m in (model.codec.flow, model.codec.hift) for p in m.parameters())
    enc, dec = codec.flow.encoder, codec.flow.decoder
    same = sum(lv.same_replies[0] for lv in levels), sum(lv.same_replies[1] for lv in levels)
    cmd = " ".join(sys.argv[1:])
    md = [
        "# engine_bench --model glm4_voice: engine vs the composed GLM-4-Voice reference on CPU", "",
        *provenance.markdown_lines(info),
        f"- load average at end: {provenance.load_average()} (the machine is shared: compare ratios, not absolutes)",
        f"- model: tiny random GLM-4-Voice-9B (LM: GLM-4 hidden {g.hidden_size} x {g.num_layers} layers, "
        f"{model.hf_config['padded_vocab_size']} ids: a 1024-id toy BPE, GLM-4's control ids and the real 16384 "
        f"speech ids; {lm_params / 1e6:.2f}M parameters; speech tokenizer: {tok_params / 1e6:.2f}M; decoder: "
        f"CosyVoice 1 flow (conformer {enc.size} x {enc.num_blocks} blocks, U-Net channels {list(dec.channels)}) + "
        f"HiFT {codec.hift.base_channels} channels, {codec_params / 1e6:.2f}M; the real 12.5 Hz / 22.05 kHz timing, "
        f"10 Euler steps with guidance, blocks of {', '.join(map(str, codec.block_sizes))} speech ids)",
        f"- weights: random, seed 0 (voxbackend.models.glm4_voice.tiny), cached at {model_dir}; the decoder's one "
        "voice (a zero x-vector, as upstream)",
        f"- dataset: {dataset}; conversation i: upstream's default system prompt for a spoken turn (\""
        f"{SPEECH_SYSTEM.strip()}\"), then the user's turn: clip i, a synthetic voiced clip of 2.0 + 0.5 x ((seed "
        f"+ i) mod 5) s at 16 kHz (cosyvoice2.tiny.voice_clip, noise seed {args.seed} + i), with sentence i typed "
        "after it for even i (web_demo's speech-only turn for odd i); both sides read the same prompt ids: the "
        "engine's speech tokenizer makes the reference's speech ids too (its parity with upstream's: "
        "tests/test_glm4_voice_tokenizer.py; the prompt's with upstream's string tokenized: tests/test_glm4_voice.py)",
        f"- sampling (both): greedy, at most {cap} tokens per request (upstream's demo cap: 2000), stop ids "
        "`<|endoftext|>`, `<|user|>` (web_demo's end), `<|observation|>`. Not the model's default (temperature 0.2, "
        "top-p 0.8, top-k 50): greedy lets both sides' replies be compared id for id, and the tiny checkpoint is "
        "built for it (unit-scale weights, no near-ties; its head's control rows are zero, so a reply runs to the "
        f"cap). The reference's reply equals the engine's, and so does its audio's length, for {same[0]} of the "
        f"{same[1]} requests both served",
        f"- arrivals: a burst of N conversations at t=0 (closed loop); each user clip is complete when its request "
        f"is sent, so TTFA counts from the end of the user's clip (the submit, or the reference's start) to the "
        f"reply's first audio; engine policy {args.policy}; the engine's decoder cuts the same blocks as the "
        "reference, batched across requests as they fall due",
        "- reference: the speech tokenizer on the clip, transformers `GlmForCausalLM.generate` "
        "(tests/test_glm4_voice.py `reference_lm`: the checkpoint's LM weights, loaded strictly), and upstream "
        "CosyVoice's `MaskedDiffWithXvec` + `HiFTGenerator` (tests/glm4_voice_flow_oracle.py `upstream_decoder`, "
        "flow.pt and hift.pt loaded strictly) driven as web_demo.py drives them: `GlmAudioDecoder.token2wav` "
        "(flow_inference.py's mel fade and HiFT cache) block by block, cut as `glm_serving_blocks` cuts, each block "
        "decoded as soon as generate's streamer hands over the speech id after it (the reply's end for the last: its "
        "stop id, or the cap, finalizes, as the engine's does). Upstream's model server generates in another "
        "process while web_demo decodes; here both run on one thread, one after the other, so the reference's "
        "first audio comes with its first block, not after the whole reply, and its wall is generate's plus the "
        "decoder's; one request at a time",
        "- reference TTFA under the burst: request i waits for 0..i-1 to be served, TTFA_i = sum_{j<i} S_j + T_i "
        "(S: service, T: own TTFA, measured for the requests served, their means for the rest); at 1 stream its "
        "own TTFA. Requests with no audio are left out of TTFA. Share of the reference's wall in speech tokenizer "
        "+ generate: " + ", ".join(f"{lv.engine.streams} streams {100 * lv.lm_share:.0f}%" for lv in levels),
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
    out = args.out or Path(__file__).resolve().parent / "results" / provenance.result_filename("glm4_voice_bench",
                                                                                             info)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    log(f"wrote {out}")
    return out
