"""SIGTERM to a plain tritonserver (what `docker stop` and Kubernetes send): the server drains.

Streams through the front model (`orpheus`), direct engine streams and text-stream sequences all finish with
their whole audio and the server exits 0; a request sent during the drain is refused at once; streams still
running at the end of drain_grace_s get an error and a final response, and the exit is still 0. The fake engine
(weights-free; one chunk per prompt character, `step_s` apart) keeps the streams long and their lengths known
(the real models drain in tests/test_triton_committed_drain.py). `voxbackend serve` passes SIGTERM on the same way.
"""
from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from voxbackend.stream_client import StreamOutcome, make_inputs, stream_request, stream_text_pieces  # noqa: E402
from tests.triton_util import start_serve  # noqa: E402
from voxbackend.deploy import configs  # noqa: E402
from voxbackend.triton.drain import http_port_open, server_http_address  # noqa: E402
from voxbackend.testing.fake_engine import TOKENS_PER_CHUNK, FakeStreamingModel  # noqa: E402
from voxbackend.deploy.server import TritonServer  # noqa: E402

FAKE = {
    "checkpoint": "unused",
    "engine_loader": "voxbackend.testing.fake_engine:load_streaming",
    "frontend_loader": "voxbackend.testing.fake_engine:load_streaming_frontend",
    "kv_pages": "4096",
    "max_batch": "8",
}
TEXT_STREAM = "orpheus_text_stream"
LONG = ("qzx " * 300)[:406]  # one fake token a character: 407 chunks (the voice's id first), about 8 s


def chunks(text: str) -> int:
    """How many chunks the fake streams for this text (one per prompt id)."""
    return len(FakeStreamingModel().prepare(text))


def fake_repository(dest: Path, **settings: str) -> Path:
    """orpheus (front, preprocess, engine) and a text-stream model on the fake streaming engine."""
    params = {**FAKE, **settings}
    repo = configs.write_repository(dest, params, models=["orpheus"])
    served = dataclasses.replace(configs.select(["orpheus"])[0], text_streaming=True)
    (repo / TEXT_STREAM / "1").mkdir(parents=True)
    (repo / TEXT_STREAM / "config.pbtxt").write_text(configs.render_text_stream(served, served.params(params)))
    for path, text in configs.text_stream_files(served).items():
        (repo / path).write_text(text)
    return repo


def start_streams(url: str, chars: int = len(LONG)) -> tuple[dict[str, StreamOutcome], list[threading.Thread]]:
    outs: dict[str, StreamOutcome] = {}
    tokens = (chars + 1) * TOKENS_PER_CHUNK  # the fake's length: min(prompt ids, max_tokens / 7) chunks

    def run(name: str, call) -> threading.Thread:
        t = threading.Thread(target=lambda: outs.__setitem__(name, call()), daemon=True)
        t.start()
        return t

    text = (LONG * 3)[:chars]
    threads = [run(f"front {i}", lambda: stream_request(url, "orpheus", make_inputs(text, MAX_TOKENS=tokens),
                                                        timeout=90)) for i in range(3)]
    threads.append(run("direct", lambda: stream_request(url, "orpheus_engine", make_inputs(text, MAX_TOKENS=tokens),
                                                       timeout=90)))
    pieces = [text[i:i + 40] for i in range(0, len(text), 40)]
    threads.append(run("text stream", lambda: stream_text_pieces(
        url, TEXT_STREAM, pieces, make_inputs(None, MAX_TOKENS=tokens, batched=True), piece_delay=0.3, timeout=90)))
    return outs, threads


@pytest.fixture
def fake_server(tmp_path):
    def start(**settings: str) -> TritonServer:
        repo = fake_repository(tmp_path / "model_repository", **settings)
        return TritonServer(repo, log_file=tmp_path / "tritonserver.log", work_dir=tmp_path / "work").start(120)

    servers: list[TritonServer] = []
    yield lambda **s: servers.append(start(**s)) or servers[-1]
    for srv in servers:
        srv.close()  # a no-op for a server that exited; kills one a failed check left running


def test_sigterm_lets_every_open_stream_finish_refuses_new_ones_and_exits_0(fake_server):
    srv = fake_server()
    outs, threads = start_streams(srv.grpc_url)
    time.sleep(2.5)  # every stream plays (the text stream's pieces still arrive)
    srv.proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    # readiness fails first, then Triton closes its HTTP port, which is when the engines know (drain.py); a request
    # sent before that may still be admitted and served (seen under load: readiness false, the port still open)
    http = server_http_address(srv.proc.pid)
    while http_port_open(http) is not False and time.monotonic() - t0 < 5:
        time.sleep(0.02)
    assert not srv.ready(), "the server still reports ready while it drains"
    t_late = time.monotonic()
    late = stream_request(srv.grpc_url, "orpheus", make_inputs("too late", MAX_TOKENS=70), timeout=10)
    refused_in = time.monotonic() - t_late
    assert late.error is not None and not late.chunks, "a new request was served during the drain"
    assert refused_in < 2.0, f"a new request waited {refused_in:.1f} s to be refused"
    code = srv.proc.wait(60)
    took = time.monotonic() - t0
    for t in threads:
        t.join(30)
    assert code == 0, srv.log_tail()
    for name, out in sorted(outs.items()):
        assert out.error is None and out.finish_reason in ("stop", "length"), (name, out.error, out.finish_reason)
        assert len(out.chunks) == chunks(LONG) and out.late_responses == 0, (name, len(out.chunks))
    assert len(outs) == 5, sorted(outs)
    assert took > 3, f"exited {took:.1f} s after SIGTERM: the streams cannot have played to their end"


def test_streams_past_the_drain_grace_period_end_with_an_error_and_the_exit_is_clean(fake_server, monkeypatch):
    """A text stream's client stops sending pieces once its stream ended, so its Triton sequence (which Triton's
    stop waits for) ends at the sequence idle timeout: 2 s here, 10 s as served."""
    monkeypatch.setattr(configs, "TEXT_STREAM_IDLE_US", 2_000_000)
    srv = fake_server(drain_grace_s="2")
    outs, threads = start_streams(srv.grpc_url, chars=990)  # 20 s each
    time.sleep(2.5)
    srv.proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    code = srv.proc.wait(60)
    took = time.monotonic() - t0
    for t in threads:
        t.join(30)
    assert code == 0, srv.log_tail()
    assert took < 2 + 2 + 6, f"exited {took:.1f} s after SIGTERM with a 2 s grace period and a 2 s sequence idle time"
    assert len(outs) == 5, sorted(outs)
    for name, out in sorted(outs.items()):
        assert out.error and "drain grace period (2 s)" in out.error, (name, out.error)
        assert 0 < len(out.chunks) < chunks((LONG * 3)[:990]) and out.late_responses == 0, (name, len(out.chunks))


@pytest.mark.xfail(strict=True, reason="Triton 2.51's gRPC frontend keeps a refused streaming request (and so its "
                   "model) alive once the client cancels the stream: SIGINT waits out --exit-timeout-secs and exits "
                   "1 (docs/triton.md, 'Stopping'); `voxbackend serve` ends such a server cleanly")
def test_a_refused_then_cancelled_request_does_not_hold_a_plain_server(tmp_path):
    from tests.test_triton_lifecycle import _refused_then_cancelled

    repo = fake_repository(tmp_path / "model_repository")
    srv = TritonServer(repo, log_file=tmp_path / "tritonserver.log", work_dir=tmp_path / "work",
                       extra_args=["--exit-timeout-secs=4"]).start(120)
    try:
        assert "data-type is 'FP64'" in (_refused_then_cancelled(srv.grpc_url, "orpheus") or "")
        srv.proc.send_signal(signal.SIGINT)
        assert srv.proc.wait(30) == 0
    finally:
        srv.close()


def test_voxbackend_serve_drains_on_sigterm(tmp_path):
    """The launcher passes SIGTERM on (the Docker image's entrypoint): open streams finish, not cut with
    "shutdown" as on Ctrl-C, and it exits 0, a refused-then-cancelled request included."""
    from tests.test_triton_lifecycle import _refused_then_cancelled

    served = start_serve(tmp_path, FAKE)
    try:
        url = served.url
        outs: dict[str, StreamOutcome] = {}
        threads = [threading.Thread(target=lambda m=m: outs.__setitem__(m, stream_request(
            url, m, make_inputs(LONG, MAX_TOKENS=chunks(LONG) * TOKENS_PER_CHUNK), timeout=90)), daemon=True)
            for m in ("orpheus", "orpheus_engine")]
        for t in threads:
            t.start()
        assert "data-type is 'FP64'" in (_refused_then_cancelled(url, "orpheus") or "")
        time.sleep(2)
        code, _ = served.stop(signal.SIGTERM, 90)
        for t in threads:
            t.join(30)
    finally:
        served.close()
    log = served.output
    assert code == 0 and "stopped (exit 0)" in log, log[-3000:]
    for model, out in sorted(outs.items()):
        assert out.error is None and out.finish_reason in ("stop", "length"), (model, out.error, out.finish_reason)
        assert len(out.chunks) == chunks(LONG), (model, len(out.chunks))


CLIENT = """
import sys
sys.path.insert(0, sys.argv[1])
from voxbackend.stream_client import make_inputs, stream_request
stream_request(sys.argv[2], "orpheus", make_inputs(sys.argv[3], MAX_TOKENS=int(sys.argv[4])), timeout=120)
"""


def test_clients_killed_mid_stream_leave_the_front_model_healthy(fake_server):
    """kill -9 of clients while audio flows through the front model, six times: the front model's stub lives
    (a front model that called its engine by BLS died of heap corruption here: docs/triton.md, "Stopping"), its
    streams end and the next request is served."""
    from tests.triton_util import metric

    srv = fake_server()
    for round_ in range(6):
        procs = [subprocess.Popen([sys.executable, "-c", CLIENT, str(ROOT), srv.grpc_url, LONG,
                                   str(chunks(LONG) * TOKENS_PER_CHUNK)]) for _ in range(4)]
        t0 = time.monotonic()
        while metric(srv, "voxbackend_active_streams") < 4 and time.monotonic() - t0 < 60:
            time.sleep(0.05)
        time.sleep(0.5 + 0.3 * round_)  # chunks are flowing
        for p in procs:
            p.kill()
            p.wait(10)
        t0 = time.monotonic()
        while metric(srv, "voxbackend_active_streams") and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        assert metric(srv, "voxbackend_active_streams") == 0, f"round {round_}: streams of killed clients left open"
        after = stream_request(srv.grpc_url, "orpheus", make_inputs("still there?", MAX_TOKENS=70), timeout=30)
        assert after.error is None and after.finish_reason in ("stop", "length"), (round_, after.error)
