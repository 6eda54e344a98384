"""The real engine on a simulated clock: what a scheduling policy decides, without a noisy machine in the way.

The Engine, its Scheduler (every policy), KV pool and Detokenizer run unchanged; only the model is replaced by
`SimSpeech`, whose forward and detokenize calls cost no compute and instead advance a simulated clock by a
cost model (a fixed cost per call plus a cost per token or per window). Streams are Orpheus-shaped (7 tokens
per 85.3 ms SNAC frame, windows of 4 frames). Everything is deterministic for a given arrival seed, so
differences between policies are the policies' and nothing else's; a cost model calibrated on the real model
(`calibrate`) ties the simulated time to a machine.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from voxbackend.config import EngineConfig
from voxbackend.engine.engine import Engine
from voxbackend.events import EventKind
from voxbackend.models.base import LMGeometry, ModelSpec, SpeechModel, WindowJob, WindowSpec
from voxbackend.sampling_params import SamplingParams

SAMPLE_RATE = 24000
FRAME_TOKENS = 7  # Orpheus: 7 LM tokens per SNAC frame
FRAME_SAMPLES = 2048  # 85.3 ms at 24 kHz
PROMPT_TOKENS = 40  # a typical Orpheus prompt: template + one sentence


@dataclass(frozen=True)
class CostModel:
    """Seconds per engine call: LM step = lm_fixed + lm_per_token * tokens; codec call = detok_fixed +
    detok_per_window * windows; step_overhead = the engine's own bookkeeping per step."""

    name: str
    lm_fixed: float
    lm_per_token: float
    detok_fixed: float
    detok_per_window: float
    step_overhead: float = 0.0
    source: str = ""

    def lm(self, tokens: int) -> float:
        return self.lm_fixed + self.lm_per_token * tokens

    def detok(self, windows: int) -> float:
        return self.detok_fixed + self.detok_per_window * windows


# An H200 running Orpheus-3B in bf16 with CUDA graphs, from first principles (not measured: no GPU was lent):
# a decode step reads the 6.6 GB of weights at ~4.3 TB/s (1.5 ms) plus launch, sampling and host overheads
# (~1.5 ms); each row adds its KV reads and matmul work (~0.02 ms); a SNAC window batch costs ~2 ms plus
# ~0.05 ms per window. Streams need one step per 12.2 ms, so the knee is several hundred streams.
H200_ORPHEUS_3B = CostModel("h200-orpheus-3b (analytic)", 3.0e-3, 2.0e-5, 2.0e-3, 5.0e-5, 2.0e-4,
                            "first-principles estimate, see perf/policy_sim.py")


# A slower device of the same shape (fixed costs dominate), for a study that runs in minutes here: the knee is
# about 25 concurrent streams, so the scheduler's choices show at rates a 2-core machine can simulate quickly.
FIXED_COST_8MS = CostModel("fixed-cost device, 8 ms/step (analytic)", 8.0e-3, 6.0e-5, 2.0e-3, 1.0e-4, 2.0e-4,
                           "analytic: LM 8 ms + 0.06 ms/token, codec 2 ms + 0.1 ms/window")
PROFILES = {"h200": H200_ORPHEUS_3B, "fixed8ms": FIXED_COST_8MS}


class SimClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SimSpeech(SpeechModel):
    """An Orpheus-shaped model without weights: every step emits one audio code; lengths come from max_tokens
    (greedy sampling over a 2-token vocabulary that always picks the code)."""

    def __init__(self, clock: SimClock, cost: CostModel, hop_frames: int = 1):
        self.clock, self.cost = clock, cost
        self.spec = ModelSpec(
            name="sim-orpheus",
            geometry=LMGeometry(num_layers=1, num_heads=1, num_kv_heads=1, head_dim=1, vocab_size=2,
                                max_context=1 << 20),
            sample_rate=SAMPLE_RATE,
            codes_per_frame=FRAME_TOKENS,
            window=WindowSpec(frames=3 + hop_frames, hop_frames=hop_frames, first_frames=3 + hop_frames,
                              flush_on_finish=False),
            stop_ids=(),
        )
        self.samples_per_window = FRAME_SAMPLES * hop_frames

    def forward(self, input_ids, positions, attention):
        self.clock.now += self.cost.lm(len(input_ids))
        return torch.zeros(len(input_ids), 1)

    def candidate_logits(self, hidden, *args, **kwargs):
        logits = torch.zeros(len(hidden), 2)
        logits[:, 1] = 1.0
        return logits, None

    def codes_from_step(self, step, codes_so_far):
        return [0]

    def detokenize(self, jobs: list[WindowJob]) -> list[np.ndarray]:
        self.clock.now += self.cost.detok(len(jobs))
        return [np.zeros(self.samples_per_window, np.float32) for _ in jobs]


@dataclass(frozen=True)
class Workload:
    """Open-loop arrivals (Gamma gaps: shape 1 = Poisson; CV = 1/sqrt(shape)) of Orpheus-like requests."""

    name: str
    rate: float  # requests per second
    duration_s: float = 30.0
    gamma_shape: float = 1.0
    lengths: str = "sentences"  # sentences | mixed (see draw_lengths)
    startup_s: float = 0.0  # the client starts playing once it holds this much audio (0: at the first chunk)
    hop_frames: int = 1  # detokenizer window hop (Orpheus: 1 frame = 7 tokens)

    def arrivals(self, seed: int) -> list[tuple[float, int]]:
        """(send time, LM tokens to generate) per request."""
        rng = np.random.default_rng(seed)
        n = int(self.rate * self.duration_s * 2 + 20)
        t = np.cumsum(rng.gamma(self.gamma_shape, 1.0 / (self.rate * self.gamma_shape), n))
        t = t[t < self.duration_s]
        return list(zip(t.tolist(), draw_lengths(self.lengths, len(t), rng)))


def draw_lengths(kind: str, n: int, rng: np.random.Generator) -> list[int]:
    """LM tokens per request, whole frames. sentences: 2-6 s of audio (one sentence of the prompt set);
    mixed: 70% short replies (0.5-1.5 s) among 30% long readings (10-20 s)."""
    frame_s = FRAME_SAMPLES / SAMPLE_RATE
    if kind == "sentences":
        seconds = rng.uniform(2.0, 6.0, n)
    elif kind == "mixed":
        seconds = np.where(rng.random(n) < 0.7, rng.uniform(0.5, 1.5, n), rng.uniform(10.0, 20.0, n))
    else:
        raise ValueError(f"unknown lengths {kind!r}")
    return [int(s / frame_s + 3) * FRAME_TOKENS for s in seconds]  # +3: the first window needs 4 frames


@dataclass
class StepRecord:
    t: float
    running: int
    pressing: int
    lm_rows: int
    detok_windows: int


@dataclass
class SimResult:
    timelines: list  # clients.stream_metrics.StreamTimeline
    steps: list[StepRecord] = field(default_factory=list)
    buffers: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # request -> (t, buffer s)


def simulate(policy: str, workload: Workload, cost: CostModel, seed: int, *, max_batch: int = 32,
             kv_pages: int = 100_000, detok_batch: int = 16, first_chunk_s: float = 0.0,
             playback_margin_s: float = 1.0, detok_margin_s: float = EngineConfig.detok_margin_s,
             detok_pace_floor: float = 0.0,
             delivery_jitter_s: float = 0.0,
             record: bool = False, horizon_s: float = 600.0) -> SimResult:
    """delivery_jitter_s: mean of an exponential delay between the engine's event and the client's receipt of
    each chunk (the serving path: Triton, the postprocess model, gRPC), chunks kept in order; 0: none."""
    from clients.stream_metrics import StreamTimeline

    clock = SimClock()
    model = SimSpeech(clock, cost, workload.hop_frames)
    config = EngineConfig(policy=policy, max_batch=max_batch, kv_pages=kv_pages, page_size=16,
                          prefill_budget=512, max_queue=1 << 20, detok_batch=detok_batch,
                          first_chunk_s=first_chunk_s, playback_margin_s=playback_margin_s,
                          detok_margin_s=detok_margin_s, detok_pace_floor=detok_pace_floor)
    engine = Engine(model, config, clock=clock)
    engine.runner.attention = _NoAttention()  # SimSpeech reads no keys or values, so paged-attention plans are waste
    result = SimResult([])
    if record:
        _instrument(engine, result, clock)
    pending = workload.arrivals(seed)
    jitter = np.random.default_rng([seed, 1])  # its own stream: the arrivals do not change with it
    timelines: dict[str, StreamTimeline] = {}

    def on_event(rid: str):
        def handle(e):
            tl = timelines[rid]
            if e.kind is EventKind.AUDIO:
                arrival = clock.now + (jitter.exponential(delivery_jitter_s) if delivery_jitter_s else 0.0)
                arrival = max(arrival, tl.chunks[-1][0]) if tl.chunks else arrival
                tl.chunks.append((arrival, len(e.audio) / SAMPLE_RATE))
            elif e.final:
                tl.end_time = max(clock.now, tl.chunks[-1][0]) if tl.chunks else clock.now  # after its last chunk
                tl.finish_reason = e.finish_reason
                if e.kind is EventKind.ERROR:
                    tl.error = e.error
        return handle

    i = 0
    while clock.now < horizon_s:
        while i < len(pending) and pending[i][0] <= clock.now:
            send, tokens = pending[i]
            rid = f"r{i}"
            timelines[rid] = StreamTimeline(send_time=send, request_id=rid)
            sampling = SamplingParams(temperature=0.0, max_tokens=tokens, seed=i)
            engine.submit([0] * PROMPT_TOKENS, sampling, on_event(rid), request_id=rid)
            i += 1
        if not engine.step():
            if i == len(pending) and not engine.running and not engine.waiting:
                break
            if i < len(pending):  # idle until the next arrival
                clock.now = max(clock.now, pending[i][0])
        clock.now += cost.step_overhead
    result.timelines = list(timelines.values())
    return result


class _NoAttention:
    def plan(self, seqs) -> None:
        pass


def _instrument(engine: Engine, result: SimResult, clock: SimClock) -> None:
    """Record, per step, how many requests were pressing and what the policy chose (for the study's plots)."""
    sched = engine.scheduler
    schedule_lm, schedule_detok = sched.schedule_lm, sched.schedule_detok
    margin = engine.config.playback_margin_s

    def lm(running, now):
        plan = schedule_lm(running, now)
        pressing = sum(r.pressing(now, margin) for r in running if not r.lm_done)
        result.steps.append(StepRecord(now, len(running), pressing, len(plan), 0))
        for r in running:
            if r.playback.first_chunk_at is not None:
                result.buffers.setdefault(r.id, []).append((now, r.playback.buffer_s(now)))
        return plan

    def detok(ready, lm_requests, now, stateful):
        plan = schedule_detok(ready, lm_requests, now, stateful)
        if result.steps:
            result.steps[-1].detok_windows = sum(n for _, n in plan)
        return plan

    sched.schedule_lm, sched.schedule_detok = lm, detok


def calibrate(size: str = "tiny", batches: tuple[int, ...] = (1, 4, 16, 32), tokens: int = 140) -> CostModel:
    """Fit the cost model to the real tiny Orpheus (random weights) on this machine: run `b` streams at a time,
    time every LM step and codec call, least-squares fit seconds = fixed + per_unit * units."""
    import voxbackend
    from voxbackend.models.orpheus.tiny import ensure_default_checkpoint

    model_dir, codec_dir = ensure_default_checkpoint(size=size)
    engine = voxbackend.load(model_dir, codec_dir, max_batch=max(batches), detok_batch=16)
    lm_samples, detok_samples, step_samples = [], [], []
    run_lm, run_detok = engine._run_lm, engine._run_detok

    def timed_lm(plan):
        t0 = time.perf_counter()
        run_lm(plan)
        lm_samples.append((sum(n for _, n in plan), time.perf_counter() - t0))

    def timed_detok(plan):
        t0 = time.perf_counter()
        run_detok(plan)
        detok_samples.append((sum(n for _, n in plan), time.perf_counter() - t0))

    engine._run_lm, engine._run_detok = timed_lm, timed_detok
    for b in batches:
        for k in range(b):
            engine.submit(engine.model.prepare(f"Calibration sentence number {k}."),
                          SamplingParams(temperature=0.6, top_p=0.8, max_tokens=tokens, seed=k))
        while (stats := engine.stats()).running or stats.queued:
            t0 = time.perf_counter()
            n_lm, n_detok = len(lm_samples), len(detok_samples)
            engine.step()
            inside = sum(s for _, s in lm_samples[n_lm:]) + sum(s for _, s in detok_samples[n_detok:])
            step_samples.append(time.perf_counter() - t0 - inside)
    lm_fixed, lm_per = _fit(lm_samples)
    detok_fixed, detok_per = _fit(detok_samples)
    machine = _machine()
    return CostModel(f"cpu-{size} (calibrated)", lm_fixed, lm_per, detok_fixed, detok_per,
                     float(np.median(step_samples)),
                     f"perf/policy_sim.py calibrate on {machine}, {time.strftime('%Y-%m-%d')}, "
                     f"{len(lm_samples)} LM steps, {len(detok_samples)} codec calls")


def _fit(samples: list[tuple[int, float]]) -> tuple[float, float]:
    x = np.array([u for u, _ in samples], float)
    y = np.array([s for _, s in samples], float)
    a = np.stack([np.ones_like(x), x], 1)
    (fixed, per), *_ = np.linalg.lstsq(a, y, rcond=None)
    return max(float(fixed), 0.0), max(float(per), 0.0)


def _machine() -> str:
    from perf.provenance import cpu_count, cpu_model

    return f"{cpu_model()} x{cpu_count()}"


def save_cost(cost: CostModel, path: Path) -> None:
    path.write_text(json.dumps(asdict(cost), indent=2) + "\n")


def load_cost(path: Path) -> CostModel:
    return CostModel(**json.loads(path.read_text()))
