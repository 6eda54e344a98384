"""The CPU perf suite, one command (about 23 minutes on a 2-core machine: 1383 s in the run on e565eabd):

    python perf/run_cpu_suite.py                 # writes perf/results/<date>-<commit>-<machine>.md + plots
    python perf/run_cpu_suite.py --quick         # a 3-minute smoke run of every step (numbers meaningless)

Steps, in order (each one's failure is recorded in the results file; the others still run):
  1. checkpoint  random-weight Orpheus of --size (default "tiny", see SIZING) + reduced SNAC, built once, cached
  2. sizing      in-process engine: per-stream x real time and stall-free at 1, 4 and 8 concurrent streams
  3. servers     tritonserver with the engine repository (policy online) and one with orpheus_naive
  4. pa          perf_analyzer concurrency + Poisson request-rate sweeps against `orpheus`, a short
                 concurrency sweep against `orpheus_engine` (perf/perf_analyzer/*.sh, parse.py)
  5. goodput     open-loop Poisson rate sweeps (clients/loadgen) against engine and naive; goodput and ratio
  6. ablation    the same Poisson loads against one server per policy: online, fcfs, offline, voxserve, and
                 online-pace-floor-0 (online never acting as offline near the machine's limit, detok_pace_floor=0)
  7. overhead    in-process engine, 32 streams kept in flight: share of wall time inside model forward +
                 LM head (candidate_logits) + codec (detokenize)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]

import numpy as np  # noqa: E402

import goodput as gp  # noqa: E402  (perf/goodput.py)
import naive_triton  # noqa: E402  (perf/naive_triton.py)
import provenance  # noqa: E402  (perf/provenance.py)
from voxbackend.config import POLICIES  # noqa: E402
from clients.loadgen import RequestOptions, load_prompts, run_load  # noqa: E402
from clients.stream_metrics import (StreamTimeline, goodput_label, markdown_table,  # noqa: E402
                                    summarize)

# the ablation's servers: every policy with its defaults (online on a CPU: arrival order and full codec batches
# near the machine's limit), and online without that switch (detok_pace_floor 0), measured in the same run
ABLATION_SERVERS: tuple[tuple[str, str, dict[str, str]], ...] = tuple((p, p, {}) for p in POLICIES) + (
    ("online-pace-floor-0", "online", {"detok_pace_floor": "0"}),)  # label, policy, engine parameters

SAMPLE_RATE = 24000
SIZING = """\
Why this size: on this 2-core CPU the "bench" size (hidden 512, 8 layers, 105M parameters with the
Orpheus vocabulary) decodes one engine stream at about 0.5x real time (perf/engine_bench.py), so no stream
can play without stalls and every goodput is zero by definition. "tiny" (hidden 128, 4 layers) is the
largest preset at which the engine plays a stream faster than real time; the sizing table below says how
many concurrent streams it keeps above 1x on this run. Its decode step is dominated by fixed per-step costs
(Python, op dispatch, sampling over 4097 candidates, the SNAC decoder), not by the matrix sizes, so the
engine-vs-naive ratio here understates what batching gives on a GPU with a 3B model (where a step is
memory-bound and batching pays far more).
The overhead step therefore also measures "bench", where the model's matrices do dominate."""
DEFINITIONS = """\
Metric definitions (docs/metrics.md, used exactly):
- TTFA: from the moment the client sends the request to the arrival of the first audio samples.
- Streaming viability: playback starts when the first audio arrives. Chunk i (i >= 1) is on time if the audio
  received before it (chunks 0..i-1) is longer than the time elapsed since the first audio arrived. A request
  is stall-free if every chunk is on time (a request that errored or got no audio is not stall-free).
  Reported: per-chunk on-time % and stall-free request %.
- Goodput: the highest request rate (Poisson arrivals, open loop) at which p90 TTFA <= the target and
  >= 99% of requests are stall-free (targets stated next to every number).
- x real time = audio seconds / wall seconds (higher is better).
- Percentiles: numpy.percentile, linear interpolation."""


# ----------------------------------------------------------------------------- settings
@dataclass
class Settings:
    size: str = "tiny"
    max_tokens: int = 256
    seed: int = 0
    # up to well past the engine's knee, so its best x real time is its capacity, not the offered load
    rates: list[float] = field(default_factory=lambda: [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.4, 3.2, 4.8])
    duration: float = 30.0
    ttfa_p90: float = 1.0
    stall_free: float = 0.99
    ablation_rates: list[float] | None = None  # None: the knee of the engine's sweep and the next rate
    player_buffers: list[float] = field(default_factory=lambda: [0.5, 1.0])  # ablation: stall-free again for
    # players that start once this much audio is in (the same streams, judged after their startup buffer)
    ablation_duration: float = 30.0
    ablation_seeds: list[int] = field(default_factory=lambda: [1, 2])  # arrival seeds (seed + k), for the spread
    pa_count: int = 6  # requests per count window; 3 windows per level (stability check off: see s_pa)
    pa_trials: int = 3
    pa_concurrency: str = "1:8:3"
    pa_rates: str = "0.4:1.25:0.4"  # PA steps in floats: an end of exactly 1.2 drops the 1.2 level
    pa_engine_concurrency: str = "1:4:3"
    overhead_sizes: list[str] = field(default_factory=lambda: ["tiny", "bench"])
    overhead_streams: int = 32
    overhead_rounds: float = 2.5  # requests submitted = rounds * streams; the window ends at the last submit
    request_timeout: float = 180.0
    first_chunk_s: float = 0.0  # engine option: hold each stream's first audio until it is this long
    skip: list[str] = field(default_factory=list)  # steps not run (e.g. a rerun of goodput + ablation alone)
    quick: bool = False

    @classmethod
    def quick_settings(cls) -> "Settings":
        return cls(max_tokens=63, rates=[0.3, 0.6], duration=8.0, ablation_duration=8.0, ablation_seeds=[1],
                   pa_count=3, pa_trials=3,
                   pa_concurrency="1:2:1", pa_rates="0.5:0.5:0.5", pa_engine_concurrency="1:1:1",
                   overhead_sizes=["tiny"], overhead_streams=8, overhead_rounds=1.5, request_timeout=60.0,
                   quick=True)


# ----------------------------------------------------------------------------- small pure helpers (tested)
def overlap(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] covered by the (non-overlapping) intervals."""
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in intervals)


def choose_ablation_rate(results: dict[float, dict], ttfa_p90: float, min_on_time_pct: float = 80.0) -> float:
    """The highest swept rate whose p90 TTFA met the target and whose chunks were mostly on time: the load
    just below the knee, where scheduling decides who stalls. (TTFA alone is not enough: past the throughput
    knee TTFA can still look fine while every stream falls behind.) The lowest swept rate when none qualifies."""
    ok = [r for r, s in results.items() if s.get("ttfa_p90_s") is not None and s["ttfa_p90_s"] <= ttfa_p90
          and (s.get("on_time_chunk_pct") or 0.0) >= min_on_time_pct]
    return max(ok) if ok else min(results)


def ablation_rates(results: dict[float, dict], knee: float) -> list[float]:
    """The knee rate and the next swept rate above it (where the engine starts to fall behind)."""
    above = sorted(r for r in results if r > knee)
    return [knee] + above[:1]


def ablation_table(rows: dict[str, dict], per_seed: dict[str, list[dict]] | None = None) -> str:
    """One row per label (policy, or policy @ rate); with per_seed, the seeds' own stall-free % (the spread)."""
    def ms(v): return "-" if v is None else f"{1000 * v:.0f}"
    def pct(v): return "-" if v is None else f"{v:.1f}"
    seeds = per_seed is not None
    buffers = sorted({b for s in rows.values() for b in s.get("stall_free_pct_after", {})})
    lines = ["| policy | requests | errors | TTFA p50 (ms) | p90 | p99 | on-time chunks % | stall-free % | "
             + "".join(f"stall-free after {b:g} s | " for b in buffers)
             + "x real time |" + (" stall-free % per seed |" if seeds else ""),
             "|---|---|---|---|---|---|---|---|" + "---|" * len(buffers) + "---|" + ("---|" if seeds else "")]
    for label, s in rows.items():
        xrt = "-" if s.get("x_real_time") is None else f"{s['x_real_time']:.2f}"
        after = "".join(f"{pct(s.get('stall_free_pct_after', {}).get(b))} | " for b in buffers)
        line = (f"| {label} | {s['count']} | {s['errors']} | {ms(s['ttfa_p50_s'])} | {ms(s['ttfa_p90_s'])} | "
                f"{ms(s['ttfa_p99_s'])} | {pct(s['on_time_chunk_pct'])} | {pct(s['stall_free_pct'])} | {after}{xrt} |")
        if seeds:
            line += " " + ", ".join(pct(x["stall_free_pct"]) for x in per_seed.get(label, [])) + " |"
        lines.append(line)
    return "\n".join(lines)


def stall_positions(raw: dict[float, list[dict]]) -> str:
    """Where streams first ran dry, over every rate: the chunk index of the first late chunk. Stalls at chunk
    1-2 mean the stream started with too little buffer (one 85 ms window); later ones mean sustained slowness."""
    from clients.stream_metrics import on_time_flags

    firsts = []
    for tls in raw.values():
        for d in tls:
            flags = on_time_flags(StreamTimeline.from_dict(d))
            if not all(flags):
                firsts.append(flags.index(False) + 1)
    if not firsts:
        return "No stream stalled."
    bins = {"chunk 1": sum(f == 1 for f in firsts), "chunk 2-3": sum(2 <= f <= 3 for f in firsts),
            "chunk 4-10": sum(4 <= f <= 10 for f in firsts), "chunk 11+": sum(f > 10 for f in firsts)}
    return (f"First late chunk of the {len(firsts)} stalled streams (all rates): "
            + ", ".join(f"{k}: {v}" for k, v in bins.items()) + ".")


# ----------------------------------------------------------------------------- checkpoint
def checkpoint(size: str) -> tuple[Path, Path]:
    """tiny: the project's default checkpoint (what the servers load when none is configured); others: cached."""
    from voxbackend.models.orpheus import tiny as tc

    if size == "tiny":
        m, c = tc.ensure_default_checkpoint()
        return Path(m), Path(c)
    base = os.environ.get("VOXBACKEND_CACHE")
    root = (Path(base) if base else Path.home() / ".cache" / "voxbackend") / f"suite-{size}-seed0"
    if not (root / ".complete").exists():
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent if root.parent.exists() else None))
        tc.write_default(tmp, seed=0, size=size)
        (tmp / ".complete").write_text("ok\n")
        root.parent.mkdir(parents=True, exist_ok=True)
        if not root.exists():
            os.rename(tmp, root)
        shutil.rmtree(tmp, ignore_errors=True)
    return root / "orpheus", root / "snac_24khz"


def describe_model(model_dir: Path, codec_dir: Path, size: str) -> str:
    cfg = json.loads((model_dir / "config.json").read_text())
    n = 0
    try:
        from safetensors import safe_open

        for f in model_dir.glob("*.safetensors"):
            with safe_open(str(f), "np") as st:
                n += sum(int(np.prod(st.get_slice(k).get_shape())) for k in st.keys())
    except Exception:  # noqa: BLE001 - provenance only
        n = 0
    snac = json.loads((codec_dir / "config.json").read_text())
    return (f"Orpheus architecture (LlamaForCausalLM), size `{size}`: hidden {cfg['hidden_size']}, "
            f"{cfg['num_hidden_layers']} layers, {cfg['num_attention_heads']} heads / {cfg['num_key_value_heads']} KV "
            f"heads, MLP {cfg['intermediate_size']}, vocab {cfg['vocab_size']}"
            + (f"; {n / 1e6:.1f}M parameters (tied embedding / LM head included once)" if n else "")
            + f"; codec SNAC 24 kHz layout with decoder_dim {snac['decoder_dim']} (published: 1024)")


# ----------------------------------------------------------------------------- in-process engine runs
class IntervalTimers:
    """Records (start, end) of every call of a few wrapped methods (CPU torch is synchronous)."""

    def __init__(self):
        self.intervals: dict[str, list[tuple[float, float]]] = {}
        self._undo: list = []

    def wrap(self, owner, attr: str, name: str) -> None:
        original = getattr(owner, attr)
        had_own = attr in vars(owner)
        spans = self.intervals.setdefault(name, [])

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spans.append((t0, time.perf_counter()))

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, original, had_own))

    def restore(self) -> None:
        for owner, attr, original, had_own in reversed(self._undo):
            if had_own:
                setattr(owner, attr, original)
            else:
                delattr(owner, attr)
        self._undo.clear()


def _sampling(max_tokens: int, seed: int):
    from voxbackend import SamplingParams

    return SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3, max_tokens=max_tokens, seed=seed)


def engine_burst(engine, prompts: list[str], n: int, max_tokens: int, seed: int) -> dict:
    """n requests submitted together; per-stream x real time and stall-free (docs/metrics.md definitions)."""
    from voxbackend import EventKind

    done, lock = threading.Event(), threading.Lock()
    timelines: dict[str, StreamTimeline] = {}
    left = [n]

    def on_event(e) -> None:
        now = time.perf_counter()
        tl = timelines[e.request_id]
        if e.kind is EventKind.AUDIO:
            tl.chunks.append((now, len(e.audio) / SAMPLE_RATE))
            return
        tl.end_time, tl.error = now, e.error
        with lock:
            left[0] -= 1
            if left[0] == 0:
                done.set()

    ids = [engine.model.prepare(prompts[i % len(prompts)], None) for i in range(n)]
    t0 = time.perf_counter()
    for i in range(n):
        rid = f"burst-{n}-{i}"
        timelines[rid] = StreamTimeline(send_time=time.perf_counter(), request_id=rid)
        engine.submit(ids[i], _sampling(max_tokens, seed + i), on_event, request_id=rid)
    done.wait(timeout=600)
    s = summarize(list(timelines.values()), wall_s=time.perf_counter() - t0)
    s["per_stream_x_real_time"] = (s["x_real_time"] or 0.0) / n
    return s


def engine_overhead(engine, prompts: list[str], streams: int, total: int, max_tokens: int, seed: int) -> dict:
    """Keep `streams` requests in flight (closed loop); share of the window spent inside the wrapped calls.

    The window runs from the first submit to the last submit: all along it `streams` requests are in flight
    (a finished one is replaced at once). Requests still running after it are cancelled, not measured."""
    import queue as _queue

    import voxbackend.engine.model_runner as runner_mod
    from voxbackend import EventKind

    timers = IntervalTimers()
    timers.wrap(engine.model, "forward", "model forward (backbone)")
    timers.wrap(engine.model, "candidate_logits", "LM head (candidate_logits)")
    timers.wrap(engine.model, "detokenize", "codec (detokenize)")
    timers.wrap(runner_mod, "sample", "sampling (outside the goal)")
    finished: _queue.SimpleQueue = _queue.SimpleQueue()
    tokens = [0]

    def on_event(e) -> None:
        if e.kind is not EventKind.AUDIO:
            tokens[0] += len(e.token_ids or [])
            finished.put(e.request_id)

    ids = [engine.model.prepare(prompts[i % len(prompts)], None) for i in range(total)]
    live: set[str] = set()
    submitted = 0

    def submit() -> None:
        nonlocal submitted
        rid = f"ovh-{submitted}"
        live.add(rid)
        engine.submit(ids[submitted], _sampling(max_tokens, seed + submitted), on_event, request_id=rid)
        submitted += 1

    try:
        t_start = time.perf_counter()
        for _ in range(streams):
            submit()
        while submitted < total:
            live.discard(finished.get(timeout=600))
            submit()
        t_end = time.perf_counter()
        for rid in list(live):
            engine.cancel(rid)
        deadline = time.time() + 120
        while live and time.time() < deadline:
            try:
                live.discard(finished.get(timeout=5))
            except _queue.Empty:
                break
    finally:
        timers.restore()
    wall = t_end - t_start
    parts = {name: overlap(spans, t_start, t_end) for name, spans in timers.intervals.items()}
    goal = sum(v for k, v in parts.items() if not k.startswith("sampling"))
    return {"wall_s": wall, "parts_s": parts, "goal_share": goal / wall if wall else None,
            "requests_in_window": total, "streams": streams}


def run_in_process(model_dir: Path, codec_dir: Path, sizes: list[int], max_tokens: int, seed: int,
                   prompts: list[str]) -> dict[int, dict]:
    import voxbackend

    engine = voxbackend.load(model_dir, codec_dir, policy="online").start()
    try:
        engine_burst(engine, prompts, 1, 28, seed)  # warm-up (first-call allocations)
        return {n: engine_burst(engine, prompts, n, max_tokens, seed) for n in sizes}
    finally:
        engine.shutdown()


def run_overhead(model_dir: Path, codec_dir: Path, st: Settings, prompts: list[str]) -> dict:
    import voxbackend

    engine = voxbackend.load(model_dir, codec_dir, policy="online", max_batch=max(32, st.overhead_streams)).start()
    try:
        engine_burst(engine, prompts, 1, 28, st.seed)  # warm-up
        total = int(st.overhead_rounds * st.overhead_streams)
        return engine_overhead(engine, prompts, st.overhead_streams, total, st.max_tokens, st.seed)
    finally:
        engine.shutdown()


# ----------------------------------------------------------------------------- servers
def engine_server(model_dir: Path, codec_dir: Path, policy: str, work: Path, first_chunk_s: float = 0.0,
                  params: dict[str, str] | None = None):
    """tritonserver on a rendered copy of model_repository (what `voxbackend serve --set policy=...` does)."""
    from voxbackend.deploy import configs
    from voxbackend.deploy.server import TritonServer

    work.mkdir(parents=True, exist_ok=True)
    repo = configs.write_repository(work / "model_repository", {
        "checkpoint": str(model_dir), "codec": str(codec_dir), "policy": policy, "device": "cpu",
        "first_chunk_s": str(first_chunk_s), **(params or {})}, models=["orpheus"])
    # only Orpheus: the overrides above apply to every served model, and other models (CSM, ...) would
    # otherwise be pointed at the Orpheus checkpoint, or load their own and take CPU from the benchmark
    keep = {"orpheus", "orpheus_engine", "orpheus_preprocess"}
    for folder in Path(repo).iterdir():
        if folder.is_dir() and folder.name not in keep:
            shutil.rmtree(folder)
    return TritonServer(repo, work_dir=work).start(timeout=600)


# ----------------------------------------------------------------------------- perf_analyzer
def perf_analyzer(script: str, url: str, model: str, rng: str, st: Settings, out: Path, log) -> str:
    env = {**os.environ, "URL": url, "MODEL": model, "RANGE": rng, "COUNT": str(st.pa_count),
           "MAX_TRIALS": str(st.pa_trials), "STABILITY": "1000", "OUT": str(out), "PYTHON": sys.executable,
           "INPUT_DATA": str(HERE / "data" / ("pa_orpheus_max256.json" if st.max_tokens >= 256 else "pa_orpheus.json"))}
    cmd = ["bash", str(HERE / "perf_analyzer" / script)]
    for attempt in (1, 2):  # one retry: seen once, "failed to find the requested model version" mid-sweep
        t0 = time.time()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        (out / f"{model}_{script.replace('.sh', '')}.log").write_text(done.stdout + "\n" + done.stderr)
        log(f"  {script} {model} {rng}: exit {done.returncode} in {time.time() - t0:.0f} s (attempt {attempt})")
        if done.returncode == 0:
            break
    if done.returncode != 0:
        raise RuntimeError(f"{script} failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-2000:]}")
    kind = "concurrency" if "concurrency" in script else "request_rate"
    return (out / f"{model}_{kind}.md").read_text()


# ----------------------------------------------------------------------------- the suite
class Suite:
    def __init__(self, st: Settings, out_dir: Path):
        self.st = st
        self.info = provenance.collect()
        commit = self.info["commit_short"] + ("-dirty" if self.info["dirty"] != "no" else "")
        stem = f"{self.info['date_slug']}-{commit}-{provenance.machine_slug()}" + ("-quick" if st.quick else "")
        self.md_path = out_dir / f"{stem}.md"
        self.assets = out_dir / stem  # plots, CSVs and JSON next to the results file
        self.assets.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="voxbackend-suite-"))
        self.sections: dict[str, str] = {}
        self.timings: list[tuple[str, float, str, str]] = []  # name, seconds, status, load average at its end
        self.data: dict = {}
        self.t0 = time.time()
        self.prompts = load_prompts(HERE / "data" / "prompts.txt")

    def log(self, msg: str) -> None:
        print(f"[{time.time() - self.t0:6.0f} s] {msg}", flush=True)

    def step(self, name: str, fn) -> None:
        if name in self.st.skip:
            self.timings.append((name, 0.0, "skipped (--skip)", "-"))
            return
        self.log(f"== {name}")
        t = time.time()
        try:
            fn()
            status = "ok"
        except Exception as e:  # noqa: BLE001 - record and go on: one broken step must not lose the others
            status = f"FAILED: {type(e).__name__}: {str(e)[:300]}"
            self.log(traceback.format_exc())
        # the machine is shared: the load while a step ran says how far its numbers can be trusted
        self.timings.append((name, time.time() - t, status, provenance.load_average()))
        self.log(f"== {name}: {status} ({time.time() - t:.0f} s)")
        self.write()  # keep a partial results file after every step

    # -- steps
    def s_checkpoint(self) -> None:
        self.model_dir, self.codec_dir = checkpoint(self.st.size)
        self.model_desc = describe_model(self.model_dir, self.codec_dir, self.st.size)
        self.log(f"  {self.model_desc}")

    def s_sizing(self) -> None:
        sizes = [1, 2] if self.st.quick else [1, 4, 8]
        res = run_in_process(self.model_dir, self.codec_dir, sizes, self.st.max_tokens, self.st.seed, self.prompts)
        self.data["sizing"] = res
        lines = ["| concurrent streams (burst) | x real time (all) | x real time per stream | TTFA p90 (ms) "
                 "| on-time chunks % | stall-free % |", "|---|---|---|---|---|---|"]
        for n, s in res.items():
            lines.append(f"| {n} | {s['x_real_time']:.2f} | {s['per_stream_x_real_time']:.2f} | "
                         f"{1000 * (s['ttfa_p90_s'] or 0):.0f} | {s['on_time_chunk_pct'] or 0:.1f} | "
                         f"{s['stall_free_pct']:.0f} |")
        self.sections["sizing"] = (
            f"## Model size and real-time check\n\n{SIZING}\n\nIn-process engine (policy online), {self.st.max_tokens} "
            f"max tokens, all streams submitted at once:\n\n" + "\n".join(lines))

    def s_servers(self) -> None:
        self.engine_srv = engine_server(self.model_dir, self.codec_dir, "online", self.work / "online",
                                      self.st.first_chunk_s)
        self.log(f"  engine (online) on {self.engine_srv.grpc_url}")

    def s_pa(self) -> None:
        out = self.assets / "pa"
        out.mkdir(exist_ok=True)
        url, st = self.engine_srv.grpc_url, self.st
        parts = ["## perf_analyzer (gRPC streaming)", "",
                 "perf_analyzer 2.51 (tritonclient wheel), count windows of "
                 f"{st.pa_count} requests, {st.pa_trials} windows per level (stability check off, -s 1000: "
                 "Poisson windows of a few requests are never 'stable', and the suite must end in time), input "
                 f"{'perf/data/pa_orpheus_max256.json' if st.max_tokens >= 256 else 'perf/data/pa_orpheus.json'} "
                 "(the prompt set, MAX_TOKENS fixed). First-response (TTFA) percentiles come from the profile "
                 "export (parse.py): perf_analyzer's own CSV latencies are to the last response of each stream.", ""]
        for title, script, model, rng in (
                ("`orpheus` model, concurrency sweep", "concurrency_sweep.sh", "orpheus", st.pa_concurrency),
                ("`orpheus` model, Poisson request-rate sweep", "request_rate_sweep.sh", "orpheus", st.pa_rates),
                ("`orpheus_engine` directly, concurrency sweep", "concurrency_sweep.sh", "orpheus_engine",
                 st.pa_engine_concurrency)):
            try:
                md = perf_analyzer(script, url, model, rng, st, out, self.log)
                png = f"{model}_{'concurrency' if 'concurrency' in script else 'request_rate'}.png"
                parts += [f"### {title} (range {rng})", "", md.strip(), "",
                          f"![{title}]({self.assets.name}/pa/{png})", ""]
            except Exception as e:  # noqa: BLE001
                parts += [f"### {title} (range {rng})", "", f"FAILED: {e}", ""]
                self.log(f"  {title}: {e}")
            self.sections["pa"] = "\n".join(parts)

    def s_goodput(self) -> None:
        st = self.st
        opts = RequestOptions(max_tokens=st.max_tokens, sampling_seed=st.seed)
        targets = [gp.Target("engine", self.engine_srv.grpc_url, "orpheus")]
        naive_srv = naive_triton.start_server(str(self.model_dir), str(self.codec_dir), work_dir=self.work / "naive")
        targets.append(gp.Target("naive", naive_srv.grpc_url, naive_triton.MODEL_NAME))
        try:
            # engine and naive take turns at each rate; stop on the TTFA target alone (stall-free 0): the
            # secondary goodput needs that range too
            results, raw = gp.sweep(targets, st.rates, self.prompts, st.duration, seed=st.seed, burstiness=1.0,
                                    opts=opts, ttfa_p90=st.ttfa_p90, stall_free=0.0, stop_after_failures=2,
                                    request_timeout=st.request_timeout, log=lambda m: self.log("  " + m))
            self.data["goodput"] = {n: {str(r): s for r, s in res.items()} for n, res in results.items()}
        finally:
            naive_srv.stop()
        self.goodput_results = results
        png = self.assets / "goodput.png"
        gp.plot(results, png, st.ttfa_p90, st.stall_free)
        xrt = {n: max((s["x_real_time"] or 0.0) for s in r.values()) for n, r in results.items()}
        xrt_ratio = f"{xrt['engine'] / xrt['naive']:.2f}x" if xrt.get("naive") else "-"
        parts = ["## Goodput: engine (`orpheus` model) vs naive baseline (`orpheus_naive`)", "",
                 f"Poisson arrivals (open loop, clients/loadgen), {st.duration:g} s of arrivals per rate, "
                 f"seed {st.seed}, "
                 f"served engines with first_chunk_s = {st.first_chunk_s:g} s, "
                 f"request i reads a prompt of perf/data/prompts.txt (seeded choice) with SEED {st.seed} + i, "
                 f"max_tokens {st.max_tokens}, official sampling defaults (temperature 0.6, top_p 0.8, "
                 "repetition_penalty 1.3). Engine and naive take turns at each rate (both servers up, one loaded at a "
                 "time), so each ratio compares runs minutes apart. A target's sweep stops after two consecutive "
                 "rates miss the TTFA target.", "",
                 "### Goodput targets (docs/metrics.md)", "",
                 gp.goodput_table(results, st.ttfa_p90, st.stall_free, "naive"), "",
                 "### TTFA target only (stall-free target 0%: no streaming-viability requirement)", "",
                 gp.goodput_table(results, st.ttfa_p90, 0.0, "naive"), "",
                 f"Highest x real time reached at any tested rate (throughput): engine {xrt['engine']:.2f}, "
                 f"naive {xrt.get('naive', 0):.2f} -> ratio {xrt_ratio}.", ""]
        for name, res in results.items():
            parts += [f"### {name}", "", markdown_table(res), "", stall_positions(raw[name]), ""]
        parts += [f"![goodput]({self.assets.name}/goodput.png)", ""]
        self.sections["goodput"] = "\n".join(parts)

    def s_ablation(self) -> None:
        st = self.st
        engine_res = getattr(self, "goodput_results", {}).get("engine")
        if st.ablation_rates:
            rates = list(st.ablation_rates)
        elif engine_res:
            rates = ablation_rates(engine_res, choose_ablation_rate(engine_res, st.ttfa_p90))
        else:
            rates = [st.rates[len(st.rates) // 2]]
        opts = RequestOptions(max_tokens=st.max_tokens, sampling_seed=st.seed)
        rows: dict[str, dict] = {}
        per_seed: dict[str, list[dict]] = {}
        for name, policy, params in ABLATION_SERVERS:
            srv = self.engine_srv if name == "online" else engine_server(
                self.model_dir, self.codec_dir, policy, self.work / name, st.first_chunk_s, params)
            try:
                for rate in rates:
                    label, pooled = f"{name} @ {rate:g} req/s", []
                    for k in st.ablation_seeds:
                        tls = run_load(srv.grpc_url, "orpheus", self.prompts, rate, st.ablation_duration,
                                       seed=st.seed + k, opts=opts, request_timeout=st.request_timeout)
                        per_seed.setdefault(label, []).append(summarize(tls))
                        pooled += tls
                    # the seeds ran one after another: the pooled row's wall is the sum of theirs
                    rows[label] = summarize(pooled, wall_s=sum(x["wall_s"] or 0.0 for x in per_seed[label]))
                    rows[label]["stall_free_pct_after"] = {
                        b: summarize(pooled, startup_s=b)["stall_free_pct"] for b in st.player_buffers}
                    self.log(f"  {label}: "
                             f"{json.dumps({k: rows[label][k] for k in ('count', 'ttfa_p90_s', 'stall_free_pct')})}")
            finally:
                if srv is not self.engine_srv:
                    srv.stop()
        self.data["ablation"] = {"rates": rates, "seeds": st.ablation_seeds, "rows": rows, "per_seed": per_seed}
        self.sections["ablation"] = "\n".join([
            "## Scheduler ablation (real time, through Triton)", "",
            f"The same Poisson loads ({', '.join(f'{r:g}' for r in rates)} req/s, {st.ablation_duration:g} s of "
            f"arrivals each, arrival seeds {', '.join(str(st.seed + k) for k in st.ablation_seeds)}, max_tokens "
            f"{st.max_tokens}) against one server per policy (`--set policy=...`): `online` = streaming-aware "
            "(pressing streams first, windows deferred while a buffer is thick; on a CPU, arrival order and full "
            "codec batches near the machine's limit), `online-pace-floor-0` = the same policy without that switch "
            "(`detok_pace_floor=0`), "
            "`fcfs` = plain continuous "
            "batching, `offline` = largest LM batch, detokenize in bulk, `voxserve` = VoxServe's published online "
            "policy (docs/scheduling.md). Rates: " + ("given with --ablation-rates" if st.ablation_rates else
            "the highest goodput-sweep rate at which the engine met the p90 TTFA target with >= 80% of chunks on "
            "time (just below the knee) and the next swept rate (above it)") + ". "
            "Each row pools its seeds' requests (x real time: their audio over their summed walls). Stall-free "
            "counts from the first audio (docs/metrics.md); the columns 'after X s' judge the same streams for a "
            "player that starts once X s of audio is in (startup buffer, as real players do). The last column is "
            "each seed's own stall-free share (the spread).", "", ablation_table(rows, per_seed), ""])

    def s_overhead(self) -> None:
        st = self.st
        lines = ["| model size | streams in flight | window (s) | model forward | LM head | codec | "
                 "forward + head + codec (goal >= 90%) | sampling | everything else |",
                 "|---|---|---|---|---|---|---|---|---|"]
        self.data["overhead"] = {}
        for size in st.overhead_sizes:
            model_dir, codec_dir = checkpoint(size) if size != self.st.size else (self.model_dir, self.codec_dir)
            r = run_overhead(model_dir, codec_dir, st, self.prompts)
            self.data["overhead"][size] = r
            p, w = r["parts_s"], r["wall_s"]
            f = lambda k: 100 * p.get(k, 0.0) / w  # noqa: E731
            rest = 100 - sum(f(k) for k in p)
            lines.append(f"| {size} | {r['streams']} | {w:.1f} | {f('model forward (backbone)'):.1f}% | "
                         f"{f('LM head (candidate_logits)'):.1f}% | {f('codec (detokenize)'):.1f}% | "
                         f"**{100 * r['goal_share']:.1f}%** | {f('sampling (outside the goal)'):.1f}% | {rest:.1f}% |")
            self.log(f"  {size}: {lines[-1]}")
        self.sections["overhead"] = "\n".join([
            "## Engine overhead", "",
            f"In-process engine (policy online, max_batch 32), {st.overhead_streams} streams kept in flight "
            f"(closed loop: a finished request is replaced at once; {int(st.overhead_rounds * st.overhead_streams)} "
            f"requests, {st.max_tokens} max tokens). Window: first submit to last submit, so the batch is full "
            "throughout; calls are timed by wrapping `engine.model.forward`, `engine.model.candidate_logits`, "
            "`engine.model.detokenize` and the sampler, and clipped to the window. The goal counts forward + "
            "LM head + codec; everything else is scheduling, bookkeeping, tensor assembly and event delivery.", "",
            *lines, ""])

    # -- output
    def write(self) -> None:
        st, info = self.st, self.info
        prov = [f"- {k.replace('_', ' ')}: {info[k]}" for k in
                ("date", "commit", "dirty", "cpu", "gpu", "load_average_at_start", "python", "torch", "host_os")]
        prov += [f"- load average now: {provenance.load_average()}",
                 f"- model: {getattr(self, 'model_desc', st.size)}",
                 "- weights: random (voxbackend.models.orpheus.tiny, seed 0); random weights emit random audio "
                 "codes and now and then the stop token, the same for engine and naive",
                 f"- dataset: perf/data/prompts.txt ({len(self.prompts)} sentences written for this project)",
                 "- arrival process: Poisson, open loop (goodput, ablation, perf_analyzer request-rate); "
                 "closed loop (perf_analyzer concurrency, in-process sizing and overhead)",
                 f"- seed: {st.seed} (arrivals and prompt choice; request i samples with SEED {st.seed} + i)",
                 f"- settings: {json.dumps(st.__dict__)}",
                 f"- command: `{' '.join([Path(sys.executable).name, *sys.argv])}`",
                 f"- suite wall time: {time.time() - self.t0:.0f} s"]
        timing = ["| step | seconds | status | load average at its end (1, 5, 15 min) |", "|---|---|---|---|"] + [
            f"| {n} | {t:.0f} | {s} | {load} |" for n, t, s, load in self.timings]
        body = [f"# CPU perf suite: {self.md_path.stem}", "",
                f"Goodput targets: {goodput_label(st.ttfa_p90, st.stall_free)} (docs/metrics.md).", "",
                "## Provenance", "", *prov, "", DEFINITIONS, ""]
        for key in ("goodput", "ablation", "overhead", "pa", "sizing"):
            if key in self.sections:
                body += [self.sections[key], ""]
        body += ["## Steps", "", *timing, ""]
        self.md_path.write_text("\n".join(body))
        (self.assets / "data.json").write_text(json.dumps(self.data, indent=1, default=str))

    def run(self) -> Path:
        self.step("checkpoint", self.s_checkpoint)
        self.step("sizing", self.s_sizing)
        try:
            self.step("servers", self.s_servers)
            if hasattr(self, "engine_srv"):
                self.step("perf_analyzer", self.s_pa)
                self.step("goodput", self.s_goodput)
                self.step("ablation", self.s_ablation)
        finally:
            if hasattr(self, "engine_srv"):
                self.engine_srv.stop()
        self.step("overhead", self.s_overhead)  # last: the servers are down, the CPU is the engine's alone
        self.write()
        shutil.rmtree(self.work, ignore_errors=True)
        self.log(f"wrote {self.md_path}")
        return self.md_path


SKIPPABLE = ("sizing", "perf_analyzer", "goodput", "ablation", "overhead")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: every step, small loads (numbers meaningless)")
    ap.add_argument("--size", default=None, choices=["tiny", "bench"], help="served model size (default tiny)")
    ap.add_argument("--rates", default=None, help="goodput sweep rates, comma-separated req/s")
    ap.add_argument("--duration", type=float, default=None, help="seconds of arrivals per rate")
    ap.add_argument("--ttfa-p90", type=float, default=None, help="p90 TTFA target, seconds (default 1.0)")
    ap.add_argument("--stall-free", type=float, default=None, help="stall-free share target (default 0.99)")
    ap.add_argument("--ablation-rates", default=None, help="comma-separated req/s; default: chosen from the "
                    "goodput sweep (its knee and the next rate)")
    ap.add_argument("--overhead-sizes", default=None, help="comma-separated, default tiny,bench")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--first-chunk-s", type=float, default=None, help="engine first_chunk_s for the served engines")
    ap.add_argument("--skip", default="", help="comma-separated steps not to run: sizing, perf_analyzer, goodput, "
                    "ablation, overhead")
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    a = ap.parse_args(argv)
    st = Settings.quick_settings() if a.quick else Settings()
    for name in ("size", "duration", "ttfa_p90", "stall_free", "seed", "first_chunk_s"):
        if getattr(a, name) is not None:
            setattr(st, name, getattr(a, name))
    if a.rates:
        st.rates = [float(x) for x in a.rates.split(",")]
    if a.ablation_rates:
        st.ablation_rates = [float(x) for x in a.ablation_rates.split(",")]
    if a.overhead_sizes:
        st.overhead_sizes = a.overhead_sizes.split(",")
    st.skip = [x for x in a.skip.split(",") if x]
    unknown = set(st.skip) - set(SKIPPABLE)
    if unknown:
        ap.error(f"--skip: unknown steps {sorted(unknown)}; steps: {', '.join(SKIPPABLE)}")
    Suite(st, Path(a.out_dir)).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
