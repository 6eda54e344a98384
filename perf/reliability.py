"""The reliability suite: a real tritonserver on loopback, probed the way an operator would probe it.

    python perf/reliability.py                 # every probe (~10 min on 2 cores); writes the results file below
    python perf/reliability.py --quick         # orpheus only, a short soak (~2-3 min once the server is up)
    python perf/reliability.py --only bad_input:voice_unknown,cancel_storm --out /tmp/rel.md

It starts `voxbackend serve` (the project's launcher) on free 127.0.0.1 ports with the tiny default checkpoints,
runs the probes in PROBES in order, and writes perf/results/<date>-<commit>-<machine>-reliability.md: per probe
what was expected, what was observed and the verdict, the KV pages and queue slots left over (read from the
metrics port; they must be 0), the soak's RSS growth of the server's process tree, and the command line.
Every loop and count is bounded; the suite stops by itself. Exit status: 0 when every probe passed, 1 otherwise.

A probe is a function (suite) -> list[Result]; adding one is one entry in PROBES. A bad input is one entry in
BAD_INPUTS. The clients are the project's own (clients/tts_stream.py, clients/loadgen.py); HeldStream only adds
what they lack, a stream that stays open until the probe cancels it. docs/reliability.md describes every probe.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]

import numpy as np  # noqa: E402

import provenance  # noqa: E402  (perf/provenance.py)
from clients.loadgen import chunk_audio_seconds, finish_reason, is_final  # noqa: E402
from voxbackend.deploy.server import free_port  # noqa: E402
from voxbackend.stream_client import StreamOutcome, make_inputs, stream_request  # noqa: E402
from voxbackend.triton.metrics import FINISH_REASONS  # noqa: E402

PASS, FAIL, ERROR = "PASS", "FAIL", "ERROR"
# The main server's one non-default setting: a short queue, so that "overloaded" takes two dozen streams, not 256.
# Not shorter: requests arriving within one engine step all count as queued, and the cancel storm sends 16 at once.
MAX_QUEUE = 24
TOP_K = 8  # real sampling without the near-ties of the tiny random model (tests/test_triton_e2e.py)
SHORT_TOKENS = 63  # 9 Orpheus frames: a few chunks
LONG_TOKENS = 1100  # below Orpheus' official 1200: still accepted once a server-side cap exists
HUGE_TOKENS = 1_000_000_000
TEXTS = [
    "Hello there, how are you doing today?", "The quick brown fox jumps over the lazy dog.",
    "A streaming server sends the first audio chunk as soon as it is ready.", "Good morning! Good evening!",
    "Please read this sentence slowly and clearly.", "Numbers like one, two, three are easy to say.",
    "The weather this morning was cold and grey.", "She said that the train would arrive at seven.",
    "When the music stopped, everyone turned around.", "It is important to test every part of a system.",
    "I think that we should go for a walk in the park.", "The children laughed and played in the garden.",
    "Can you tell me the way to the library?", "Speech models turn text into sound.",
    "Thank you for asking, I am doing well.", "See you tomorrow, my friend.",
]


# ---------------------------------------------------------------- results


@dataclass
class Result:
    probe: str
    expected: str
    observed: str
    verdict: str
    pages_leaked: int | None = None  # KV pages still used after the probe settled (None: not measured)
    queue_leaked: int | None = None  # queue slots still taken after the probe settled
    seconds: float = 0.0


def verdict(ok: bool) -> str:
    return PASS if ok else FAIL


def short(message: str | None, limit: int = 150) -> str:
    """An error message for a table cell: without tritonclient's request-id prefix, one line, bounded."""
    if message is None:
        return "-"
    text = re.sub(r"^\[request id: [^\]]*\] ", "", " ".join(str(message).split()))
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------- metrics port


@dataclass
class Gauges:
    pages: float
    queued: float
    active: float
    alive: float
    pages_total: float = 0.0
    preemptions: float = 0.0  # voxbackend_preemptions_total: requests whose pages were taken back mid-generation

    @property
    def idle(self) -> bool:
        return self.pages == 0 and self.queued == 0 and self.active == 0

    def __str__(self) -> str:
        return f"pages {self.pages:g}, queued {self.queued:g}, active {self.active:g}"


def scrape(metrics_url: str) -> list[tuple[str, str, float]]:
    """(name, labels, value) of every sample on a Prometheus text page."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    samples = []
    for m in re.finditer(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})? (\S+)$", text, re.MULTILINE):
        try:
            samples.append((m.group(1), m.group(2) or "", float(m.group(3))))
        except ValueError:
            continue
    return samples


def metric_total(metrics_url: str, name: str, **labels: str) -> float:
    """Sum over every engine model (orpheus, orpheus_engine, csm, ...) of one metric, filtered by labels."""
    return sum(v for n, lab, v in scrape(metrics_url)
               if n == name and all(f'{k}="{val}"' in lab for k, val in labels.items()))


def gauges(metrics_url: str, model: str | None = None) -> Gauges:
    """Summed over every engine model, or of one (model="orpheus_engine")."""
    total: dict[str, float] = collections.defaultdict(float)
    alive = []
    for n, lab, v in scrape(metrics_url):
        if model is not None and f'model="{model}"' not in lab:
            continue
        total[n] += v
        if n == "voxbackend_engine_alive":
            alive.append(v)
    return Gauges(total["voxbackend_kv_pages_used"], total["voxbackend_queued_requests"],
                  total["voxbackend_active_streams"], min(alive) if alive else 0.0,
                  total["voxbackend_kv_pages_total"], total["voxbackend_preemptions_total"])


def wait_until(predicate: Callable[[], bool], timeout: float, step: float = 0.05) -> tuple[bool, float]:
    """(whether it came true within timeout, seconds it took)."""
    t0 = time.monotonic()
    while True:
        try:
            if predicate():
                return True, time.monotonic() - t0
        except OSError:
            pass
        if time.monotonic() - t0 > timeout:
            return False, time.monotonic() - t0
        time.sleep(step)


# ---------------------------------------------------------------- process tree


def _ppids() -> dict[int, int]:
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            out[int(stat.parent.name)] = int(text[text.rindex(")") + 2:].split()[1])
        except (OSError, ValueError):
            continue
    return out


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = collections.defaultdict(list)
    for child, parent in _ppids().items():
        children[parent].append(child)
    found, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def rss_kib(pid: int) -> int:
    try:
        m = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.MULTILINE)
        return int(m.group(1)) if m else 0
    except OSError:
        return 0


def process_label(pid: int) -> str:
    """tritonserver, or the model a Python stub serves (its model.py path names the model folder)."""
    args = cmdline(pid)
    if args and args[0].endswith("tritonserver"):
        return "tritonserver"
    for a in args:
        if a.endswith("model.py"):
            return f"stub:{Path(a).parts[-3]}"
    return Path(args[0]).name if args else "?"


def stub_pids(marker: str) -> list[int]:
    """Live triton_python_backend_stub processes whose command line mentions marker (our work folder)."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        args = cmdline(int(proc.name))
        if args and "triton_python_backend_stub" in args[0] and any(marker in a for a in args):
            pids.append(int(proc.name))
    return pids


def running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# ---------------------------------------------------------------- the server, through the launcher


class Launcher:
    """`voxbackend serve` in a child process: the launcher users run, so SIGINT to it is the shutdown users do."""

    def __init__(self, models: list[str], settings: dict[str, str], work_dir: Path):
        self.models, self.settings, self.work_dir = models, settings, work_dir
        self.ports = {k: free_port() for k in ("http", "grpc", "metrics")}
        self.grpc_url = f"127.0.0.1:{self.ports['grpc']}"
        self.metrics_url = f"http://127.0.0.1:{self.ports['metrics']}/metrics"
        self.lines: list[str] = []
        self.checkpoints: dict[str, Path] = {}  # "orpheus"/"csm" -> checkpoint folder the launcher built or found
        self.proc: subprocess.Popen | None = None

    @property
    def command(self) -> list[str]:
        sets = [x for k, v in self.settings.items() for x in ("--set", f"{k}={v}")]
        return [sys.executable, "-m", "voxbackend.cli", "serve", "--host", "127.0.0.1",
                "--http-port", str(self.ports["http"]), "--grpc-port", str(self.ports["grpc"]),
                "--metrics-port", str(self.ports["metrics"]), "--models", ",".join(self.models), *sets,
                "--work-dir", str(self.work_dir)]

    def start(self, timeout: float) -> None:
        self.proc = subprocess.Popen(self.command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        ok, _ = wait_until(lambda: any(ln.startswith("ready:") for ln in self.lines) or self.proc.poll() is not None,
                           timeout, step=0.2)
        if not ok or self.proc.poll() is not None:
            self.kill()
            raise RuntimeError("voxbackend serve did not become ready:\n" + "\n".join(self.lines[-30:])
                               + "\n" + self.log_tail())
        for ln in self.lines:
            m = re.match(r"default checkpoint: (\S+)", ln)
            if m:
                self.checkpoints["csm" if "csm" in Path(m.group(1)).name else "orpheus"] = Path(m.group(1))

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def tritonserver_pid(self) -> int | None:
        for pid in descendants(self.proc.pid):
            if process_label(pid) == "tritonserver":
                return pid
        return None

    def tree_rss(self) -> dict[str, int]:
        """KiB of RSS of the server tree (tritonserver + stubs), summed by label ("stub:<model> x<processes>")."""
        ts = self.tritonserver_pid()
        if ts is None:
            return {}
        pids = [ts, *descendants(ts)]
        labels = [process_label(pid) for pid in pids]
        count = collections.Counter(labels)
        out: dict[str, int] = collections.defaultdict(int)
        for pid, label in zip(pids, labels):
            out[label + (f" x{count[label]}" if count[label] > 1 else "")] += rss_kib(pid)
        return dict(out)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join((self.work_dir / "tritonserver.log").read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no tritonserver log)"

    def kill(self) -> None:
        """Last resort (the suite is ending): the launcher's group and tritonserver's group."""
        if self.proc is None:
            return
        ts = self.tritonserver_pid() if self.alive() else None
        for pgid in ([ts] if ts else []) + [self.proc.pid]:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


# ---------------------------------------------------------------- client helpers


class HeldStream:
    """One request on its own gRPC stream, open until the probe calls cancel() (voxbackend.stream_client.stream_request
    runs to the end; blockers, hogs and busy-shutdown streams must be stopped at a moment the probe picks)."""

    def __init__(self, url: str, model: str, inputs: list, request_id: str = "held"):
        import tritonclient.grpc as grpcclient

        self.chunks = 0
        self.responses = 0
        self.late = 0  # responses after the final one (the connection ending later is not one)
        self.error: str | None = None
        self.finish_reason: str | None = None
        self.final = threading.Event()  # a final response or an error arrived
        self._closed = False
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=self._on_response)
        self.client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=True)

    def _on_response(self, result, error) -> None:
        if self._closed:
            return  # our own hang-up ("Locally cancelled") is not the server's answer
        if self.final.is_set():  # the stream was answered: a transport error now is the server going away
            self.late += error is None
            return
        self.responses += 1
        if error is not None:
            self.error = str(error)
            self.final.set()
            return
        try:
            if chunk_audio_seconds(result, "fp32") > 0:
                self.chunks += 1
        except ValueError:
            pass
        if is_final(result):
            self.finish_reason = finish_reason(result) or ""
            self.final.set()

    def cancel(self) -> None:
        self.close(cancel=True)

    def close(self, cancel: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.client.stop_stream(cancel_requests=cancel)
            self.client.close()
        except Exception:  # noqa: BLE001 - a server that already went away
            pass


def long_inputs(i: int, model: str = "orpheus", tokens: int = LONG_TOKENS) -> list:
    return make_inputs(TEXTS[i % len(TEXTS)], None, "fp32" if model != "orpheus_engine" else None,
                       MAX_TOKENS=tokens, SEED=1000 + i, TOP_K=TOP_K)


def short_inputs(i: int, fmt: str = "fp32") -> list:
    return make_inputs(TEXTS[i % len(TEXTS)], None, fmt, MAX_TOKENS=SHORT_TOKENS, SEED=2000 + i, TOP_K=TOP_K)


def intact(out: StreamOutcome) -> str | None:
    """None when a stream that should have finished did: no error, a final response, chunks 0..n-1 in order."""
    if out.error:
        return f"error {short(out.error, 90)}"
    if out.finish_reason not in ("stop", "length"):
        return f"finish {out.finish_reason!r}"
    if out.indices != list(range(len(out.chunks))) or not out.arrived_in_order:
        return f"chunk indices {out.indices[:8]}..."
    if out.late_responses:
        return f"{out.late_responses} response(s) after the final one"
    return None


def run_threads(jobs: list[Callable[[], object]], timeout: float, stagger_s: float = 0.0) -> list:
    results: list = [None] * len(jobs)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, jobs[i]()), daemon=True)
               for i in range(len(jobs))]
    for t in threads:
        t.start()
        time.sleep(stagger_s)
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return results


def client_process(url: str, model: str, i: int, tokens: int, out_dir: Path) -> subprocess.Popen:
    """clients.tts_stream in its own process, so that kill -9 is a real client dying mid-request."""
    cmd = [sys.executable, "-m", "clients.tts_stream", "--url", url, "--model", model, "--text", TEXTS[i % 16],
           "--max-tokens", str(tokens), "--top-k", str(TOP_K), "--seed", str(3000 + i), "--format", "fp32",
           "--timeout", "120", "--out", str(out_dir / f"client{i}.wav")]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def kill9(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait(10)


# ---------------------------------------------------------------- the suite's state


@dataclass
class Suite:
    args: argparse.Namespace
    server: Launcher | None = None
    tmp: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="voxbackend-reliability-")))
    soak: dict = field(default_factory=dict)  # RSS samples and summary for the report

    @property
    def url(self) -> str:
        return self.server.grpc_url

    @property
    def metrics_url(self) -> str:
        return self.server.metrics_url

    def gauges(self) -> Gauges:
        return gauges(self.metrics_url)

    def settle(self, timeout: float = 15.0) -> tuple[Gauges, float]:
        """Wait until no page, queue slot or stream is taken; what is left after timeout is leaked."""
        ok, took = wait_until(lambda: self.gauges().idle, timeout, step=0.1)
        return self.gauges(), took

    def running(self) -> float:
        g = self.gauges()
        return g.active - g.queued


def settled(suite: Suite, probe: str, expected: str, observed: str, ok: bool, t0: float,
            settle_s: float = 15.0) -> Result:
    """A scenario's result with its leak check: pages, queue slots and streams must all return to 0."""
    g, took = suite.settle(settle_s)
    leak = not g.idle
    observed += f"; after: {g}" + (f" (still, {took:.0f} s later)" if leak else f" within {took:.1f} s")
    return Result(probe, expected, observed, verdict(ok and not leak), int(g.pages), int(g.queued),
                  time.monotonic() - t0)


# ---------------------------------------------------------------- bad inputs


def typed(text: str | bytes | None = "hello there", voice: str | bytes | None = None, fmt: str | bytes | None = None,
          **kw) -> Callable[[], list]:
    """Tensors a typed client builds (voxbackend.stream_client.make_inputs)."""
    return lambda: make_inputs(text, voice, fmt, **kw)


def raw(*tensors: tuple[str, object, str], text: bool = True) -> Callable[[], list]:
    """Tensors a typed client cannot build: any name, dtype and shape (Triton itself refuses most)."""
    def build() -> list:
        import tritonclient.grpc as grpcclient

        out = list(make_inputs("hello there")) if text else []
        for name, value, dtype in tensors:
            t = grpcclient.InferInput(name, list(np.shape(value)), dtype)
            t.set_data_from_numpy(np.asarray(value, dtype=object if dtype == "BYTES" else None))
            out.append(t)
        return out
    return build


def context(n_text: int = 1, n_speaker: int = 1, n_audio: int = 1, audio=None, speaker: int = 1,
            text: str | bytes = "an earlier turn") -> dict[str, list]:
    """CSM context lists (CONTEXT_TEXT / CONTEXT_SPEAKER / CONTEXT_AUDIO), each of its own length (0: absent)."""
    audio = np.zeros(2400, np.float32) if audio is None else audio
    lists = {"CONTEXT_TEXT": [text] * n_text, "CONTEXT_SPEAKER": [speaker] * n_speaker,
             "CONTEXT_AUDIO": [audio] * n_audio}
    return {k: v for k, v in lists.items() if v}


@dataclass(frozen=True)
class BadInput:
    name: str
    model: str  # the model it is sent to
    build: Callable[[], list]
    fields: tuple[str, ...]  # the error must name one of these
    check: Callable[["Suite", "BadInput"], tuple[bool, str]] | None = None  # instead of the one-error check


def special_token_check(suite: Suite, case: BadInput) -> tuple[bool, str]:
    """User text made of the tokenizer's special-token strings must not become control ids: the preprocess
    model's PROMPT_IDS hold as many added-token ids as for plain text of the same length (or TEXT is refused)."""
    import tritonclient.grpc as grpcclient

    family = "csm" if case.model.startswith("csm") else "orpheus"
    tokenizer = json.loads((suite.server.checkpoints[family] / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    names = list(added)
    sample = names[:12] + [n for n in names if n.startswith("<custom_token_")][:10] + names[-2:]
    special_text = "".join(sample)
    plain_text = ("plain words " * len(special_text))[: len(special_text)]
    client = grpcclient.InferenceServerClient(suite.url)
    try:
        def controls(text: str) -> int:
            ids = client.infer(case.model, make_inputs(text)).as_numpy("PROMPT_IDS").reshape(-1)
            return int(np.isin(ids, list(added.values())).sum())
        try:
            plain = controls(plain_text)
        except Exception as e:  # noqa: BLE001
            return False, f"plain text refused: {short(str(e))}"
        try:
            special = controls(special_text)
        except Exception as e:  # noqa: BLE001 - refusing it is the other acceptable answer
            return "TEXT" in str(e), f"refused: {short(str(e))}"
    finally:
        client.close()
    return special == plain, (f"{len(sample)} special-token strings ({len(special_text)} chars): {special} control "
                              f"ids in PROMPT_IDS; plain text of the same length: {plain}")


LONG_TEXT = "word " * 2000  # 10,000 characters: over the 4,000 limit
BAD_INPUTS: tuple[BadInput, ...] = (
    # TEXT
    BadInput("text_missing", "orpheus", typed(None), ("TEXT",)),
    BadInput("text_empty", "orpheus", typed(""), ("TEXT",)),
    BadInput("text_whitespace", "orpheus", typed(" \n\t "), ("TEXT",)),
    BadInput("text_non_utf8", "orpheus", typed(b"\xff\xfe\xfd"), ("TEXT",)),
    BadInput("text_over_limit", "orpheus", typed(LONG_TEXT), ("TEXT",)),
    BadInput("text_huge_1mb", "orpheus", typed("a" * 1_000_000), ("TEXT",)),
    BadInput("text_special_tokens", "orpheus_preprocess", typed(), ("TEXT",), check=special_token_check),
    # VOICE
    BadInput("voice_unknown", "orpheus", typed(voice="nobody"), ("VOICE",)),
    BadInput("voice_non_utf8", "orpheus", typed(voice=b"\xff\xfe"), ("VOICE",)),
    # sampling values
    BadInput("temperature_negative", "orpheus", typed(TEMPERATURE=-0.5), ("TEMPERATURE",)),
    BadInput("temperature_nan", "orpheus", typed(TEMPERATURE=float("nan")), ("TEMPERATURE",)),
    BadInput("temperature_inf", "orpheus", typed(TEMPERATURE=float("inf")), ("TEMPERATURE",)),
    BadInput("top_p_zero", "orpheus", typed(TOP_P=0.0), ("TOP_P",)),
    BadInput("top_p_above_one", "orpheus", typed(TOP_P=1.5), ("TOP_P",)),
    BadInput("top_p_nan", "orpheus", typed(TOP_P=float("nan")), ("TOP_P",)),
    BadInput("top_k_negative", "orpheus", typed(TOP_K=-1), ("TOP_K",)),
    BadInput("min_p_above_one", "orpheus", typed(MIN_P=1.5), ("MIN_P",)),
    BadInput("min_p_minus_inf", "orpheus", typed(MIN_P=float("-inf")), ("MIN_P",)),
    BadInput("repetition_penalty_zero", "orpheus", typed(REPETITION_PENALTY=0.0), ("REPETITION_PENALTY",)),
    BadInput("repetition_penalty_huge", "orpheus", typed(REPETITION_PENALTY=1e9), ("REPETITION_PENALTY",)),
    BadInput("repetition_penalty_inf", "orpheus", typed(REPETITION_PENALTY=float("inf")), ("REPETITION_PENALTY",)),
    BadInput("max_tokens_zero", "orpheus", typed(MAX_TOKENS=0), ("MAX_TOKENS",)),
    BadInput("max_tokens_negative", "orpheus", typed(MAX_TOKENS=-5), ("MAX_TOKENS",)),
    BadInput("max_tokens_above_cap", "orpheus", typed(MAX_TOKENS=100_000), ("MAX_TOKENS",)),
    BadInput("seed_negative", "orpheus", typed(SEED=-1), ("SEED",)),
    BadInput("seed_above_2_31", "orpheus", typed(SEED=2**40), ("SEED",)),
    # AUDIO_FORMAT
    BadInput("audio_format_unknown", "orpheus", typed(fmt="mp3"), ("AUDIO_FORMAT",)),
    BadInput("audio_format_non_utf8", "orpheus", typed(fmt=b"\xff"), ("AUDIO_FORMAT",)),
    # dtypes, shapes and names Triton checks against config.pbtxt
    BadInput("dtype_temperature_fp64", "orpheus", raw(("TEMPERATURE", np.array([0.5]), "FP64")), ("TEMPERATURE",)),
    BadInput("dtype_max_tokens_fp32", "orpheus", raw(("MAX_TOKENS", np.array([50.0], np.float32), "FP32")),
             ("MAX_TOKENS",)),
    BadInput("dtype_text_int32", "orpheus", raw(("TEXT", np.array([1], np.int32), "INT32"), text=False), ("TEXT",)),
    BadInput("shape_text_two_elements", "orpheus", raw(("TEXT", np.array([b"a", b"b"], object), "BYTES"), text=False),
             ("TEXT",)),
    BadInput("shape_temperature_2d", "orpheus", raw(("TEMPERATURE", np.array([[0.5]], np.float32), "FP32")),
             ("TEMPERATURE",)),
    BadInput("unknown_input_name", "orpheus", raw(("FOO", np.array([1], np.int32), "INT32")), ("FOO",)),
    # the engine model called directly
    BadInput("engine_prompt_ids_empty", "orpheus_engine", raw(("PROMPT_IDS", np.zeros(0, np.int64), "INT64"),
                                                              text=False), ("PROMPT_IDS", "prompt")),
    BadInput("engine_prompt_ids_out_of_vocab", "orpheus_engine",
             raw(("PROMPT_IDS", np.array([128000, 10**9], np.int64), "INT64"), text=False), ("PROMPT_IDS", "prompt")),
    BadInput("engine_prompt_ids_negative", "orpheus_engine",
             raw(("PROMPT_IDS", np.array([128000, -3], np.int64), "INT64"), text=False), ("PROMPT_IDS", "prompt")),
    BadInput("engine_prompt_ids_over_context", "orpheus_engine",
             raw(("PROMPT_IDS", np.full(9000, 300, np.int64), "INT64"), text=False), ("PROMPT_IDS", "prompt")),
    BadInput("engine_temperature_inf", "orpheus_engine", typed(TEMPERATURE=float("inf")), ("TEMPERATURE",)),
    BadInput("engine_max_tokens_above_cap", "orpheus_engine", typed(MAX_TOKENS=100_000), ("MAX_TOKENS",)),
    # CSM: speaker and context segments
    BadInput("csm_speaker_out_of_range", "csm", typed(speaker=12), ("SPEAKER",)),
    BadInput("csm_speaker_negative", "csm", typed(speaker=-1), ("SPEAKER",)),
    BadInput("csm_context_count_mismatch", "csm", typed(context=context(n_text=2, n_audio=2)), ("CONTEXT_SPEAKER",)),
    BadInput("csm_context_audio_missing", "csm", typed(context=context(n_audio=0)), ("CONTEXT_AUDIO",)),
    BadInput("csm_context_audio_unreadable", "csm", typed(context=context(audio=b"not an audio file")),
             ("CONTEXT_AUDIO",)),
    BadInput("csm_context_raw_odd_bytes", "csm", typed(context=context(audio=b"12345"), context_sample_rate=24000),
             ("CONTEXT_AUDIO",)),
    BadInput("csm_context_sample_rate_zero", "csm", typed(context=context(), context_sample_rate=0),
             ("CONTEXT_SAMPLE_RATE", "sample_rate")),
    BadInput("csm_context_audio_too_long", "csm", typed(context=context(audio=np.zeros(170 * 1000, np.float32)),
                                                        context_sample_rate=1000), ("CONTEXT_AUDIO",)),
    BadInput("csm_context_speaker_out_of_range", "csm", typed(context=context(speaker=99), context_sample_rate=24000),
             ("CONTEXT_SPEAKER",)),
    BadInput("csm_context_text_non_utf8", "csm", typed(context=context(text=b"\xff\xfe"), context_sample_rate=24000),
             ("CONTEXT_TEXT",)),
    BadInput("csm_temperature_inf", "csm", typed(TEMPERATURE=float("inf")), ("TEMPERATURE",)),
    BadInput("csm_text_special_tokens", "csm_preprocess", typed(), ("TEXT",), check=special_token_check),
)


def names_field(error: str, fields: tuple[str, ...]) -> bool:
    """The message names the field as a word: TEXT matches 'TEXT' but not inside CONTEXT_TEXT."""
    return any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(f)}(?![A-Za-z0-9_])", error) for f in fields)


def judge_refusal(out: StreamOutcome, fields: tuple[str, ...]) -> tuple[bool, str]:
    """One error response naming the field; nothing before it, nothing after it."""
    if out.error is None:
        return False, (f"accepted: {len(out.chunks)} chunk(s), finish {out.finish_reason} "
                       f"(the probe hung up after the first chunk)")
    ok = names_field(out.error, fields) and out.responses == 1 and out.late_responses == 0 and not out.chunks
    extra = "" if out.responses == 1 else f" ({out.responses} responses)"
    extra += f" ({out.late_responses} late)" if out.late_responses else ""
    extra += f" ({len(out.chunks)} chunks first)" if out.chunks else ""
    return ok, short(out.error) + extra


class Backdrop:
    """Long streams played back to back on one thread while the bad inputs are sent. Every one must come out
    intact and sample-equal to the same request run alone first (same text, seed: same audio)."""

    def __init__(self, url: str, model: str, inputs: Callable[[], list], reference: StreamOutcome):
        self.url, self.model, self.inputs, self.reference = url, model, inputs, reference
        self.outcomes: list[StreamOutcome] = []
        self.current: int | None = None  # index of the stream in flight
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.current = len(self.outcomes)
            out = stream_request(self.url, self.model, self.inputs(), "fp32", timeout=240,
                                 request_id=f"backdrop{self.current}")
            self.current = None
            self.outcomes.append(out)

    def start(self) -> "Backdrop":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(300)

    def problems(self) -> list[str]:
        want = self.reference.audio
        found = []
        for i, out in enumerate(self.outcomes):
            bad = intact(out)
            if bad is None and (out.audio.size != want.size or not np.allclose(out.audio, want, atol=1e-4)):
                bad = f"audio differs from the solo run ({out.audio.size} vs {want.size} samples)"
            if bad:
                found.append(f"stream {i}: {bad}")
        return found


def probe_bad_inputs(suite: Suite, cases: tuple[BadInput, ...]) -> list[Result]:
    families = sorted({"csm" if c.model.startswith("csm") else "orpheus" for c in cases})
    backdrops = []
    for fam in families:  # one long stream per model family, run alone first as the reference
        tokens = 50 if fam == "csm" else 420  # CSM counts 80 ms frames
        def inputs(fam=fam, tokens=tokens):
            return make_inputs(TEXTS[2], None, "fp32", MAX_TOKENS=tokens, SEED=7, TOP_K=TOP_K)
        ref = stream_request(suite.url, fam, inputs(), "fp32", timeout=240, request_id="reference")
        if intact(ref) or len(ref.chunks) < 2:
            return [Result("bad_input", "a long reference stream", f"reference failed: {intact(ref)}", ERROR)]
        backdrops.append(Backdrop(suite.url, fam, inputs, ref).start())
    wait_until(lambda: all(b.current is not None for b in backdrops), 30)
    time.sleep(0.5)  # the long streams are past their first chunks
    results = []
    for case in cases:
        t0 = time.monotonic()
        playing = any(b.current is not None for b in backdrops)
        try:
            if case.check is not None:
                ok, observed = case.check(suite, case)
            else:
                out = stream_request(suite.url, case.model, case.build(), "fp32", timeout=30, linger_s=0.2,
                                     cancel_after_chunks=1, request_id=f"bad-{case.name}")
                ok, observed = judge_refusal(out, case.fields)
        except Exception as e:  # noqa: BLE001 - a probe that cannot run is recorded, the others go on
            ok, observed = False, f"probe error: {type(e).__name__}: {short(str(e))}"
        during = playing and any(b.current is not None for b in backdrops)
        if not during:
            observed += " (no long stream was playing when it was sent and answered)"
        expected = (f"refused naming {' or '.join(case.fields)}, or spoken as plain text" if case.check else
                    f"one error naming {case.fields[0]}, no audio")
        results.append(Result(f"bad_input:{case.name} ({case.model})", expected, observed,
                              verdict(ok and during), seconds=time.monotonic() - t0))
    t0 = time.monotonic()
    for b in backdrops:
        b.stop()
    for b in backdrops:
        problems = b.problems()
        observed = (f"{len(b.outcomes)} long stream(s) of {len(b.reference.chunks)} chunks: "
                    + ("; ".join(problems[:3]) if problems else "all intact and equal to the solo run"))
        results.append(settled(suite, f"bad_input:long_streams ({b.model})",
                               "every long stream played during the bad inputs finishes intact: all chunks in order, "
                               "final flag, audio equal to the same request run alone", observed,
                               not problems and len(b.outcomes) > 0, t0))
    return results


# ---------------------------------------------------------------- scenarios


def probe_hog(suite: Suite) -> list[Result]:
    t0 = time.monotonic()
    normal = lambda: make_inputs(TEXTS[0], None, "fp32", MAX_TOKENS=SHORT_TOKENS, SEED=11, TOP_K=TOP_K)  # noqa: E731
    baseline = max(stream_request(suite.url, "orpheus", normal(), "fp32", timeout=60).ttfa_s or 60 for _ in range(2))
    bound = max(2 * baseline, baseline + 1.0)
    hogs = [HeldStream(suite.url, "orpheus", make_inputs(TEXTS[1 + i], None, "fp32", MAX_TOKENS=HUGE_TOKENS,
                                                         TOP_K=TOP_K, SEED=20 + i), f"hog{i}") for i in range(2)]
    try:
        wait_until(lambda: all(h.final.is_set() or h.chunks for h in hogs), 30)
        pages = suite.gauges().pages
        out = stream_request(suite.url, "orpheus", normal(), "fp32", timeout=max(20.0, 3 * bound), request_id="normal")
    finally:
        for h in hogs:
            h.cancel()
    refused = all(h.error and "MAX_TOKENS" in h.error for h in hogs)
    ttfa = out.ttfa_s
    served = ttfa is not None and ttfa <= bound and intact(out) is None
    hog_state = "; ".join(f"huge {i}: " + (f"refused: {short(h.error, 100)}" if h.error else
                                          f"streaming ({h.chunks} chunks)") for i, h in enumerate(hogs))
    observed = (f"{hog_state}; KV pages used with both huge ones in: {pages:g}; normal request: "
                + (f"first audio after {ttfa:.2f} s" if ttfa is not None else f"no audio ({short(out.error, 80)})")
                + f" (usual TTFA {baseline:.2f} s, bound {bound:.2f} s)")
    return [settled(suite, "hog", "two requests with MAX_TOKENS=1e9 and a normal one: the normal one's first audio "
                    "within the usual TTFA (max(2x, +1 s) of the same request alone), or the huge ones refused "
                    "naming MAX_TOKENS", observed, refused or served, t0, settle_s=30)]


def finished_by_reason(metrics_url: str) -> collections.Counter:
    """voxbackend_requests_finished_total per reason, summed over the engine models."""
    return collections.Counter({reason: metric_total(metrics_url, "voxbackend_requests_finished_total", reason=reason)
                                for reason in FINISH_REASONS})


def probe_cancel_storm(suite: Suite) -> list[Result]:
    t0 = time.monotonic()
    before = finished_by_reason(suite.metrics_url)
    jobs = []
    for i in range(16):
        model = "orpheus" if i < 12 else "orpheus_engine"  # the front model and the direct engine
        # the hung-up ones ask Orpheus's most (1200): a cancel that reaches the engine late still finds them running
        inputs = long_inputs(i, model, 1200) if i % 2 else short_inputs(i, "fp32" if model == "orpheus" else None)
        jobs.append(lambda inputs=inputs, i=i, model=model: stream_request(
            suite.url, model, inputs, "fp32", timeout=240, cancel_after_chunks=2 if i % 2 else None,
            request_id=f"storm{i}"))
    outs = run_threads(jobs, 300)
    problems = []
    for i, out in enumerate(outs):
        if out is None:
            problems.append(f"stream {i}: no outcome")
        elif i % 2 and (out.error or out.finish_reason != "client-cancelled"):
            problems.append(f"cancelled {i}: {short(out.error or out.finish_reason, 80)}")
        elif not i % 2 and intact(out):
            problems.append(f"kept {i}: {intact(out)}")
    # 7: one hang-up in 8 may never show in the model's is_cancelled() (docs/reliability.md, "Cancellation"); that
    # stream then runs to its length, and `settled` still needs every page back
    counted, _ = wait_until(lambda: (finished_by_reason(suite.metrics_url) - before)["cancelled"] >= 7, 10)
    ended = finished_by_reason(suite.metrics_url) - before  # how the streams ended, by finish reason
    delta = ended["cancelled"]
    observed = (("; ".join(problems[:4]) if problems else "8 kept streams intact, 8 hung up after 2 chunks")
                + f"; engine counted {delta:g} cancelled"
                + ("" if delta >= 8 else f" (the 16 ended: {', '.join(f'{n:g} {r}' for r, n in ended.items())})"))
    return [settled(suite, "cancel_storm",
                    "16 concurrent streams (12 through `orpheus`, 4 direct), every odd one cancelled "
                    "after 2 chunks: the others finish intact, the engine counts at least 7 of the 8 cancellations, "
                    "pages and active streams back to 0", observed, not problems and counted, t0, settle_s=60)]


def probe_kill_running(suite: Suite) -> list[Result]:
    t0 = time.monotonic()
    models = ["orpheus", "orpheus", "orpheus", "orpheus_engine"]
    procs = [client_process(suite.url, m, i, LONG_TOKENS, suite.tmp) for i, m in enumerate(models)]
    try:
        up, _ = wait_until(lambda: suite.running() >= len(procs) and suite.gauges().pages > 0, 60, step=0.1)
        time.sleep(1.0)  # chunks are flowing
        g = suite.gauges()
    finally:
        kill9(procs)
    freed, took = wait_until(lambda: suite.gauges().idle, 10, step=0.05)
    observed = (f"{len(procs)} client processes streaming ({g}); kill -9: "
                + (f"pages and streams back to 0 after {took:.2f} s" if freed else f"not idle after {took:.0f} s"))
    return [settled(suite, "kill_running",
                    "kill -9 of 4 streaming client processes (3 through `orpheus`, 1 direct): pages and "
                    "active streams back to 0 within 2 s", observed, up and freed and took <= 2.0, t0)]


FILL_TEXT = "hello " * 660  # 3,960 characters, ~2,650 prompt tokens (166 KV pages): about 6 fit in the 1024-page pool
FILLERS = 10  # long-prompt streams in the burst: their prompts alone need 1.6x the pool
FILL_ENGINE = "orpheus"  # the engine whose pool they fill: the front model hosts its own (docs/triton.md)
FULL_FRACTION = 0.9  # of the pool's pages in use, with a stream held back, counts as full


@dataclass
class FullPool:
    """Long-prompt streams that keep the Orpheus engine's KV pool full, and its metrics at the moment it was."""
    fillers: list[HeldStream]
    at_full: Gauges
    preemptions: float  # since the burst
    took_s: float

    @property
    def playing(self) -> list[HeldStream]:
        return [h for h in self.fillers if h.chunks and not h.final.is_set()]

    def __str__(self) -> str:
        g = self.at_full
        return (f"KV pool full {self.took_s:.0f} s after a burst of {len(self.fillers)} long-prompt streams: "
                f"{g.pages:g}/{g.pages_total:g} pages used, {len(self.playing)} playing, queued {g.queued:g}, "
                f"{self.preemptions:g} preemption(s) since the burst")

    def release(self) -> None:
        release(self.fillers)


def fill_pool(suite: Suite, n: int = FILLERS, timeout: float = 180.0) -> FullPool:
    """Start n long-prompt streams at once (MAX_TOKENS=LONG_TOKENS) and wait until the engine's own metrics show
    its KV pool full: at least FULL_FRACTION of the pages used, a stream turned away (queued, or preempted since
    the burst), one playing, none ended. Pages grow with each sequence and together the fillers always need more
    than the pool holds, so from then on some of them wait (queued or preempted) at the head of the admission
    order, each needing more pages than are free: any request that arrives later waits behind them.

    One burst, not one stream at a time: a new stream needs only its first prefill chunk's pages to be admitted,
    and under load the first fillers finished before the last one was in, so the pool never filled."""
    before = gauges(suite.metrics_url, FILL_ENGINE).preemptions
    t0 = time.monotonic()
    fillers = [HeldStream(suite.url, "orpheus", make_inputs(FILL_TEXT, None, "fp32", MAX_TOKENS=LONG_TOKENS,
                                                            SEED=500 + i, TOP_K=TOP_K), f"filler{i}")
               for i in range(n)]
    seen: list[Gauges] = []

    def full() -> bool:
        if any(h.final.is_set() for h in fillers):
            return True  # an ended filler: reported below
        g = gauges(suite.metrics_url, FILL_ENGINE)
        seen[:] = [g]
        turned_away = g.queued >= 1 or g.preemptions > before
        return g.pages >= FULL_FRACTION * g.pages_total > 0 and turned_away and any(h.chunks for h in fillers)

    ok, took = wait_until(full, timeout, step=0.1)
    ended = [h for h in fillers if h.final.is_set()]
    if ended or not ok:
        release(fillers)
        why = (f"filler ended: {short(ended[0].error or ended[0].finish_reason or '?', 120)}" if ended else
               f"not full within {timeout:.0f} s ({seen[0] if seen else 'no metrics'}, "
               f"{seen[0].pages_total if seen else 0:g} pages in the pool)")
        raise RuntimeError(f"{n} long-prompt streams did not fill the KV pool: {why}")
    g = seen[0]
    return FullPool(fillers, g, g.preemptions - before, time.monotonic() - t0)


def release(streams: list[HeldStream]) -> None:
    for h in streams:
        h.cancel()


def probe_kill_queued(suite: Suite) -> list[Result]:
    t0 = time.monotonic()
    pool = fill_pool(suite)
    models = ["orpheus"] * 5  # behind the fillers, in the front model's own engine
    later = took_later = None
    try:
        base = suite.gauges().queued
        procs = [client_process(suite.url, m, 10 + i, SHORT_TOKENS, suite.tmp) for i, m in enumerate(models)]
        try:
            queued_ok, _ = wait_until(lambda: suite.gauges().queued >= base + len(procs), 60, step=0.1)
            before = suite.gauges().queued
        finally:
            kill9(procs)
        # relative to just before the kill: an engine that preempts may move a long stream back to the queue
        gone = before - len(procs)
        freed, took = wait_until(lambda: suite.gauges().queued <= gone, 1.0, step=0.02)
        after = suite.gauges().queued
        if not freed:  # how long the dead clients kept their slots (bounded)
            later, took_later = wait_until(lambda: suite.gauges().queued <= gone, 10, step=0.1)
    finally:
        pool.release()
    observed = (f"{pool}; 5 client processes queued behind them (through `orpheus`): queued gauge {before:g} "
                "before kill -9, "
                + (f"{after:g} after {took:.2f} s" if freed else f"{after:g} 1 s after it"
                   + (f", {gone:g} after {took_later:.1f} s" if later else f", not {gone:g} within 10 s (until "
                      "admission)")))
    return [settled(suite, "kill_queued", "kill -9 of 5 queued client processes: the queued gauge drops by 5 within "
                    "1 s; once the pool frees up, pages and queue back to 0", observed, queued_ok and freed, t0,
                    settle_s=40)]


def probe_overload(suite: Suite) -> list[Result]:
    t0 = time.monotonic()
    pool = fill_pool(suite)
    room = MAX_QUEUE - int(suite.gauges().queued)
    queued: list = [None] * room
    threads = []
    try:
        for i in range(room):
            threads.append(threading.Thread(target=lambda i=i: queued.__setitem__(i, stream_request(
                suite.url, "orpheus", short_inputs(40 + i), "fp32", timeout=240, request_id=f"queued{i}")),
                daemon=True))
            threads[-1].start()
        full, _ = wait_until(lambda: suite.gauges().queued >= MAX_QUEUE, 60, step=0.1)
        extras = [stream_request(suite.url, m, short_inputs(60 + i), "fp32", timeout=30, linger_s=0.2,
                                 cancel_after_chunks=1, request_id=f"extra{i}")
                  for i, m in enumerate(["orpheus"] * 4)]  # the full queue is the front model's engine's
    finally:
        pool.release()
    for t in threads:
        t.join(240)
    clean = [o.error is not None and "overloaded" in o.error.lower() and o.responses == 1 and not o.late_responses
             and not o.chunks for o in extras]
    broken = [f"queued {i}: {intact(o) if o else 'no outcome'}" for i, o in enumerate(queued) if o is None or intact(o)]
    first_bad = next((o for o, c in zip(extras, clean) if not c), None)
    observed = (f"{pool}; queue {'full' if full else 'NOT full'} ({MAX_QUEUE} waiting); "
                f"{sum(clean)}/{len(extras)} extra requests got one overloaded error"
                + ("" if first_bad is None
                   else f" (e.g. {short(first_bad.error, 80) if first_bad.error else 'accepted'})")
                + "; " + ("; ".join(broken[:3]) if broken else f"all {room} short queued requests finished intact"))
    return [settled(suite, "overload", f"past max_queue={MAX_QUEUE}: each extra request (front and direct) gets "
                    "exactly one EngineOverloaded error; the queued ones finish intact once the pool frees up",
                    observed, full and all(clean) and not broken, t0, settle_s=40)]


def probe_soak(suite: Suite) -> list[Result]:
    t0 = time.monotonic()
    n = suite.args.soak_requests
    counter = iter(range(n))
    lock = threading.Lock()
    done = [0]
    errors: collections.Counter = collections.Counter()
    reasons: collections.Counter = collections.Counter()
    samples: list[tuple[float, int, int]] = []  # (s, requests done, KiB)
    stop = threading.Event()

    def sampler() -> None:
        while not stop.is_set():
            samples.append((time.monotonic() - t0, done[0], sum(suite.server.tree_rss().values())))
            stop.wait(0.5)

    def worker() -> None:
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            fmt = "pcm16" if i % 2 else "fp32"
            out = stream_request(suite.url, "orpheus", make_inputs(TEXTS[i % 16], None, fmt, MAX_TOKENS=35,
                                                                   SEED=i, TOP_K=TOP_K), fmt, timeout=120,
                                 request_id=f"soak{i}")
            with lock:
                done[0] += 1
                bad = intact(out)
                if bad:
                    errors[short(out.error, 80) if out.error else bad] += 1
                else:
                    reasons[out.finish_reason] += 1

    start_rss = suite.server.tree_rss()
    threading.Thread(target=sampler, daemon=True).start()
    run_threads([worker] * suite.args.concurrency, timeout=1500)
    g, _ = suite.settle(15)
    stop.set()
    end_rss = suite.server.tree_rss()
    wall = time.monotonic() - t0
    samples.append((wall, done[0], sum(end_rss.values())))
    warm = next((kib for _, d, kib in samples if d >= n // 10), samples[0][2] if samples else 0)
    end = sum(end_rss.values())
    growth = end - warm
    pct = 100.0 * growth / warm if warm else float("nan")
    suite.soak = {"requests": n, "concurrency": suite.args.concurrency, "wall_s": wall, "samples": samples,
                  "start": start_rss, "end": end_rss, "warm_kib": warm, "end_kib": end, "growth_kib": growth,
                  "growth_pct": pct, "peak_kib": max((k for _, _, k in samples), default=end)}
    ok = not errors and sum(reasons.values()) == n and growth <= 0.05 * warm
    observed = (f"{sum(reasons.values())}/{n} finished intact ({dict(reasons)}) in {wall:.0f} s "
                f"({n / wall:.1f} req/s)" + (f"; failures: {dict(errors.most_common(4))}" if errors else "")
                + f"; server tree RSS {warm / 1024:.0f} MiB after {n // 10} requests -> {end / 1024:.0f} MiB at the "
                f"end ({growth / 1024:+.1f} MiB, {pct:+.1f}%)")
    return [settled(suite, "soak", f"{n} short requests at concurrency {suite.args.concurrency}: all finish intact; "
                    "RSS of tritonserver + stubs grows <= 5% after the first 10% of requests", observed, ok, t0)]


FAKE_ENGINE = {  # the weights-free stand-in, selected by the same parameters a deployment sets
    "checkpoint": "unused", "engine_loader": "voxbackend.testing.fake_engine:load",
    "frontend_loader": "voxbackend.testing.fake_engine:load_frontend", "kv_pages": "100", "max_queue": "2",
}


def probe_engine_fault(suite: Suite) -> list[Result]:
    """A second server with the fake engine (voxbackend/testing/fake_engine.py): a request whose text holds
    "__die__" kills its engine loop, a fault production code cannot be asked for."""
    from voxbackend.deploy import configs
    from voxbackend.deploy.server import TritonServer

    t0 = time.monotonic()
    repo = configs.write_repository(suite.tmp / "fake_repository", FAKE_ENGINE, models=["orpheus"])
    server = TritonServer(repo, log_file=suite.tmp / "fake-tritonserver.log", work_dir=suite.tmp / "fake-work")
    server.start(timeout=300)
    try:
        alive_before = gauges(server.metrics_url).alive
        victims = [None, None]
        jobs = [lambda i=i: stream_request(server.grpc_url, "orpheus" if i else "orpheus_engine",
                                           make_inputs(f"a long stream {i}. " * 5, MAX_TOKENS=600), timeout=60,
                                           request_id=f"victim{i}") for i in range(2)]
        threads = [threading.Thread(target=lambda i=i: victims.__setitem__(i, jobs[i]()), daemon=True)
                   for i in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        # one killer per model: the front model hosts its own engine (docs/triton.md)
        killers = [stream_request(server.grpc_url, m, make_inputs("__die__ please", MAX_TOKENS=7), timeout=30,
                                  request_id=f"killer {m}") for m in ("orpheus", "orpheus_engine")]
        for t in threads:
            t.join(60)
        dead, took = wait_until(lambda: metric_total(server.metrics_url, "voxbackend_engine_alive") == 0, 5)  # both
        after = [stream_request(server.grpc_url, m, make_inputs("hello again"), timeout=30) for m in
                 ("orpheus", "orpheus_engine")]
    finally:
        t_stop = time.monotonic()
        code = server.close()
        stop_s = time.monotonic() - t_stop
    ended = [v is not None and v.chunks and v.error and "engine stopped" in v.error and v.responses == len(v.chunks) + 1
             for v in victims]
    refused = [a.error is not None and "EngineDead" in a.error for a in after]
    ok = alive_before == 1 and dead and all(k.error is not None for k in killers) and all(ended) and all(refused)
    observed = (f"engine_alive {alive_before:g} -> " + (f"0 after {took:.1f} s" if dead else "not 0")
                + f"; {sum(ended)}/2 open streams (front, direct) had audio then one final error"
                + (f" (e.g. {short(next((v.error for v, e in zip(victims, ended) if not e and v), None), 80)})"
                   if not all(ended) else "")
                + f"; new requests: {sum(refused)}/2 EngineDead"
                + (f" (else: {[short(a.error, 80) for a, r in zip(after, refused) if not r]})"
                   if not all(refused) else "")
                + f"; that server stopped with exit {code} in "
                f"{stop_s:.0f} s")
    return [Result("engine_fault", "an engine loop that dies (fake engine, __die__ request): engine_alive 0, every "
                   "open stream ends with one final error after its audio, new requests get EngineDead", observed,
                   verdict(ok), seconds=time.monotonic() - t0)]


def probe_shutdown_busy(suite: Suite) -> list[Result]:
    """Must run last on the main server: it stops it."""
    t0 = time.monotonic()
    pool = fill_pool(suite)
    cancelled = pool.playing[0]
    cancelled.cancel()  # one cancelled: its pages go to a waiting one
    late = [HeldStream(suite.url, "orpheus",
                       make_inputs(FILL_TEXT, None, "fp32", MAX_TOKENS=LONG_TOKENS, SEED=600 + i, TOP_K=TOP_K),
                       f"late{i}") for i in range(2)]  # two more that wait
    queued_ok, _ = wait_until(lambda: suite.gauges().queued >= 2, 60, step=0.1)
    refused = HeldStream(suite.url, "orpheus", raw(("TEMPERATURE", np.array([0.5]), "FP64"))(), "refused")
    refused.final.wait(10)
    refused.cancel()  # a client that cancels a request Triton already refused (issue 9, finding 4)
    g = suite.gauges()
    open_streams = [h for h in pool.fillers + late if h is not cancelled and not h.final.is_set()]
    stubs = stub_pids(str(suite.server.work_dir))
    launcher = suite.server.proc
    t_sig = time.monotonic()
    launcher.send_signal(signal.SIGINT)
    try:
        rc = launcher.wait(60)
    except subprocess.TimeoutExpired:
        rc = None
    exit_s = time.monotonic() - t_sig
    time.sleep(0.5)
    left = sorted({p for p in stubs if running(p)} | set(stub_pids(str(suite.server.work_dir))))
    for h in open_streams:
        h.final.wait(1.0)
    answered = [h.final.is_set() and h.error is None and h.finish_reason == "shutdown" and not h.late
                for h in open_streams]
    finals = collections.Counter(short(h.error, 60) if h.error else f"final {h.finish_reason}" if h.final.is_set()
                                 else "nothing" for h in open_streams)
    stopped = next((ln for ln in suite.server.lines if ln.startswith("stopped")), "no 'stopped' line")
    release(pool.fillers + late)
    if rc is None:
        suite.server.kill()
    ok = (rc == 0 and stopped == "stopped (exit 0)" and exit_s <= 5.0 and all(answered) and not left and queued_ok)
    observed = (f"{pool}; at SIGINT: {g} (plus one stream cancelled before, one refused for its dtype then "
                f"cancelled); launcher exit {rc} after {exit_s:.1f} s, printed '{stopped}'; "
                f"{sum(answered)}/{len(open_streams)} open streams got a final response 'shutdown' from the server "
                f"({dict(finals)}); stub processes left: {len(left)}")
    return [Result("shutdown_busy", "SIGINT to `voxbackend serve` while streams run and wait (one cancelled, one "
                   "refused for its dtype and cancelled): exit 0 within 5 s, tritonserver exit 0, every open stream "
                   "gets a final response (reason shutdown) before the socket closes, no triton_python_backend_stub "
                   "left", observed, verdict(ok),
                   seconds=time.monotonic() - t0)]


def _plain_server(suite: Suite, name: str, repo: Path, extra_args: tuple[str, ...] = ()):
    from voxbackend.deploy.server import TritonServer

    return TritonServer(repo, log_file=suite.tmp / f"{name}-tritonserver.log", work_dir=suite.tmp / f"{name}-work",
                        extra_args=list(extra_args)).start(timeout=300)


def _sigterm(server) -> tuple[int | None, float]:
    """SIGTERM to tritonserver itself (what docker stop and Kubernetes send); its exit code and seconds to exit."""
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    try:
        return server.proc.wait(60), time.monotonic() - t0
    except subprocess.TimeoutExpired:
        return None, time.monotonic() - t0


def probe_drain(suite: Suite) -> list[Result]:
    """A plain tritonserver with the committed orpheus models (tiny default checkpoint), SIGTERM while streams
    play through `orpheus` and `orpheus_engine`."""
    from voxbackend.deploy import configs

    t0 = time.monotonic()
    repo = suite.tmp / "drain_repository"
    for folder in ("orpheus", "orpheus_preprocess", "orpheus_engine"):
        shutil.copytree(configs.DEFAULT_REPOSITORY / folder, repo / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    server = _plain_server(suite, "drain", repo)
    try:
        tokens = 700  # 100 frames, 8.5 s of audio, MIN_TOKENS too: longer than the time to SIGTERM
        outs: list = [None] * 4
        models = ["orpheus", "orpheus", "orpheus", "orpheus_engine"]
        threads = [threading.Thread(target=lambda i=i: outs.__setitem__(i, stream_request(
            server.grpc_url, models[i], make_inputs(TEXTS[i], None, None, MAX_TOKENS=tokens, MIN_TOKENS=tokens,
                                                    SEED=3000 + i, TOP_K=TOP_K), timeout=120)), daemon=True)
            for i in range(4)]
        for t in threads:
            t.start()
        wait_until(lambda: metric_total(server.metrics_url, "voxbackend_ttfa_seconds_count") >= 4, 60)
        server.proc.send_signal(signal.SIGTERM)
        t_sig = time.monotonic()
        # readiness fails first, then Triton closes its HTTP port, which is when the engines know (drain.py); a
        # request sent before that may still be admitted and served
        from voxbackend.triton.drain import http_port_open, server_http_address

        http = server_http_address(server.proc.pid)
        wait_until(lambda: http_port_open(http) is False, 5)
        ready = server.ready()
        t_late = time.monotonic()
        late = stream_request(server.grpc_url, "orpheus", short_inputs(0), timeout=10)
        late_s = time.monotonic() - t_late
        try:
            rc = server.proc.wait(60)
        except subprocess.TimeoutExpired:
            rc = None
        exit_s = time.monotonic() - t_sig
        for t in threads:
            t.join(30)
    finally:
        server.close()
    broken = {f"{models[i]} {i}": intact(o) if o else "no outcome" for i, o in enumerate(outs)}
    broken = {k: v for k, v in broken.items() if v}
    refused = late.error is not None and not late.chunks and late_s < 1.0
    ok = rc == 0 and not broken and refused and not ready
    observed = (f"exit {rc} {exit_s:.1f} s after SIGTERM; {4 - len(broken)}/4 streams (3 `orpheus`, 1 direct) "
                f"finished intact ({', '.join(str(len(o.chunks)) for o in outs if o)} chunks)"
                + (f", broken: {broken}" if broken else "")
                + f"; a request once the HTTP port closed: {short(late.error, 90)} after {late_s:.2f} s; readiness "
                + ("still 200" if ready else "failed"))
    return [Result("drain", "SIGTERM to a plain tritonserver while streams play through `orpheus` and "
                   "`orpheus_engine`: every stream finishes intact, readiness fails, a new request once the HTTP port "
                   "closed is refused within 1 s, exit 0", observed, verdict(ok), seconds=time.monotonic() - t0)]


def probe_drain_grace(suite: Suite) -> list[Result]:
    """The fake engine (streams as long as wanted) with drain_grace_s 2: streams that outlast it end with an error."""
    from voxbackend.deploy import configs

    t0 = time.monotonic()
    settings = {**FAKE_ENGINE, "kv_pages": "4096", "max_queue": "8", "drain_grace_s": "2"}
    repo = configs.write_repository(suite.tmp / "grace_repository", settings, models=["orpheus"])
    server = _plain_server(suite, "grace", repo)
    try:
        text = ("qzx " * 250)[:990]  # the fake: a chunk per prompt id, 20 ms apart: 20 s
        models = ["orpheus", "orpheus", "orpheus_engine"]
        outs = [None] * 3
        threads = [threading.Thread(target=lambda i=i: outs.__setitem__(i, stream_request(
            server.grpc_url, models[i], make_inputs(text, MAX_TOKENS=7000), timeout=60)), daemon=True)
            for i in range(3)]
        for t in threads:
            t.start()
        time.sleep(2.0)
        rc, exit_s = _sigterm(server)
        for t in threads:
            t.join(30)
    finally:
        server.close()
    ended = [o is not None and o.chunks and o.error and "drain grace period (2 s)" in o.error and not o.late_responses
             for o in outs]
    ok = rc == 0 and all(ended) and exit_s < 8
    observed = (f"exit {rc} {exit_s:.1f} s after SIGTERM; {sum(ended)}/3 streams (2 `orpheus`, 1 direct) had audio, "
                f"then one final error ({short(next((o.error for o in outs if o and o.error), None), 110)})")
    return [Result("drain_grace", "SIGTERM with streams longer than drain_grace_s (2 s; fake engine): each gets "
                   "its audio so far, then an error naming the grace period with the final flag; exit 0 within 8 s",
                   observed, verdict(ok), seconds=time.monotonic() - t0)]


def probe_refused_plain_sigint(suite: Suite) -> list[Result]:
    """What no model can mend (docs/triton.md, Stopping): a plain tritonserver (fake engine) with one request
    refused for its dtype whose client then cancels, then SIGINT (exit timeout 5 s here)."""
    from voxbackend.deploy import configs

    t0 = time.monotonic()
    repo = configs.write_repository(suite.tmp / "refused_repository", FAKE_ENGINE, models=["orpheus"])
    server = _plain_server(suite, "refused", repo, ("--exit-timeout-secs=5",))
    try:
        refused = HeldStream(server.grpc_url, "orpheus", raw(("TEMPERATURE", np.array([0.5]), "FP64"))(), "refused")
        refused.final.wait(10)
        refused.cancel()
        t_sig = time.monotonic()
        server.proc.send_signal(signal.SIGINT)
        try:
            rc = server.proc.wait(60)
        except subprocess.TimeoutExpired:
            rc = None
        exit_s = time.monotonic() - t_sig
    finally:
        server.close()
    observed = (f"refused with: {short(refused.error, 70)}; tritonserver exit {rc} {exit_s:.1f} s after SIGINT "
                "(Triton 2.51's gRPC frontend keeps the refused request, and so its model, alive; `voxbackend serve` "
                "ends such a server with exit 0: shutdown_busy)")
    return [Result("refused_plain_sigint", "a plain tritonserver, a request refused for its dtype whose client "
                   "cancels, then SIGINT: exit 0 within a few seconds", observed, verdict(rc == 0 and exit_s < 5),
                   seconds=time.monotonic() - t0)]


# ---------------------------------------------------------------- the table


@dataclass(frozen=True)
class Probe:
    name: str
    run: Callable[[Suite], list[Result]]
    models: tuple[str, ...] = ("orpheus",)  # served models it needs on the main server (none: its own server)
    doc: str = ""


PROBES: tuple[Probe, ...] = (
    Probe("bad_input", lambda s: probe_bad_inputs(s, s.args.bad_inputs), doc="BAD_INPUTS, each during long streams"),
    Probe("hog", probe_hog, doc="2 x MAX_TOKENS=1e9 + a normal request"),
    Probe("cancel_storm", probe_cancel_storm, doc="cancel 8 of 16 concurrent streams"),
    Probe("kill_running", probe_kill_running, doc="kill -9 of streaming client processes"),
    Probe("kill_queued", probe_kill_queued, doc="kill -9 of queued client processes"),
    Probe("overload", probe_overload, doc="requests beyond max_queue"),
    Probe("soak", probe_soak, doc="short requests at concurrency 8, RSS sampled"),
    Probe("engine_fault", probe_engine_fault, models=(), doc="engine loop dies (fake engine server)"),
    Probe("drain", probe_drain, models=(), doc="SIGTERM to a plain tritonserver while streams play (its own server)"),
    Probe("drain_grace", probe_drain_grace, models=(), doc="SIGTERM with streams past drain_grace_s (fake engine)"),
    Probe("refused_plain_sigint", probe_refused_plain_sigint, models=(),
          doc="refused-then-cancelled request, SIGINT to a plain tritonserver (Triton 2.51 fault)"),
    Probe("shutdown_busy", probe_shutdown_busy, doc="SIGINT while busy (stops the main server: last)"),
)


def select(only: str | None, quick: bool) -> tuple[list[Probe], tuple[BadInput, ...]]:
    """--only a,b,bad_input:name: probes by name; bad_input:<case> picks single bad inputs. --quick: Orpheus only."""
    cases = tuple(c for c in BAD_INPUTS if not (quick and c.model.startswith("csm")))
    if not only:
        return list(PROBES), cases
    wanted = [w.strip() for w in only.split(",") if w.strip()]
    known = {p.name for p in PROBES} | {f"bad_input:{c.name}" for c in BAD_INPUTS}
    unknown = [w for w in wanted if w not in known]
    if unknown:
        raise SystemExit(f"unknown probe(s) {unknown}; known: {', '.join(sorted(known))}")
    picked = [c.name for c in BAD_INPUTS if f"bad_input:{c.name}" in wanted]
    if picked and "bad_input" not in wanted:
        cases = tuple(c for c in BAD_INPUTS if c.name in picked)
    probes = [p for p in PROBES if p.name in wanted or (p.name == "bad_input" and picked)]
    return probes, cases


def served_models(probes: list[Probe], cases: tuple[BadInput, ...]) -> list[str]:
    models = {m for p in probes for m in p.models}
    if any(p.name == "bad_input" for p in probes) and any(c.model.startswith("csm") for c in cases):
        models.add("csm")
    return sorted(models, key=lambda m: m != "orpheus")


# ---------------------------------------------------------------- report


def cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render(results: list[Result], info: dict[str, str], argv: list[str], suite: Suite, wall_s: float,
           settings: dict[str, str], models: list[str]) -> str:
    passed = sum(r.verdict == PASS for r in results)
    leaks = [r for r in results if (r.pages_leaked or 0) or (r.queue_leaked or 0)]
    lines = [
        "# Reliability suite", "",
        "`" + " ".join(["python perf/reliability.py", *argv]) + "`", "",
        f"**{passed}/{len(results)} probes passed** in {wall_s / 60:.1f} min; "
        f"KV pages leaked: {sum(r.pages_leaked or 0 for r in results)}, queue slots leaked: "
        f"{sum(r.queue_leaked or 0 for r in results)} (summed over probes, read from the metrics port after each "
        f"scenario settled{'; leaks in: ' + ', '.join(r.probe for r in leaks) if leaks else ''}).", "",
        "## Setup and provenance", "",
        *provenance.markdown_lines(info),
        f"- load average at end: {provenance.load_average()} (the machine is shared: timings are noisy)",
        f"- server: `voxbackend serve --host 127.0.0.1` (free ports), models {', '.join(models) or 'none'}, "
        f"tiny default checkpoints (random weights), engine settings "
        + ", ".join(f"{k}={v}" for k, v in settings.items()) + ", everything else as committed (kv_pages 1024)",
        f"- clients: clients/tts_stream.py (threads and `python -m clients.tts_stream` processes), top_k {TOP_K}", "",
        "## Probes", "",
        "| probe | expected | observed | verdict | pages leaked | queue slots leaked | s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        leak = lambda v: "-" if v is None else str(v)  # noqa: E731
        lines.append(f"| {cell(r.probe)} | {cell(r.expected)} | {cell(r.observed)} | **{r.verdict}** | "
                     f"{leak(r.pages_leaked)} | {leak(r.queue_leaked)} | {r.seconds:.1f} |")
    if suite.soak:
        s = suite.soak
        lines += ["", "## Soak: RSS of the server's process tree", "",
                  f"{s['requests']} requests at concurrency {s['concurrency']} in {s['wall_s']:.0f} s. RSS after the "
                  f"first 10% of requests {s['warm_kib'] / 1024:.0f} MiB, peak {s['peak_kib'] / 1024:.0f} MiB, end "
                  f"{s['end_kib'] / 1024:.0f} MiB: growth {s['growth_kib'] / 1024:+.1f} MiB "
                  f"({s['growth_pct']:+.1f}%).", "",
                  "| process | RSS before (MiB) | RSS after (MiB) |", "|---|---|---|"]
        for name in sorted(set(s["start"]) | set(s["end"])):
            lines.append(f"| {name} | {s['start'].get(name, 0) / 1024:.0f} | {s['end'].get(name, 0) / 1024:.0f} |")
        step = max(1, len(s["samples"]) // 12)
        lines += ["", "| s | requests done | tree RSS (MiB) |", "|---|---|---|"]
        for t, d, kib in s["samples"][::step] + s["samples"][-1:]:
            lines.append(f"| {t:.0f} | {d} | {kib / 1024:.0f} |")
    lines += ["", "Probe definitions: docs/reliability.md.", ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="Orpheus only (no CSM bad inputs), a 150-request soak")
    ap.add_argument("--only", help="comma-separated probes (" + ", ".join(p.name for p in PROBES)
                    + ") or single bad inputs (bad_input:<name>)")
    ap.add_argument("--soak-requests", type=int, default=None, help="default 1000 (--quick: 150)")
    ap.add_argument("--concurrency", type=int, default=8, help="soak concurrency")
    ap.add_argument("--out", type=Path, default=None,
                    help="results file (default perf/results/<date>-<commit>-<machine>-reliability.md)")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--list", action="store_true", help="print the probes and bad inputs, run nothing")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an engine parameter of the main server, as `voxbackend serve --set` takes it (e.g. "
                    "cuda_graphs=padded, overlap_codec=on: the GPU's code paths on a CPU)")
    a = ap.parse_args(argv)
    bad = [x for x in a.set if "=" not in x]
    if bad:
        ap.error(f"--set takes KEY=VALUE, got {bad}")
    if a.soak_requests is None:
        a.soak_requests = 150 if a.quick else 1000
    return a


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    probes, args.bad_inputs = select(args.only, args.quick)
    if args.list:
        for p in PROBES:
            print(f"{p.name:14s} {p.doc}")
        for c in BAD_INPUTS:
            print(f"  bad_input:{c.name:34s} {c.model:20s} names {'/'.join(c.fields)}")
        return 0
    info = provenance.collect()
    t_start = time.monotonic()
    suite = Suite(args)
    models = served_models(probes, args.bad_inputs)
    # playback_margin_s: with KV pages that grow, a new stream (pressing: no audio yet) may preempt running streams
    # that are comfortably ahead of their listeners instead of waiting; a huge margin keeps every stream pressing,
    # so the probes that need requests really waiting in the queue (kill_queued, overload) can fill it
    settings = {"max_queue": str(MAX_QUEUE), "playback_margin_s": "1000", **dict(x.split("=", 1) for x in args.set)}
    results: list[Result] = []
    try:
        if models:
            print(f"starting voxbackend serve ({', '.join(models)}) ...", flush=True)
            suite.server = Launcher(models, settings, suite.tmp / "server")
            try:
                suite.server.start(args.startup_timeout)
                print(f"server ready after {time.monotonic() - t_start:.0f} s on {suite.url}", flush=True)
            except RuntimeError as e:  # the report still gets written: every probe that needs the server says so
                print(e, flush=True)
                results.append(Result("server", "voxbackend serve becomes ready", short(str(e), 300), ERROR))
        for probe in probes:
            t0 = time.monotonic()
            if probe.models and not suite.server.alive():
                results.append(Result(probe.name, probe.doc, "the main server is not running", ERROR))
                continue
            try:
                got = probe.run(suite)
            except Exception as e:  # noqa: BLE001 - record it, run the rest
                traceback.print_exc()
                got = [Result(probe.name, probe.doc, f"probe error: {type(e).__name__}: {short(str(e), 200)}", ERROR,
                              seconds=time.monotonic() - t0)]
            for r in got:
                print(f"{r.verdict:5s} {r.probe}: {r.observed}", flush=True)
            results += got
    finally:
        if suite.server is not None and suite.server.alive():
            suite.server.proc.send_signal(signal.SIGINT)
            try:
                suite.server.proc.wait(60)
            except subprocess.TimeoutExpired:
                suite.server.kill()
    wall = time.monotonic() - t_start
    out = args.out or HERE / "results" / provenance.result_filename("reliability", info)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(results, info, argv, suite, wall, settings, models))
    shutil.rmtree(suite.tmp, ignore_errors=True)
    failed = [r.probe for r in results if r.verdict != PASS]
    print(f"{len(results) - len(failed)}/{len(results)} passed in {wall / 60:.1f} min; wrote {out}")
    return 1 if failed or not results else 0


if __name__ == "__main__":
    sys.exit(main())
