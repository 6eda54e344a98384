"""Engine vs naive Orpheus on CPU: audio seconds per wall second at 1, 8 and 32 concurrent streams.

    python perf/engine_bench.py                      # full run (size "bench", streams 1,8,32), a few minutes
    python perf/engine_bench.py --quick              # tiny model, seconds (the smoke test runs this)
    python perf/engine_bench.py --profile            # also cProfile one engine burst at the largest stream count

How and what it measures: see METHOD below (also written into every results file).
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import functools
import json
import math
import io
import os
import pstats
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402

import provenance  # noqa: E402  (perf/provenance.py)

SAMPLE_RATE = 24000
METHOD = """\
- Model: a random-weight Orpheus-architecture checkpoint (Llama backbone with Orpheus' 156,940-token vocabulary,
  SNAC 24 kHz layout with a reduced decoder), written by voxbackend.models.orpheus.tiny from a fixed seed and
  cached. Random weights emit random audio codes and now and then the stop token; both systems run the same
  checkpoint with the same sampling, so their stop statistics are the same.
- Requests: request i reads sentence i of the dataset, voice VOICES[i % 8], seed = --seed + i, official sampling
  (temperature 0.6, top_p 0.8, repetition_penalty 1.3), the same max_tokens, the audio-token constraint on both.
- Engine, N streams: all N requests are submitted at t=0 (a burst, closed loop) to one started engine; wall =
  from the first submit to the last request's final event. At N=1 it serves --single-rounds bursts of one
  request, one after another, and sums their walls.
- Naive baseline (perf/naive_orpheus.py: transformers generate + snac.SNAC per window, one request at a time) is
  sequential, so at N>1 it serves a few of the N requests for real (indices spread over 0..N-1) and the rest are
  extrapolated. Throughput = audio seconds / wall seconds summed over the requests it actually served
  (queueing cannot change a sequential server's throughput). TTFA under the same burst: the server takes the
  requests in order, so request i waits until 0..i-1 are completely served: TTFA_i = sum_{j<i} S_j + T_i, with
  S_j request j's measured service time (start of its generate to its last chunk) and T_i its own measured
  TTFA (start of its generate to its first chunk); a request not served for real gets the mean S and mean T
  of the served ones. At N=1 every served request is alone: TTFA_i = T_i.
- Interleaving (the machine is shared and noisy): at N=1 naive and engine requests alternate; at N>1 half of the
  naive requests run before the engine burst and half after, all in one process, and the ratio at N uses the
  naive requests measured next to that engine burst.
- x real time = audio seconds / wall seconds (higher is better). TTFA = submit to first audio chunk in hand.
  p90 = numpy.percentile(..., 90) (linear interpolation). tokens/s = LM tokens generated (stop token included)
  / wall seconds. On-time chunks: chunk i >= 1 is on time if the audio of chunks 0..i-1 is longer than the
  time since chunk 0 arrived (docs/metrics.md); a request is stall-free if all its chunks are on time; requests
  that stopped before their first window (no audio) are left out of TTFA and on-time figures.
"""
OFFICIAL = dict(temperature=0.6, top_p=0.8, repetition_penalty=1.3)
BUILTIN_PROMPTS = [
    "Hello there, how are you doing today?",
    "The quick brown fox jumps over the lazy dog while the cat watches from the warm window sill.",
    "A streaming server sends the first audio chunk as soon as it is ready, so the listener can start playing.",
    "She said that the train would arrive at seven, and that we should wait for her near the station.",
    "Can you tell me the way to the library? Turn left at the corner and walk straight for two blocks.",
    "Good morning! Good evening! Good night, and sleep well. See you tomorrow, my friend.",
    "It is important to test every part of a system, from the smallest function to the whole service.",
    "When the music stopped, everyone in the room turned around to see who had opened the heavy door.",
]
VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")

# --quick: a deliberately small model so the whole run takes seconds (it only checks that the bench works)
QUICK_LM = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
QUICK_SNAC_DIM = 32


# ----------------------------------------------------------------------------- checkpoint
def ensure_checkpoint(cache_root: Path, size: str, seed: int) -> tuple[Path, Path]:
    """Build (once) and reuse the random-weight checkpoint for this size and seed; atomic rename into place."""
    from voxbackend.models.orpheus import tiny as tc

    root = cache_root / f"{size}-seed{seed}"
    dirs = (root / "orpheus", root / "snac_24khz")
    if (root / ".complete").exists():
        return dirs
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
    try:
        if size == "quick":
            tc.write_tiny_orpheus(tmp / "orpheus", seed=seed, **QUICK_LM)
            tc.write_tiny_snac(tmp / "snac_24khz", seed=seed, decoder_dim=QUICK_SNAC_DIM)
        else:
            tc.write_default(tmp, seed=seed, size=size)
        (tmp / ".complete").write_text("ok\n")
        try:
            os.rename(tmp, root)
        except OSError:  # another process finished first
            if not (root / ".complete").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dirs


def default_cache() -> Path:
    base = os.environ.get("VOXBACKEND_CACHE")
    return Path(base) / "engine_bench" if base else Path.home() / ".cache" / "voxbackend" / "engine_bench"


def load_prompts(path: Path | None) -> tuple[list[str], str]:
    if path is not None and path.is_file():
        lines = (ln.strip() for ln in path.read_text(encoding="utf-8").splitlines())
        prompts = [ln for ln in lines if ln and not ln.startswith("#")]
        if prompts:
            return prompts, f"{_rel(path)} ({len(prompts)} sentences; request i reads line i mod {len(prompts)})"
    return BUILTIN_PROMPTS, f"built-in list of {len(BUILTIN_PROMPTS)} sentences (perf/data/prompts.txt missing)"


def _rel(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(provenance.REPO_ROOT))
    except ValueError:
        return str(p)


# ----------------------------------------------------------------------------- timing of engine internals
class Timers:
    """Wall time spent inside a few named calls (CPU torch is synchronous, so wall time is compute time)."""

    def __init__(self):
        self.total: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._undo: list = []

    def wrap(self, owner, attr: str, name: str, is_classmethod: bool = False) -> None:
        own = attr in vars(owner)  # False: an instance attribute shadowing its class's method
        original = vars(owner)[attr] if is_classmethod else getattr(owner, attr)
        fn = original.__func__ if is_classmethod else original

        @functools.wraps(fn)  # keeps the signature visible (transformers inspects model.forward)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[name] = self.total.get(name, 0.0) + time.perf_counter() - t0
                self.calls[name] = self.calls.get(name, 0) + 1

        setattr(owner, attr, classmethod(timed) if is_classmethod else timed)
        self._undo.append((owner, attr, original, own))

    def reset(self) -> None:
        self.total.clear()
        self.calls.clear()

    def snapshot(self) -> dict[str, tuple[float, int]]:
        return {k: (self.total[k], self.calls[k]) for k in self.total}

    def restore(self) -> None:
        for owner, attr, original, own in reversed(self._undo):
            if own:
                setattr(owner, attr, original)
            else:
                delattr(owner, attr)  # the instance falls back to its class's method again
        self._undo.clear()


def sampling_caller():
    """The module whose `sample` the engine calls: engine.model_runner since the engine / runner split, engine.engine
    before it (an --ab-base checkout may predate the split)."""
    try:
        import voxbackend.engine.model_runner as module
    except ImportError:
        import voxbackend.engine.engine as module
    return module


def instrument_engine(engine, timers: Timers) -> None:
    from voxbackend.sampling import SamplingBatch

    timers.wrap(engine.model, "forward", "LM forward (backbone)")
    timers.wrap(engine.model, "candidate_logits", "LM head (audio slice)")
    timers.wrap(SamplingBatch, "build", "sampling: batch tensors", is_classmethod=True)
    timers.wrap(sampling_caller(), "sample", "sampling: kernel")
    timers.wrap(engine.model, "detokenize", "codec (SNAC windows)")


def instrument_naive(naive, timers: Timers) -> None:
    timers.wrap(naive.model, "forward", "LM forward incl. full-vocab head")
    timers.wrap(naive, "_decode_window", "codec (SNAC windows)")


# ----------------------------------------------------------------------------- measurements
@dataclass
class ReqResult:
    index: int
    ttfa: float | None  # seconds from submit (or from start of service, for naive) to first chunk
    service: float  # naive: start to end of this request; engine: submit to final event
    audio_s: float
    tokens: int
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk, seconds from submit
    chunk_lens: list[float] = field(default_factory=list)  # seconds of audio in each chunk
    finish: str = ""


@dataclass
class Burst:
    wall: float
    results: list[ReqResult]
    internals: dict[str, tuple[float, int]]


def request_spec(i: int, prompts: list[str], seed: int) -> tuple[str, str, int]:
    return prompts[i % len(prompts)], VOICES[i % len(VOICES)], seed + i


def run_naive_one(naive, i: int, prompts, seed: int, max_tokens: int) -> ReqResult:
    text, voice, s = request_spec(i, prompts, seed)
    t0 = time.perf_counter()
    times, lens = [], []
    for chunk in naive.stream(text, voice=voice, max_tokens=max_tokens, seed=s, constrain_audio=True, **OFFICIAL):
        times.append(time.perf_counter() - t0)
        lens.append(len(chunk) / SAMPLE_RATE)
    service = time.perf_counter() - t0
    tokens = naive.generated_tokens
    return ReqResult(i, times[0] if times else None, service, sum(lens), tokens, times, lens,
                     "length" if tokens >= max_tokens else "stop")


def run_engine_burst(engine, indices: list[int], prompts, seed: int, max_tokens: int) -> tuple[float, list[ReqResult]]:
    from voxbackend import EventKind, SamplingParams

    n = len(indices)
    done = threading.Event()
    finished = [0]
    per: dict[str, dict] = {}
    specs = [request_spec(i, prompts, seed) for i in indices]
    prompts_ids = [engine.model.prepare(text, voice) for text, voice, _ in specs]  # tokenizing is not timed
    lock = threading.Lock()

    def on_event(e) -> None:  # runs on the engine thread; must not block
        now = time.perf_counter()
        rec = per[e.request_id]
        if e.kind is EventKind.AUDIO:
            rec["times"].append(now - rec["t0"])
            rec["lens"].append(len(e.audio) / SAMPLE_RATE)
            return
        rec["end"] = now - rec["t0"]
        rec["tokens"] = len(e.token_ids or [])
        rec["finish"] = e.finish_reason or (e.error or "error")
        with lock:
            finished[0] += 1
            if finished[0] == n:
                done.set()

    t_start = time.perf_counter()
    for k, (i, ids, (_, _, s)) in enumerate(zip(indices, prompts_ids, specs)):
        rid = f"bench-{i}-{k}"
        per[rid] = dict(index=i, times=[], lens=[], t0=time.perf_counter())
        engine.submit(ids, SamplingParams(max_tokens=max_tokens, seed=s, **OFFICIAL), on_event, request_id=rid)
    if not done.wait(timeout=3600):
        raise RuntimeError("engine burst did not finish within an hour")
    wall = time.perf_counter() - t_start
    results = [ReqResult(r["index"], r["times"][0] if r["times"] else None, r["end"], sum(r["lens"]), r["tokens"],
                         r["times"], r["lens"], r["finish"]) for r in per.values()]
    return wall, sorted(results, key=lambda r: r.index)


def spread(n: int, k: int) -> list[int]:
    """k request indices spread evenly over 0..n-1 (first and last included)."""
    k = max(1, min(k, n))
    return sorted({int(round(x)) for x in np.linspace(0, n - 1, k)})


def on_time(results: list[ReqResult]) -> tuple[int, int, int, int]:
    """(on-time chunks, chunks i >= 1, stall-free requests, requests with audio)."""
    ok = total = free = with_audio = 0
    for r in results:
        if not r.chunk_times:
            continue
        with_audio += 1
        t0, stalls = r.chunk_times[0], 0
        sent = r.chunk_lens[0]
        for t, length in zip(r.chunk_times[1:], r.chunk_lens[1:]):
            total += 1
            if sent > t - t0:
                ok += 1
            else:
                stalls += 1
            sent += length
        free += stalls == 0
    return ok, total, free, with_audio


# ----------------------------------------------------------------------------- aggregation
@dataclass
class Row:
    streams: int
    system: str
    measured: str
    xrt: float
    ttfa_mean: float | None
    ttfa_p90: float | None
    tok_s: float
    ontime: str


def _stats(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return float(np.mean(values)), float(np.percentile(values, 90))


def engine_row(n: int, bursts: list[Burst]) -> Row:
    results = [r for b in bursts for r in b.results]
    wall = sum(b.wall for b in bursts)
    audio = sum(r.audio_s for r in results)
    tokens = sum(r.tokens for r in results)
    mean, p90 = _stats([r.ttfa for r in results if r.ttfa is not None])
    measured = f"{len(results)} (one at a time, {wall:.1f} s)" if n == 1 else \
        f"{len(results)} (one burst, {wall:.1f} s)"
    return Row(n, "engine", measured, audio / wall, mean, p90, tokens / wall, _ontime_str(results))


def naive_queued_ttfa(n: int, served: list[ReqResult]) -> list[float]:
    """TTFA of each of n burst requests served in order by a sequential server (see METHOD)."""
    by_index = {r.index: r for r in served}
    mean_s = float(np.mean([r.service for r in served]))
    own = [r.ttfa for r in served if r.ttfa is not None]
    mean_t = float(np.mean(own)) if own else None
    ttfas, queued = [], 0.0
    for i in range(n):
        r = by_index.get(i)
        t = r.ttfa if r is not None else mean_t
        if t is not None:
            ttfas.append(queued + t)
        queued += r.service if r is not None else mean_s
    return ttfas


def naive_row(n: int, served: list[ReqResult]) -> Row:
    wall = sum(r.service for r in served)
    audio = sum(r.audio_s for r in served)
    tokens = sum(r.tokens for r in served)
    if n == 1:  # every request alone
        ttfas = [r.ttfa for r in served if r.ttfa is not None]
        measured = f"{len(served)} (one at a time, {wall:.1f} s)"
    else:
        ttfas = naive_queued_ttfa(n, served)
        measured = f"{len(served)} served ({wall:.1f} s), {n - len(served)} extrapolated"
    mean, p90 = _stats(ttfas)
    return Row(n, "naive", measured, audio / wall, mean, p90, tokens / wall, _ontime_str(served))


def _ontime_str(results: list[ReqResult]) -> str:
    ok, total, free, with_audio = on_time(results)
    if not with_audio:
        return "-"
    pct = 100.0 * ok / total if total else 100.0
    return f"{pct:.0f}% ({free}/{with_audio} stall-free)"


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def ratios(rows: list[Row]) -> dict[int, float]:
    naive = {r.streams: r.xrt for r in rows if r.system == "naive"}
    return {r.streams: r.xrt / naive[r.streams] for r in rows
            if r.system == "engine" and naive.get(r.streams, 0) > 0}


def table(rows: list[Row]) -> list[str]:
    lines = [
        "| streams | system | requests measured (wall) | x real time | TTFA mean (s) | TTFA p90 (s) | tokens/s "
        "| on-time chunks | ratio engine/naive |",
        "|---:|---|---|---:|---:|---:|---:|---|---:|",
    ]
    rat = ratios(rows)
    for r in rows:
        ratio = f"**{rat[r.streams]:.2f}x**" if r.system == "engine" and r.streams in rat else \
            ("1.00" if r.system == "naive" else "-")
        lines.append(f"| {r.streams} | {r.system} | {r.measured} | {r.xrt:.3f} | {_f(r.ttfa_mean)} | "
                     f"{_f(r.ttfa_p90)} | {r.tok_s:.1f} | {r.ontime} | {ratio} |")
    return lines


def share_summary(internals: dict[str, tuple[float, int]], wall: float) -> str:
    def pct(*prefixes: str) -> float:
        return 100 * sum(v[0] for k, v in internals.items() if k.startswith(prefixes)) / wall

    model, codec, sampling = pct("LM "), pct("codec"), pct("sampling")
    return (f"{model + codec:.0f}% inside forward + head + codec: {model:.0f}% in the LM (backbone forward + "
            f"audio-slice head), {codec:.0f}% in the codec, {sampling:.0f}% in sampling, "
            f"{100 - model - codec - sampling:.0f}% elsewhere (Python, scheduling)")


def share_percentages(internals: dict[str, tuple[float, int]], wall: float) -> dict[str, float]:
    """Percent of the wall per group of wrapped calls (for the JSON summary and the A/B comparison)."""
    def pct(*prefixes: str) -> float:
        return 100 * sum(v[0] for k, v in internals.items() if k.startswith(prefixes)) / wall if wall else 0.0

    out = {"forward": pct("LM forward"), "head": pct("LM head"), "codec": pct("codec"), "sampling": pct("sampling")}
    out["forward+head+codec"] = out["forward"] + out["head"] + out["codec"]
    out["elsewhere"] = 100 - out["forward+head+codec"] - out["sampling"]
    return out


def internals_lines(title: str, internals: dict[str, tuple[float, int]], wall: float,
                    rest: str = "Python bookkeeping, scheduling, idle waits") -> list[str]:
    if not internals or wall <= 0:
        return []
    lines = [f"{title} (share of wall {wall:.1f} s):", ""]
    inside = 0.0
    for name, (secs, calls) in sorted(internals.items(), key=lambda kv: -kv[1][0]):
        inside += secs
        lines.append(f"- {name}: {secs:.2f} s, {100 * secs / wall:.1f}% ({calls} calls, "
                     f"{1000 * secs / max(calls, 1):.1f} ms each)")
    lines.append(f"- everything else ({rest}): {wall - inside:.2f} s, "
                 f"{100 * (wall - inside) / wall:.1f}%")
    return lines + [""]


# ----------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__, epilog=METHOD,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="orpheus", choices=["orpheus", "csm", "qwen3_tts", "cosyvoice2", "chatterbox",
                                                          "step_audio2", "glm4_voice"],
                    help="csm: perf/csm_bench.py (tiny CSM vs transformers generate + Mimi); qwen3_tts: "
                         "perf/qwen3_tts_bench.py (tiny Qwen3-TTS vs the reference generate + decode); for both "
                         "--max-tokens = frames; cosyvoice2: perf/cosyvoice2_bench.py (tiny CosyVoice2 vs the "
                         "upstream LM + tts(stream=False)), --max-tokens caps its 25 Hz speech tokens; chatterbox: "
                         "perf/chatterbox_bench.py (tiny Chatterbox vs upstream T3.inference + S3Gen), the same cap; "
                         "step_audio2: perf/step_audio2_bench.py (tiny Step-Audio 2 vs encoder + Qwen2 generate + "
                         "upstream Token2wav), --max-tokens caps its LM tokens (text and audio ids), --naive-requests "
                         "defaults to 8; glm4_voice: perf/glm4_voice_bench.py (tiny GLM-4-Voice vs speech tokenizer + "
                         "GlmForCausalLM generate + upstream flow/HiFT blocks), --max-tokens caps its LM tokens (text "
                         "and speech ids), --naive-requests defaults to 6")
    ap.add_argument("--size", default="bench", choices=["bench", "tiny", "quick"],
                    help="checkpoint size: voxbackend.models.orpheus.tiny SIZES, or 'quick' (smoke test)")
    ap.add_argument("--streams", default="1,8,32", help="comma-separated concurrent stream counts")
    ap.add_argument("--max-tokens", type=int, default=256,
                    help="LM tokens per request (7 per 85 ms frame; 256 ~ 3 s of audio, like "
                         "perf/data/pa_orpheus_max256.json)")
    ap.add_argument("--naive-requests", type=int, default=4,
                    help="requests the naive baseline serves for real at each stream count > 1")
    ap.add_argument("--single-rounds", type=int, default=3,
                    help="at 1 stream: requests served one after another, alternating naive and engine")
    ap.add_argument("--seed", type=int, default=0, help="checkpoint seed; request i uses seed + i")
    ap.add_argument("--prompts", type=Path, default=HERE / "data" / "prompts.txt")
    ap.add_argument("--cache-dir", type=Path, default=None, help="where checkpoints are built and reused")
    ap.add_argument("--policy", default="online", choices=["online", "fcfs", "offline"])
    ap.add_argument("--out", type=Path, default=None,
                    help="results file (default perf/results/<date>-<commit>-<machine>-engine_bench.md)")
    ap.add_argument("--profile", action="store_true",
                    help="after the measurements, cProfile one more engine burst at the largest stream count")
    ap.add_argument("--json", type=Path, default=None, help="also write the summary (rows, ratios, shares) as JSON")
    ap.add_argument("--ab-base", type=Path, default=None,
                    help="A/B mode: a checkout of the base commit (git worktree add ... <commit>); runs this bench "
                         "alternately on its voxbackend and on this one, in subprocesses, and writes one comparison")
    ap.add_argument("--ab-reps", type=int, default=2, help="A/B mode: runs per side (the order alternates)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke mode: tiny model, streams 1,4, 42 tokens, one naive request per level")
    args = ap.parse_args(argv)
    if args.quick:
        args.size = "quick"
        args.streams = "1,4" if args.streams == "1,8,32" else args.streams
        args.max_tokens = 42 if args.max_tokens == 256 else args.max_tokens
        args.naive_requests = 1 if args.naive_requests == 4 else args.naive_requests
        args.single_rounds = 1 if args.single_rounds == 3 else args.single_rounds
    if args.model in ("csm", "qwen3_tts"):  # frames of 80 ms: ~3 s (the Orpheus default's audio), ~1 s quick
        args.max_tokens = {256: 38, 42: 12}.get(args.max_tokens, args.max_tokens)
    if args.model in ("cosyvoice2", "chatterbox"):  # 25 Hz tokens, capped at ~6 s (~1.2 s quick)
        args.max_tokens = {256: 150, 42: 30}.get(args.max_tokens, args.max_tokens)
    if args.model == "step_audio2":  # greedy tiny replies are ~1/5 audio ids: up to ~8 s of audio (~0.8 s quick)
        args.max_tokens = {256: 1000, 42: 100}.get(args.max_tokens, args.max_tokens)
        args.naive_requests = {4: 8}.get(args.naive_requests, args.naive_requests)  # reply lengths vary a lot
    if args.model == "glm4_voice":  # greedy tiny replies run to the cap, mostly speech ids: ~30 s of audio (~4 quick)
        args.max_tokens = {256: 400, 42: 80}.get(args.max_tokens, args.max_tokens)
        args.naive_requests = {4: 6}.get(args.naive_requests, args.naive_requests)
    args.stream_counts = sorted({int(s) for s in str(args.streams).split(",") if s.strip()})
    if not args.stream_counts or min(args.stream_counts) < 1:
        ap.error("--streams needs positive integers")
    if args.max_tokens < 1:
        ap.error("--max-tokens must be >= 1")
    return args


def log(msg: str) -> None:
    print(f"[engine_bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    if args.model == "csm":
        import csm_bench  # perf/csm_bench.py

        return csm_bench.run(args, *load_prompts(args.prompts), log)
    if args.model == "qwen3_tts":
        import qwen3_tts_bench  # perf/qwen3_tts_bench.py

        return qwen3_tts_bench.run(args, *load_prompts(args.prompts), log)
    if args.model == "cosyvoice2":
        import cosyvoice2_bench  # perf/cosyvoice2_bench.py

        return cosyvoice2_bench.run(args, *load_prompts(args.prompts), log)
    if args.model == "chatterbox":
        import chatterbox_bench  # perf/chatterbox_bench.py

        return chatterbox_bench.run(args, *load_prompts(args.prompts), log)
    if args.model == "step_audio2":
        import step_audio2_bench  # perf/step_audio2_bench.py

        return step_audio2_bench.run(args, *load_prompts(args.prompts), log)
    if args.model == "glm4_voice":
        import glm4_voice_bench  # perf/glm4_voice_bench.py

        return glm4_voice_bench.run(args, *load_prompts(args.prompts), log)
    if args.ab_base is not None:
        return run_ab(args, argv)
    run_started = time.perf_counter()
    info = provenance.collect()
    cache = args.cache_dir or default_cache()
    log(f"checkpoint size={args.size} seed={args.seed} under {cache}")
    model_dir, codec_dir = ensure_checkpoint(cache, args.size, args.seed)
    prompts, dataset = load_prompts(args.prompts)

    import voxbackend
    from voxbackend import SamplingParams
    from naive_orpheus import NaiveOrpheus, orpheus_prompt_ids

    naive = NaiveOrpheus(model_dir, codec_dir)
    n_max = max(args.stream_counts)
    # enough KV pages for every request of the largest burst at once, so admission never makes one wait
    page = 16
    needed = sum(math.ceil((len(orpheus_prompt_ids(naive.tokenizer, *request_spec(i, prompts, 0)[:2]))
                            + args.max_tokens) / page) for i in range(n_max))
    engine = voxbackend.load(model_dir, codec_dir, policy=args.policy, max_batch=max(32, n_max),
                             page_size=page, kv_pages=max(1024, needed + 16))
    engine.start()
    cfg = engine.config
    lm_params = sum(p.numel() for p in naive.model.parameters())
    embed = naive.model.get_input_embeddings().weight.numel()
    codec_params = sum(p.numel() for p in engine.model.codec.decoder.parameters())
    codec_dim = json.loads((codec_dir / "config.json").read_text()).get("decoder_dim")
    hf = naive.model.config

    log("warm-up (not measured)")
    warm = SamplingParams(max_tokens=35, seed=12345, **OFFICIAL)
    for _ in naive.stream(prompts[0], voice="tara", max_tokens=35, seed=12345):
        pass
    w_done = threading.Event()
    engine.submit(engine.model.prepare(prompts[0], "tara"), warm, lambda e: e.final and w_done.set())
    w_done.wait()

    e_timers, n_timers = Timers(), Timers()
    instrument_engine(engine, e_timers)
    instrument_naive(naive, n_timers)
    rows: list[Row] = []
    shares: dict[int, str] = {}
    share_pct: dict[int, dict[str, float]] = {}
    per_call: dict[int, dict[str, float]] = {}  # ms per wrapped call
    breakdown: list[str] = []
    raw: list[str] = []
    for n in args.stream_counts:
        served: list[ReqResult] = []
        bursts: list[Burst] = []
        n_timers.reset()
        naive_wall = 0.0

        def serve_naive(indices: list[int]) -> None:
            nonlocal naive_wall
            for i in indices:
                log(f"streams={n}: naive request {i}")
                r = run_naive_one(naive, i, prompts, args.seed, args.max_tokens)
                served.append(r)
                naive_wall += r.service

        def engine_burst(indices: list[int]) -> None:
            log(f"streams={n}: engine burst of {len(indices)} (requests {indices[0]}..{indices[-1]})")
            e_timers.reset()
            wall, results = run_engine_burst(engine, indices, prompts, args.seed, args.max_tokens)
            bursts.append(Burst(wall, results, e_timers.snapshot()))

        if n == 1:
            for i in range(args.single_rounds):
                serve_naive([i])
                engine_burst([i])
        else:
            idx = spread(n, args.naive_requests)
            half = (len(idx) + 1) // 2
            serve_naive(idx[:half])
            engine_burst(list(range(n)))
            serve_naive(idx[half:])
        served.sort(key=lambda r: r.index)
        rows.append(naive_row(n, served))
        rows.append(engine_row(n, bursts))
        merged: dict[str, tuple[float, int]] = {}
        for b in bursts:
            for k, (s, c) in b.internals.items():
                merged[k] = (merged.get(k, (0.0, 0))[0] + s, merged.get(k, (0.0, 0))[1] + c)
        shares[n] = share_summary(merged, sum(b.wall for b in bursts))
        share_pct[n] = share_percentages(merged, sum(b.wall for b in bursts))
        per_call[n] = {k: 1000 * secs / max(calls, 1) for k, (secs, calls) in merged.items()}
        breakdown += internals_lines(f"Engine at {n} stream(s)", merged, sum(b.wall for b in bursts))
        breakdown += internals_lines(f"Naive, the requests it served at {n} stream(s)", n_timers.snapshot(),
                                     naive_wall, rest="generate() bookkeeping, logits processors, sampling")
        for system, res in (("naive", served), ("engine", [r for b in bursts for r in b.results])):
            for r in res:
                raw.append(f"| {n} | {system} | {r.index} | {_f(r.ttfa)} | {r.service:.2f} | {r.audio_s:.2f} | "
                           f"{r.tokens} | {len(r.chunk_times)} | {r.finish or '-'} |")
        log("  " + " / ".join(f"{r.system}: {r.xrt:.3f}x RT" for r in rows[-2:]))

    profile_lines: list[str] = []
    if args.profile:
        profile_lines = profile_burst(engine, e_timers, n_max, prompts, args)
    e_timers.restore()
    n_timers.restore()
    engine.shutdown()
    run_seconds = time.perf_counter() - run_started

    rat = ratios(rows)
    md: list[str] = [
        "# Engine vs naive Orpheus (CPU, random weights)",
        "",
        "x real time = audio seconds / wall seconds (higher is better). TTFA = submit to first audio chunk.",
        "All N requests arrive together at t=0 (closed burst). Naive numbers for requests it did not serve are",
        "extrapolated from the ones it served (see Method); ratio = engine x real time / naive x real time,",
        "measured in the same process with the naive requests interleaved around the engine burst.",
        "",
        *table(rows),
        "",
        "Ratio engine/naive (x real time): " + ", ".join(f"{n} streams **{rat[n]:.2f}x**" for n in sorted(rat)),
        "",
        f"Engine wall at {n_max} streams: {shares[n_max]} (details under 'Where the time goes').",
        "",
        "## Setup and provenance",
        "",
        *provenance.markdown_lines(info),
        f"- load average at end: {provenance.load_average()} (the machine is shared: compare ratios, not absolutes)",
        f"- model: Orpheus architecture (LlamaForCausalLM), size `{args.size}`: hidden {hf.hidden_size}, "
        f"{hf.num_hidden_layers} layers, {hf.num_attention_heads} heads / {hf.num_key_value_heads} KV heads, "
        f"MLP {hf.intermediate_size}, vocab {hf.vocab_size}; {lm_params / 1e6:.1f}M parameters "
        f"({embed / 1e6:.1f}M of them the tied embedding / LM head)",
        f"- codec: SNAC 24 kHz layout with decoder_dim {codec_dim} (published: 1024), {codec_params / 1e6:.2f}M "
        "decoder parameters; the engine's voxbackend.models.orpheus.snac, the naive side `snac.SNAC`, same files",
        f"- weights: random (voxbackend.models.orpheus.tiny, seed {args.seed}), cached at {model_dir.parent}",
        f"- dataset: {dataset}; voice of request i: VOICES[i % 8]",
        f"- arrival process: burst (all N at t=0), closed loop; seeds: request i uses seed {args.seed} + i on "
        "both sides",
        f"- sampling (both): temperature {OFFICIAL['temperature']}, top_p {OFFICIAL['top_p']}, repetition_penalty "
        f"{OFFICIAL['repetition_penalty']}, max_tokens {args.max_tokens}, audio-token constraint on. The two systems "
        "draw random numbers differently (engine: counter-based per row; naive: torch global RNG), so equal seeds "
        "give equally distributed, not identical, tokens",
        f"- engine config: policy {cfg.policy}, max_batch {cfg.max_batch}, detok_batch {cfg.detok_batch}, "
        f"kv_pages {cfg.kv_pages} x page_size {cfg.page_size}, prefill_budget {cfg.prefill_budget}, "
        f"dtype {cfg.dtype}, attention torch reference",
        f"- naive: perf/naive_orpheus.py (transformers {_version('transformers')} generate with the official "
        f"logits processors, snac {_version('snac')} per 28-token window), one request at a time",
        f"- whole run took {run_seconds:.0f} s; command: `python perf/engine_bench.py "
        + " ".join(sys.argv[1:] if argv is None else argv) + "`",
        "",
        "## Method",
        "",
        *METHOD.strip().splitlines(),
        "",
        "## Where the time goes",
        "",
        "Wall time inside the main calls, measured by wrapping them for every burst above.",
        "",
        *breakdown,
        *profile_lines,
        "## Per request",
        "",
        "| streams | system | request | TTFA own (s) | service / end (s) | audio (s) | tokens | chunks | finish |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|",
        *raw,
        "",
        "For naive, TTFA own and service are measured from the start of that request's own service (no queueing);",
        "for the engine, from its submit in the burst.",
        "",
    ]
    text = "\n".join(md)
    print("\n".join(table(rows)))
    print()
    print("Ratio engine/naive (x real time = audio s / wall s, higher is better): "
          + ", ".join(f"{n} streams {rat[n]:.2f}x" for n in sorted(rat)))
    out = args.out or HERE / "results" / provenance.result_filename("engine_bench", info)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    log(f"wrote {out} (run took {run_seconds:.0f} s)")
    if args.json is not None:
        summary = dict(package=str(Path(voxbackend.__file__).parent), commit=info["commit"], size=args.size,
                       rows=[dataclasses.asdict(r) for r in rows], ratios=rat, shares=share_pct, ms_per_call=per_call,
                       run_seconds=run_seconds)
        args.json.write_text(json.dumps(summary, indent=1), encoding="utf-8")
    return out


# ----------------------------------------------------------------------------- A/B: base commit vs this tree
def _strip_ab(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--ab-base", "--ab-reps", "--out", "--json"):
            skip = True
            continue
        if a.split("=", 1)[0] in ("--ab-base", "--ab-reps", "--out", "--json"):
            continue
        out.append(a)
    return out


def run_ab(args, argv: list[str] | None) -> Path:
    """Run this bench alternately on the base checkout's voxbackend and on this tree's, one subprocess per run
    (the same bench script and naive baseline both times), then write one table: x real time per side and run,
    engine/naive ratios, the new/base engine ratio, and the shares of the wall at the largest stream count."""
    import subprocess

    base = args.ab_base.resolve()
    if not (base / "voxbackend" / "__init__.py").is_file():
        raise SystemExit(f"--ab-base {base}: no voxbackend package there")
    info = provenance.collect()
    base_commit = provenance.git_commit(base)
    passthrough = _strip_ab(sys.argv[1:] if argv is None else list(argv))
    tmp = Path(tempfile.mkdtemp(prefix="engine_ab-"))
    runs: list[tuple[str, int, dict]] = []
    started = time.perf_counter()
    for rep in range(args.ab_reps):
        order = ("base", "new") if rep % 2 == 0 else ("new", "base")
        for side in order:
            env = dict(os.environ)
            if side == "base":
                env["PYTHONPATH"] = str(base) + os.pathsep + env.get("PYTHONPATH", "")
            js, md = tmp / f"{side}-{rep}.json", tmp / f"{side}-{rep}.md"
            log(f"A/B run {rep + 1}/{args.ab_reps}: {side}")
            subprocess.run([sys.executable, str(Path(__file__).resolve()), *passthrough, "--json", str(js),
                            "--out", str(md)], env=env, check=True)
            runs.append((side, rep, json.loads(js.read_text())))
    seconds = time.perf_counter() - started
    for side, _, r in runs:  # the subprocess really imported the package it was meant to
        want = base if side == "base" else provenance.REPO_ROOT
        if Path(r["package"]).resolve().parent != want:
            raise SystemExit(f"{side} run imported voxbackend from {r['package']}, expected under {want}")
    text = "\n".join(ab_markdown(runs, args, info, base_commit, seconds, passthrough))
    out = args.out or HERE / "results" / provenance.result_filename(f"engine_ab-{args.size}", info)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    print(text)
    log(f"wrote {out}")
    return out


def _xrt(run: dict, n: int, system: str) -> float:
    return next(r["xrt"] for r in run["rows"] if r["streams"] == n and r["system"] == system)


def ab_markdown(runs, args, info, base_commit: str, seconds: float, passthrough: list[str]) -> list[str]:
    streams = sorted({int(n) for _, _, r in runs for n in r["ratios"]})
    n_max = max(streams)
    med = lambda xs: float(np.median(xs)) if xs else float("nan")  # noqa: E731
    lines = [
        f"# Engine A/B: base {base_commit[:8]} vs this tree (size `{args.size}`, CPU, random weights)",
        "",
        "Both sides run the same bench script (perf/engine_bench.py) and the same naive baseline; only the",
        "voxbackend package differs (the base side imports the base checkout's). Runs alternate base/new, then",
        "new/base, so drift in the machine's load hits both. x real time = audio s / wall s (higher is better);",
        "engine/naive = the engine's x real time over the naive baseline's, measured in the same run.",
        "",
        "| run | side | " + " | ".join(f"{n} str: engine xRT | naive xRT | engine/naive" for n in streams)
        + f" | {n_max} str: forward+head+codec % | sampling % | elsewhere % |",
        "|---:|---|" + "---:|---:|---:|" * len(streams) + "---:|---:|---:|",
    ]
    for side, rep, r in runs:
        sh = r["shares"][str(n_max)]
        cells = [f"{_xrt(r, n, 'engine'):.3f} | {_xrt(r, n, 'naive'):.3f} | {r['ratios'][str(n)]:.2f}x"
                 for n in streams]
        lines.append(f"| {rep + 1} | {side} | " + " | ".join(cells)
                     + f" | {sh['forward+head+codec']:.1f} | {sh['sampling']:.1f} | {sh['elsewhere']:.1f} |")
    lines += ["", "Medians over the runs:", "",
              "| streams | engine xRT base | engine xRT new | new/base | engine/naive base | engine/naive new |",
              "|---:|---:|---:|---:|---:|---:|"]
    for n in streams:
        e = {s: med([_xrt(r, n, "engine") for side, _, r in runs if side == s]) for s in ("base", "new")}
        q = {s: med([r["ratios"][str(n)] for side, _, r in runs if side == s]) for s in ("base", "new")}
        lines.append(f"| {n} | {e['base']:.3f} | {e['new']:.3f} | **{e['new'] / e['base']:.2f}x** | "
                     f"{q['base']:.2f}x | **{q['new']:.2f}x** |")
    lines += ["", f"Shares of the engine's wall at {n_max} streams (median of the runs; target: forward + head + "
              "codec >= 90%):", "", "| side | forward | head | codec | forward+head+codec | sampling | elsewhere |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for s in ("base", "new"):
        keys = ("forward", "head", "codec", "forward+head+codec", "sampling", "elsewhere")
        vals = [med([r["shares"][str(n_max)][k] for side, _, r in runs if side == s]) for k in keys]
        lines.append(f"| {s} | " + " | ".join(f"{v:.1f}%" for v in vals) + " |")
    if all("ms_per_call" in r for _, _, r in runs):
        names = sorted({k for _, _, r in runs for k in r["ms_per_call"][str(n_max)]})
        lines += ["", f"Milliseconds per engine call at {n_max} streams. The codec's code is the same on both sides: "
                  "its ms per call gauges the machine's load during each run.", "",
                  "| run | side | " + " | ".join(names) + " |", "|---:|---|" + "---:|" * len(names)]
        for side, rep, r in runs:
            calls = r["ms_per_call"][str(n_max)]
            lines.append(f"| {rep + 1} | {side} | " + " | ".join(f"{calls.get(k, float('nan')):.1f}" for k in names)
                         + " |")
    lines += ["", "## Setup and provenance", "", *provenance.markdown_lines(info),
              f"- base: commit {base_commit} (a `git worktree` checkout), imported through PYTHONPATH",
              f"- load average at end: {provenance.load_average()} (the machine is shared: compare ratios)",
              f"- whole A/B took {seconds:.0f} s; command: `python perf/engine_bench.py "
              + " ".join(sys.argv[1:]) + "`",
              f"- each run: `python perf/engine_bench.py {' '.join(passthrough)}` (see that script's Method)", ""]
    return lines


def profile_burst(engine, timers: Timers, n: int, prompts, args) -> list[str]:
    """cProfile one more burst of n requests, driving the loop on this thread (profilers see one thread)."""
    from voxbackend import EventKind, SamplingParams

    log(f"profile: engine burst of {n} on the calling thread under cProfile")
    engine.shutdown()  # stop the engine thread; step() below drives the same engine
    done = [0]

    def on_event(e) -> None:
        if e.kind is not EventKind.AUDIO:
            done[0] += 1

    for i in range(n):
        text, voice, s = request_spec(i, prompts, args.seed)
        engine.submit(engine.model.prepare(text, voice), SamplingParams(max_tokens=args.max_tokens, seed=s, **OFFICIAL),
                      on_event)
    timers.reset()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    while done[0] < n:
        engine.step()
    prof.disable()
    wall = time.perf_counter() - t0
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(20)
    lines = [f"### cProfile, {n} streams, loop driven on one thread (profiler overhead included)", ""]
    lines += internals_lines("Wrapped calls during the profiled burst", timers.snapshot(), wall)
    body = buf.getvalue().strip().splitlines()
    start = next((k for k, ln in enumerate(body) if "ncalls" in ln), 0)
    lines += ["Top functions by own time:", "", "```", *body[max(0, start - 1):], "```", ""]
    return lines


def _version(pkg: str) -> str:
    try:
        from importlib.metadata import version

        return version(pkg)
    except Exception:  # noqa: BLE001
        return "?"


if __name__ == "__main__":
    main()
