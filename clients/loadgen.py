"""Open-loop load generator for decoupled TTS models over tritonclient gRPC streaming.

Requests arrive on a seeded Poisson (or Gamma, burstier) schedule regardless of how fast the server
answers, so an overloaded server shows up as growing TTFA and stalls, not as a slower client.
Per request it records the send time and, per AUDIO response, the arrival time and audio seconds;
metrics come from clients/stream_metrics.py (definitions: docs/metrics.md).

    python -m clients.loadgen --url localhost:8001 --model orpheus \
        --prompts perf/data/prompts.txt --rates 0.5,1,2 --duration 30 --seed 0 --out perf/results/load.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from clients.stream_metrics import StreamTimeline, markdown_table, summarize  # noqa: E402

# Request fields the TTS models accept (issue 3 schema); only those the model declares are sent.
SAMPLING_FIELDS = ("TEMPERATURE", "TOP_P", "TOP_K", "MIN_P", "REPETITION_PENALTY")


# ---------------------------------------------------------------- arrivals

def arrival_offsets(rate: float, duration_s: float, seed: int = 0, burstiness: float = 1.0,
                    max_requests: int | None = None) -> np.ndarray:
    """Send offsets (s from run start) in [0, duration_s): Gamma inter-arrival gaps with mean 1/rate.

    burstiness is the Gamma shape k: k=1 is a Poisson process (exponential gaps), k<1 burstier
    (coefficient of variation 1/sqrt(k)), k>1 smoother."""
    if rate <= 0 or duration_s <= 0:
        return np.zeros(0)
    rng = np.random.default_rng(seed)
    n_guess = int(rate * duration_s * 1.5 + 10 * np.sqrt(rate * duration_s) + 10)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n_guess)
    t = np.cumsum(gaps)
    while t[-1] < duration_s:  # rare: draw more until the window is covered
        t = np.concatenate([t, t[-1] + np.cumsum(rng.gamma(burstiness, 1.0 / (rate * burstiness), n_guess))])
    t = t[t < duration_s]
    return t[:max_requests] if max_requests is not None else t


def load_prompts(path: str | os.PathLike) -> list[str]:
    lines = [ln.strip() for ln in Path(path).read_text(encoding="utf-8").splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


# ---------------------------------------------------------------- requests

@dataclass
class RequestOptions:
    voice: str | None = None
    sampling: dict[str, float] = field(default_factory=dict)  # e.g. {"TEMPERATURE": 0.6}
    max_tokens: int | None = None
    sampling_seed: int | None = None  # request i gets sampling_seed + i
    audio_format: str | None = None   # "pcm16" (server default) or "fp32"
    speaker: int | None = None  # csm
    context: dict[str, list] = field(default_factory=dict)  # csm: CONTEXT_* lists (tts_stream.context_fields)


def request_fields(text: str, opts: RequestOptions, index: int) -> dict[str, object]:
    fields: dict[str, object] = {"TEXT": text}
    if opts.voice:
        fields["VOICE"] = opts.voice
    if opts.speaker is not None:
        fields["SPEAKER"] = opts.speaker
    fields.update(opts.context)
    fields.update({k.upper(): v for k, v in opts.sampling.items() if v is not None})
    if opts.max_tokens is not None:
        fields["MAX_TOKENS"] = opts.max_tokens
    if opts.sampling_seed is not None:
        fields["SEED"] = opts.sampling_seed + index
    if opts.audio_format:
        fields["AUDIO_FORMAT"] = opts.audio_format
    return fields


def build_inputs(fields: dict[str, object], meta_inputs: dict[str, dict]):
    """InferInputs typed and shaped as the model's metadata declares (so dtype choices stay server-side)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import triton_to_np_dtype

    inputs = []
    for name, value in fields.items():
        if name not in meta_inputs:
            raise ValueError(f"model has no input {name!r}; it declares {sorted(meta_inputs)}")
        dtype = meta_inputs[name]["datatype"]
        values = list(value) if isinstance(value, (list, tuple)) else [value]  # lists: one element per segment
        shape = ([len(values)] if isinstance(value, (list, tuple))
                 else [1] * max(1, len(meta_inputs[name].get("shape", [1]))))
        if dtype == "BYTES":
            arr = np.array([v if isinstance(v, bytes) else str(v).encode("utf-8") for v in values],
                           dtype=np.object_).reshape(shape)
        else:
            arr = np.array(values, dtype=triton_to_np_dtype(dtype)).reshape(shape)
        inp = grpcclient.InferInput(name, shape, dtype)
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    return inputs


BYTES_PER_SAMPLE = {"pcm16": 2, "fp32": 4}


def chunk_audio_seconds(result, audio_format: str = "pcm16") -> float:
    """Audio seconds in one response; 0 if none. Mono. AUDIO is either one BYTES element holding the
    encoded chunk (the front models: little-endian int16 for pcm16, float32 for fp32) or a numeric array of
    samples (engine models)."""
    audio = result.as_numpy("AUDIO")
    if audio is None or audio.size == 0:
        return 0.0
    if audio.dtype == np.object_:
        n = sum(len(b) for b in audio.ravel()) // BYTES_PER_SAMPLE[audio_format or "pcm16"]
    else:
        n = audio.size
    if n == 0:
        return 0.0
    sr = result.as_numpy("SAMPLE_RATE")
    if sr is None or int(np.ravel(sr)[0]) <= 0:
        raise ValueError("AUDIO response without a positive SAMPLE_RATE")
    return n / float(np.ravel(sr)[0])


def is_final(result) -> bool:
    """Triton's final-response flag, or the model's own FINAL output."""
    p = result.get_response().parameters.get("triton_final_response")
    if p is not None and p.bool_param:
        return True
    final = result.as_numpy("FINAL")
    return bool(final is not None and final.size and np.ravel(final)[0])


def finish_reason(result) -> str | None:
    r = result.as_numpy("FINISH_REASON")
    if r is None or not r.size:
        return None
    v = np.ravel(r)[0]
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


class _Conn:
    """One client + one open stream, carrying one request at a time.

    Why not one shared stream for every request: tritonclient's stream callback drops the request id of
    error responses, so errors could not be attributed. Why not a new client per request: opening a
    channel and stream on the send path delays the send under load. So a pool of streams is opened
    before the clock starts; a send is then only a queue put on an idle stream (accurate send times),
    and every response on a stream belongs to the one request it carries."""

    def __init__(self, url: str, on_response):
        import tritonclient.grpc as grpcclient
        self.client = grpcclient.InferenceServerClient(url=url)
        self.current: StreamTimeline | None = None
        self.broken = False
        self.client.start_stream(callback=lambda result, error: on_response(self, result, error))

    def close(self, cancel: bool = False) -> None:
        try:
            self.client.stop_stream(cancel_requests=cancel)
        finally:
            self.client.close()


class _Run:
    """State of one open-loop run at one rate."""

    def __init__(self, url: str, model: str, meta_inputs: dict[str, dict], pool_size: int,
                 audio_format: str | None = None):
        self.url, self.model, self.meta_inputs = url, model, meta_inputs
        self.audio_format = audio_format or "pcm16"
        self.idle: queue.SimpleQueue[_Conn] = queue.SimpleQueue()
        self.all: list[_Conn] = []
        self.lock = threading.Lock()
        self.pending = 0
        self.all_done = threading.Condition(self.lock)
        self.t0 = time.perf_counter()
        for _ in range(pool_size):
            self.idle.put(self._new_conn())

    def _new_conn(self) -> _Conn:
        c = _Conn(self.url, self._on_response)
        self.all.append(c)
        return c

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def _finish(self, conn: _Conn, tl: StreamTimeline, error: str | None) -> None:
        # Called with self.lock held.
        tl.end_time = self.now()
        if error is not None and tl.error is None:
            tl.error = error
        conn.current = None
        self.pending -= 1
        if not conn.broken:
            self.idle.put(conn)
        self.all_done.notify_all()

    def _on_response(self, conn: _Conn, result, error) -> None:
        t = self.now()  # arrival stamp first, before any decoding
        with self.lock:
            tl = conn.current
            if tl is None or tl.end_time is not None:
                return  # late response of a request already timed out / cancelled
            if error is not None:
                conn.broken = True  # stream state unknown after an error: do not reuse
                self._finish(conn, tl, str(error))
                return
            try:
                secs = chunk_audio_seconds(result, self.audio_format)
                if secs > 0:
                    tl.chunks.append((t, secs))
                if is_final(result):
                    tl.finish_reason = finish_reason(result)
                    self._finish(conn, tl, None)
            except Exception as e:  # malformed response: count it, keep the run going
                conn.broken = True
                self._finish(conn, tl, f"client: {e}")

    def send(self, tl: StreamTimeline, inputs) -> None:
        try:
            conn = self.idle.get_nowait()
        except queue.Empty:
            conn = self._new_conn()  # pool exhausted: costs one channel setup on this send
        with self.lock:
            conn.current = tl
            self.pending += 1
            tl.send_time = self.now()
        try:
            conn.client.async_stream_infer(self.model, inputs, request_id=tl.request_id,
                                           enable_empty_final_response=True)
        except Exception as e:
            with self.lock:
                conn.broken = True
                self._finish(conn, tl, f"send: {e}")

    def wait(self, deadline: float) -> None:
        with self.lock:
            while self.pending and self.now() < deadline:
                self.all_done.wait(timeout=min(0.5, max(0.0, deadline - self.now())))
            for c in self.all:  # whatever is still running has timed out
                if c.current is not None:
                    c.broken = True
                    self._finish(c, c.current, "timeout: no final response")

    def close(self) -> None:
        for c in self.all:
            try:
                c.close(cancel=c.broken)
            except Exception:
                pass


def model_inputs(url: str, model: str) -> dict[str, dict]:
    import tritonclient.grpc as grpcclient
    client = grpcclient.InferenceServerClient(url=url)
    try:
        meta = client.get_model_metadata(model, as_json=True)
    finally:
        client.close()
    return {i["name"]: i for i in meta.get("inputs", [])}


def run_load(url: str, model: str, prompts: list[str], rate: float, duration: float, *,
             burstiness: float = 1.0, seed: int = 0, opts: RequestOptions | None = None,
             request_timeout: float = 120.0, max_requests: int | None = None,
             pool_size: int | None = None) -> list[StreamTimeline]:
    """One open-loop run at `rate` req/s for `duration` s; returns one timeline per request sent.

    Stops by itself: no sends after `duration`, and requests still open `request_timeout` s after the
    last send are cancelled and recorded as errors. Times are seconds from the run start."""
    opts = opts or RequestOptions()
    offsets = arrival_offsets(rate, duration, seed, burstiness, max_requests)
    rng = np.random.default_rng(seed + 1)
    picks = rng.integers(0, len(prompts), size=len(offsets))
    meta_inputs = model_inputs(url, model)
    # Pre-build every request so the send path is a clock read and a queue put.
    planned = [(StreamTimeline(send_time=0.0, scheduled_time=float(off), prompt=prompts[p],
                               request_id=f"lg-{seed}-{i}"),
                build_inputs(request_fields(prompts[p], opts, i), meta_inputs))
               for i, (off, p) in enumerate(zip(offsets, picks))]
    if pool_size is None:  # expected concurrency with ~10 s per request, plus headroom
        pool_size = int(min(256, max(4, rate * 10 + 4)))
    run = _Run(url, model, meta_inputs, min(pool_size, max(1, len(planned))), opts.audio_format)
    try:
        run.t0 = time.perf_counter()
        for tl, inputs in planned:
            delay = tl.scheduled_time - run.now()
            if delay > 0:
                time.sleep(delay)
            run.send(tl, inputs)
        run.wait(deadline=run.now() + request_timeout)
    finally:
        run.close()
    return [tl for tl, _ in planned]


# ---------------------------------------------------------------- provenance and CLI

def git_commit(repo: str | os.PathLike = ".") -> str:
    try:
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (out.stdout.strip() or "unknown") + ("-dirty" if dirty else "")
    except Exception:
        return "unknown"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> str:
    return f"{cpu_model()} x{os.cpu_count()} cores"


def error_counts(timelines: list[StreamTimeline]) -> list[tuple[str, int]]:
    """Distinct error messages with how many requests got each, most frequent first."""
    counts: dict[str, int] = {}
    for tl in timelines:
        if tl.error is not None:
            counts[tl.error] = counts.get(tl.error, 0) + 1
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


def format_errors(timelines: list[StreamTimeline]) -> str:
    """A count alone says nothing: one line per distinct message says why."""
    counts = error_counts(timelines)
    if not counts:
        return "errors: 0"
    lines = [f"errors: {sum(n for _, n in counts)} ({len(counts)} distinct)"]
    lines += [f"  {n} x {message}" for message, n in counts]
    return "\n".join(lines)


def arrival_label(burstiness: float) -> str:
    return "Poisson (open loop)" if burstiness == 1.0 else f"Gamma shape {burstiness:g} (open loop)"


def parse_rates(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    from clients.tts_stream import add_request_args, sampling_fields
    from voxbackend.stream_client import context_fields

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="localhost:8001", help="Triton gRPC address")
    ap.add_argument("--model", default="orpheus")
    ap.add_argument("--prompts", default=str(Path(__file__).resolve().parent.parent / "perf/data/prompts.txt"))
    ap.add_argument("--rates", default="0.5,1,2", help="comma-separated request rates (req/s)")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per rate")
    ap.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape; 1 = Poisson")
    ap.add_argument("--seed", type=int, default=0, help="arrival times and prompt choice")
    ap.add_argument("--max-requests", type=int, default=None, help="cap per rate")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="s after the last send")
    ap.add_argument("--pool-size", type=int, default=None, help="streams opened before the clock starts")
    add_request_args(ap)
    ap.add_argument("--sampling-seed", type=int, default=None, help="request i gets SEED = this + i")
    ap.add_argument("--audio-format", default=None, choices=["pcm16", "fp32"])
    ap.add_argument("--out", default="loadgen.json", help="JSON output; a .md table is written next to it")
    a = ap.parse_args(argv)
    try:
        context = context_fields(a.context_text, a.context_audio, a.context_speaker, a.speaker or 0)
    except (ValueError, OSError) as e:
        ap.error(str(e))
    opts = RequestOptions(
        voice=a.voice, speaker=a.speaker, context=context, max_tokens=a.max_tokens, sampling_seed=a.sampling_seed,
        audio_format=a.audio_format,
        sampling=sampling_fields(a))
    prompts = load_prompts(a.prompts)
    runs, summaries = [], {}
    for rate in parse_rates(a.rates):
        tls = run_load(a.url, a.model, prompts, rate, a.duration, burstiness=a.burstiness, seed=a.seed,
                       opts=opts, request_timeout=a.request_timeout, max_requests=a.max_requests,
                       pool_size=a.pool_size)
        summaries[rate] = summarize(tls)
        runs.append({"rate": rate, "summary": summaries[rate], "error_messages": dict(error_counts(tls)),
                     "timelines": [t.to_dict() for t in tls]})
        print(f"rate {rate:g}: {json.dumps(summaries[rate])}", flush=True)
        if summaries[rate]["errors"]:
            print(format_errors(tls), flush=True)
    prov = {"git_commit": git_commit(Path(__file__).resolve().parent.parent), "machine": machine(),
            "url": a.url, "model": a.model, "dataset": a.prompts, "arrival": arrival_label(a.burstiness),
            "seed": a.seed, "duration_s": a.duration, "options": vars(a)}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"provenance": prov, "runs": runs}, indent=1))
    table = markdown_table(summaries)
    md = ("\n".join(f"- {k}: {v}" for k, v in prov.items() if k != "options")
          + "\n- TTFA in ms; percentiles: numpy linear; x real time = audio s / wall s\n\n" + table + "\n")
    out.with_suffix(".md").write_text(md)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
