"""A real tritonserver: dead clients leave the queue at once (weights-free fake engine), and `voxbackend serve` stops
cleanly in any state (streams running, queued, cancelled, refused), with the fake engine and with the real tiny one.

The fake engine of the queue tests holds one stream at a time (max_batch 1), so every other request waits in its
queue.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tritonclient.grpc as tritonclient  # noqa: E402

from voxbackend.stream_client import StreamOutcome, make_inputs, stream_request  # noqa: E402
from voxbackend.deploy import configs  # noqa: E402
from voxbackend.deploy.server import SHM_DIR, TritonServer  # noqa: E402
from tests.triton_util import serve, start_serve  # noqa: E402

FAKE = {
    "checkpoint": "unused",  # the fake ignores it; a non-empty value skips building the default checkpoint
    "engine_loader": "voxbackend.testing.fake_engine:load",
    "frontend_loader": "voxbackend.testing.fake_engine:load_frontend",
    "max_batch": "1",
    "max_queue": "8",
}
QUEUED = 5

CLIENT = """
import sys, time
sys.path.insert(0, sys.argv[1])
import tritonclient.grpc as grpcclient
from voxbackend.stream_client import make_inputs
client = grpcclient.InferenceServerClient(sys.argv[2])
client.start_stream(callback=lambda result, error: None)
client.async_stream_infer(sys.argv[3], make_inputs(sys.argv[4], MAX_TOKENS=70), enable_empty_final_response=True)
print("sent", flush=True)
time.sleep(600)
"""


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return sum(float(v) for v in re.findall(rf"^{name}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.MULTILINE))


def wait_for(predicate, timeout: float, step: float = 0.05) -> float | None:
    """Seconds until predicate() held, or None after timeout."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if predicate():
            return time.monotonic() - t0
        time.sleep(step)
    return None


class LongStream:
    """A stream that holds the model's engine (the fake sends one chunk per prompt id) until stopped."""

    def __init__(self, url: str, model: str = "orpheus_engine", ids: int = 2000):
        self.client = tritonclient.InferenceServerClient(url)
        self.responses = 0
        self.client.start_stream(callback=lambda result, error: setattr(self, "responses", self.responses + 1))
        if model == "orpheus_engine":
            prompt = tritonclient.InferInput("PROMPT_IDS", [ids], "INT64")
            prompt.set_data_from_numpy(np.full(ids, 97, np.int64))
            inputs = [prompt, *make_inputs(None, MAX_TOKENS=7 * ids)]
        else:  # the front model takes text: one fake id per character, up to the fake's 1000 characters
            ids = min(ids, 990)
            inputs = make_inputs("a" * (ids - 1), MAX_TOKENS=7 * ids)
        self.client.async_stream_infer(model, inputs, enable_empty_final_response=True)

    def stop(self) -> None:
        self.client.stop_stream(cancel_requests=True)
        self.client.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = configs.write_repository(tmp_path_factory.mktemp("repo") / "model_repository", FAKE, models=["orpheus"])
    yield from serve(repo, tmp_path_factory.mktemp("triton"))


# ---------------------------------------------------------------- dead clients leave the queue


def _queue_clients_in_subprocesses(server, model: str) -> list[subprocess.Popen]:
    procs = [subprocess.Popen([sys.executable, "-c", CLIENT, str(ROOT), server.grpc_url, model, f"queued {i}"],
                              stdout=subprocess.PIPE, text=True) for i in range(QUEUED)]
    for p in procs:
        assert p.stdout.readline().strip() == "sent"
    return procs


def _queue_clients_here(server, model: str) -> list:
    clients = []
    for i in range(QUEUED):
        c = tritonclient.InferenceServerClient(server.grpc_url)
        c.start_stream(callback=lambda result, error: None)
        c.async_stream_infer(model, make_inputs(f"queued {i}", MAX_TOKENS=70), enable_empty_final_response=True)
        clients.append(c)
    return clients


@pytest.mark.parametrize("how", ["kill -9", "close the stream"])
@pytest.mark.parametrize("model", ["orpheus", "orpheus_engine"])
def test_dead_queued_clients_leave_the_queue_within_a_second(server, model, how):
    queued = lambda: metric(server.metrics_url, "voxbackend_queued_requests")  # noqa: E731
    long = LongStream(server.grpc_url, model)  # each model has its own engine (docs/triton.md)
    try:
        assert wait_for(lambda: long.responses > 0, 30) is not None, "the long stream did not start"
        if how == "kill -9":
            procs = _queue_clients_in_subprocesses(server, model)
        else:
            clients = _queue_clients_here(server, model)
        assert wait_for(lambda: queued() == QUEUED, 30) is not None, f"not {QUEUED} queued: {queued()}"
        t0 = time.monotonic()
        if how == "kill -9":
            for p in procs:
                p.send_signal(signal.SIGKILL)
            for p in procs:
                p.wait(10)
        else:
            for c in clients:
                c.stop_stream(cancel_requests=True)
                c.close()
        gone = wait_for(lambda: queued() == 0, 10)
        assert gone is not None, f"{queued()} dead clients still hold queue slots after 10 s"
        assert time.monotonic() - t0 < 1.0, f"the queue emptied {time.monotonic() - t0:.2f} s after the clients died"
        # a live client is served next, not refused for a full queue
        out = stream_request(server.grpc_url, model, make_inputs("after the dead ones", MAX_TOKENS=70), timeout=1,
                             linger_s=0)
        assert out.error is None or "timed out" in out.error, out.error  # still queued behind the long stream
    finally:
        long.stop()
    assert wait_for(lambda: metric(server.metrics_url, "voxbackend_active_streams") == 0, 10) is not None


# ---------------------------------------------------------------- voxbackend serve stops cleanly


def _stubs_of(work_dir: Path) -> list[int]:
    """Processes whose command line names the work folder: the server's model stubs (and the server)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(work_dir).encode() in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue
    return pids


def _queued_then_cancelled(url: str, model: str, text: str = "cancelled while queued", tokens: int = 70) -> None:
    client = tritonclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: None)
    client.async_stream_infer(model, make_inputs(text, MAX_TOKENS=tokens), enable_empty_final_response=True)
    time.sleep(0.3)
    client.stop_stream(cancel_requests=True)
    client.close()


def _refused_then_cancelled(url: str, model: str) -> str | None:
    """A request Triton refuses (wrong dtype), whose client then cancels: Triton 2.51 keeps it counted."""
    text = tritonclient.InferInput("TEXT", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"hello"], dtype=np.object_))
    bad = tritonclient.InferInput("TEMPERATURE", [1], "FP64")
    bad.set_data_from_numpy(np.array([0.5], np.float64))
    errors: list = []
    client = tritonclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: errors.append(error))
    client.async_stream_infer(model, [text, bad], enable_empty_final_response=True)
    wait_for(lambda: errors, 10)
    client.stop_stream(cancel_requests=True)
    client.close()
    return str(errors[0]) if errors and errors[0] is not None else None


@dataclass(frozen=True)
class Busy:
    """What keeps a server busy: two long streams (through the front model and direct) that take their engines (each
    model has its own), and two more that wait behind them in the queues."""
    settings: dict[str, str]
    long_text: str
    long_tokens: int
    short_tokens: int
    models: tuple[str, str] = ("orpheus", "orpheus_engine")  # the "front" and the "direct" streams' models


# the fake holds one stream per max_batch slot and sends one chunk per prompt id
FAKE_BUSY = Busy({**FAKE, "max_batch": "1"}, "a long stream " * 28, 7000, 70)
# The real tiny Orpheus, every stream through `orpheus` (one engine: a long stream of this tiny model ends within a
# few seconds, and 600 tokens once ended before SIGINT on a loaded CI machine, so the streams ask Orpheus's most):
# two ~800-token prompts take 100 of 128 KV pages, so a third (50 pages for its prompt, one free page per running
# stream on top) waits; playback_margin_s keeps every stream pressing, so a newcomer waits rather than preempts a
# running one. 800 + 1200 tokens fit the pool alone (one that never could is refused).
REAL_BUSY = Busy({"kv_pages": "128", "max_queue": "8", "playback_margin_s": "1000"}, "hello " * 200, 1200, 35,
                 models=("orpheus", "orpheus"))


def _serve_busy_then_sigint(tmp_path: Path, busy: Busy) -> tuple[int, float, str, dict[str, StreamOutcome], int]:
    """`voxbackend serve` with streams running, queued, cancelled while queued, and refused then cancelled; SIGINT.
    Returns the launcher's exit code, seconds from SIGINT to its exit, its output, each open stream's outcome and
    the server's gRPC port."""
    served = start_serve(tmp_path, busy.settings)
    try:
        ready = next(line for line in served.lines if line.startswith("ready:"))
        assert f"grpc {served.url}" in ready, ready  # loopback unless --host says otherwise
        url, metrics_url = served.url, served.metrics_url
        outs: dict[str, StreamOutcome] = {}

        def stream(name: str, model: str, text: str, tokens: int) -> threading.Thread:
            # MIN_TOKENS: a random-weight stream may sample its stop token early and end before SIGINT
            t = threading.Thread(target=lambda: outs.__setitem__(name, stream_request(
                url, model, make_inputs(text, MAX_TOKENS=tokens, MIN_TOKENS=tokens), timeout=120)))
            t.start()
            return t

        front, direct = busy.models
        threads = [stream("running front", front, busy.long_text, busy.long_tokens),
                   stream("running direct", direct, busy.long_text, busy.long_tokens)]
        assert wait_for(lambda: metric(metrics_url, "voxbackend_ttfa_seconds_count") >= 2, 60) is not None, \
            "the two long streams did not start playing"
        for model in busy.models:
            _queued_then_cancelled(url, model, busy.long_text, busy.short_tokens)
        threads += [stream("queued front", front, busy.long_text, busy.short_tokens),
                    stream("queued direct", direct, busy.long_text, busy.short_tokens)]
        # a long stream of the tiny model is short: check the queue before anything slower
        assert wait_for(lambda: metric(metrics_url, "voxbackend_queued_requests") >= 2, 30) is not None, \
            {k: (v.error, v.finish_reason, len(v.chunks)) for k, v in outs.items()}
        refused = [_refused_then_cancelled(url, m) for m in ("orpheus", "orpheus_engine")]
        assert all(r and "data-type is 'FP64'" in r for r in refused), refused
        assert all(t.is_alive() for t in threads), f"a stream ended before SIGINT: {sorted(outs)}"
        code, took = served.stop(signal.SIGINT)
        for t in threads:
            t.join(30)
    finally:
        served.close()
    return code, took, served.output, outs, served.ports[1]


def _assert_stopped_cleanly(tmp_path: Path, code: int, took: float, log: str, outs: dict[str, StreamOutcome],
                            grpc_port: int, within_s: float) -> None:
    assert code == 0, log[-3000:]
    assert "stopped (exit 0)" in log
    for name in ("running front", "running direct", "queued front", "queued direct"):
        out = outs[name]  # the server's own final response, before the socket closed
        assert out.error is None and out.finish_reason == "shutdown" and out.late_responses == 0, (name, out.error)
    assert outs["running front"].chunks and outs["running direct"].chunks
    assert not _stubs_of(tmp_path), f"left running after the launcher exited: {_stubs_of(tmp_path)}"
    # the stubs Triton keeps for the refused request are killed: their shared memory must not stay in /dev/shm
    assert not list(SHM_DIR.glob(f"voxbackend_*_{grpc_port}_*")), "shared-memory regions left behind"
    assert took < within_s, f"voxbackend serve took {took:.1f} s to stop:\n{log[-3000:]}"


def test_serve_stops_cleanly_with_streams_running_queued_cancelled_and_refused(tmp_path):
    _assert_stopped_cleanly(tmp_path, *_serve_busy_then_sigint(tmp_path, FAKE_BUSY), within_s=10)


def test_serve_stops_the_real_engine_cleanly_and_quickly_when_busy(tmp_path):
    """The real tiny Orpheus engine (default checkpoint): its stubs import torch, whose interpreter teardown
    took 1.5-4 s per stub (Triton unloads a model's instances one after another), and so did the launcher's:
    a busy stop took 8-13 s. Now every stream ends with "shutdown" and the launcher exits within a few seconds."""
    _assert_stopped_cleanly(tmp_path, *_serve_busy_then_sigint(tmp_path, REAL_BUSY), within_s=6)


def test_a_killed_server_leaves_no_shared_memory_behind(tmp_path):
    """tritonserver and its stubs killed at once (a crash, an OOM kill): the Python backend never unlinks its
    regions, and tmpfs keeps them in memory. stop() removes this server's, and only this server's."""
    repo = configs.write_repository(tmp_path / "model_repository", FAKE, models=["orpheus"])
    other = SHM_DIR / "voxbackend_1_1_not_this_servers"
    other.write_bytes(b"x")
    srv = TritonServer(repo, log_file=tmp_path / "tritonserver.log", work_dir=tmp_path / "work").start(timeout=120)
    try:
        regions = list(SHM_DIR.glob(srv.shm_prefix + "*"))
        assert len(regions) >= 2, regions  # one per stub: the front, preprocess and engine models each have one
        os.killpg(srv.proc.pid, signal.SIGKILL)
    finally:
        srv.stop()
        assert other.exists()
        other.unlink()
    assert not list(SHM_DIR.glob(srv.shm_prefix + "*"))
    assert "shared-memory region(s) that killed stubs left" in (tmp_path / "tritonserver.log").read_text()
