"""A tritonserver for one test module: started on loopback ports, stopped and checked at the end."""
from __future__ import annotations

import re
import signal
import subprocess
import threading
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import numpy as np

from voxbackend.deploy.server import TritonServer

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = "committed_repository"  # the xdist group of the modules on the shared committed-repository server

T = TypeVar("T")


def serve(repo: Path, log_dir: Path, env: dict[str, str] | None = None, stop_within_s: float = 20.0,
          clean_exit: bool = True) -> Iterator[TritonServer]:
    """For `yield from` in a fixture: the running server, then a stop that must be quick (and clean)."""
    srv = TritonServer(repo, env=env or {}, log_file=log_dir / "tritonserver.log")
    srv.start(timeout=300)
    yield srv
    t0 = time.monotonic()
    code = srv.stop()
    if clean_exit:
        assert code == 0, f"tritonserver exited with {code}:\n{srv.log_tail()}"
    assert time.monotonic() - t0 < stop_within_s, "tritonserver took too long to stop (a stream left open?)"


def sigterm_while_streaming(server: TritonServer, jobs: list[Callable[[], T]], timeout: float = 300
                            ) -> tuple[int | None, float, list[T]]:
    """A module's last test (it stops the module's server): run the jobs (streams) and send SIGTERM to
    tritonserver once each has had its first audio. Returns the exit code, the time of the signal
    (time.monotonic(), the clock of StreamOutcome.end_time) and the jobs' results."""
    first = metric(server, "voxbackend_ttfa_seconds_count")
    results: list = [None] * len(jobs)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, jobs[i]()), daemon=True)
               for i in range(len(jobs))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    while metric(server, "voxbackend_ttfa_seconds_count") < first + len(jobs) and time.monotonic() < deadline:
        time.sleep(0.02)
    signalled = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    try:
        code = server.proc.wait(60)
    except subprocess.TimeoutExpired:
        code = None
    for t in threads:
        t.join(max(1.0, deadline - time.monotonic()))
    return code, signalled, results


@dataclass
class ServeProcess:
    """`voxbackend serve` in a child process (what users and the Docker image run), its output collected."""
    proc: subprocess.Popen
    lines: list[str]
    ports: list[int]  # http, grpc, metrics
    reader: threading.Thread

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.ports[1]}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports[2]}/metrics"

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def stop(self, sig: int, timeout: float = 60) -> tuple[int, float]:
        """Send sig; the launcher's exit code and the seconds it took."""
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        return self.proc.wait(timeout), time.monotonic() - t0

    def close(self) -> None:
        """After a failed check: SIGINT first, as a SIGKILL would orphan its tritonserver."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.reader.join(5)


def start_serve(work_dir: Path, settings: dict[str, str], models: str = "orpheus") -> ServeProcess:
    from voxbackend.deploy.server import free_port

    ports = [free_port() for _ in range(3)]
    cmd = [sys.executable, "-m", "voxbackend.cli", "serve", "--models", models, "--work-dir", str(work_dir),
           "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]),
           *[arg for k, v in settings.items() for arg in ("--set", f"{k}={v}")]]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    served = ServeProcess(proc, lines, ports, reader)
    deadline = time.monotonic() + 300
    while not any(line.startswith("ready:") for line in lines) and time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    if not any(line.startswith("ready:") for line in lines):
        served.close()
        raise AssertionError("voxbackend serve did not become ready:\n" + served.output[-3000:])
    return served


def drain_streams(server: TritonServer, requests: list[tuple[str, list, str]]) -> list:
    """The last test on its server (it stops it): (model, inputs, audio format) streams, SIGTERM to
    tritonserver once each has had its first audio; asserts that the server exited 0 and that some stream
    ended after the signal (so the drain had work to do), and returns the streams' outcomes."""
    from voxbackend.stream_client import stream_request

    code, signalled, outs = sigterm_while_streaming(server, [
        lambda m=m, i=i, f=f: stream_request(server.grpc_url, m, i, f, timeout=240) for m, i, f in requests])
    seen = [(len(o.chunks), o.finish_reason, o.error, o.end_time and o.end_time - signalled) if o else None
             for o in outs]
    assert code == 0, f"exit {code}; streams (chunks, finish, error, s after SIGTERM): {seen}\n{server.log_tail()}"
    assert any(o and o.end_time and o.end_time > signalled for o in outs), "every stream ended before SIGTERM"
    return outs


def run_concurrently(jobs: list[Callable[[], T]], stagger_s: float = 0.0, timeout: float = 600) -> list[T]:
    """Run each job on its own thread (started `stagger_s` apart, so they arrive in order) and collect results."""
    results: list = [None] * len(jobs)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, jobs[i]())) for i in range(len(jobs))]
    for t in threads:
        t.start()
        time.sleep(stagger_s)
    for t in threads:
        t.join(timeout)
    return results


def assert_matches(out, expected: np.ndarray, fmt: str, what: str, rate: int = 24000, atol: float = 1e-4,
                   rtol: float = 0.0) -> None:
    """A finished stream (voxbackend.stream_client.StreamOutcome) carries exactly the expected audio. The engine may
    merge several ready windows into one chunk, so chunk boundaries depend on timing; the samples do not."""
    assert out.error is None, f"{what}: {out.error}"
    assert out.finish_reason in ("stop", "length"), what
    assert out.sample_rate == rate
    assert out.indices == list(range(len(out.chunks))) and out.arrived_in_order, f"{what}: chunks out of order"
    want = np.clip(expected, -1, 1) if fmt == "pcm16" else expected
    assert out.audio.size == want.size, f"{what}: {out.audio.size} samples, expected {want.size}"
    atol += 1.0 / 32767 if fmt == "pcm16" else 0.0  # PCM16 rounds each sample
    np.testing.assert_allclose(out.audio, want, atol=atol, rtol=rtol, err_msg=what)


def metric_values(server: TritonServer, name: str) -> dict[str, float]:
    """{label string: value} for one metric family on the metrics port."""
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    return {m.group(1) or "": float(m.group(2))
            for m in re.finditer(rf"^{name}(\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.MULTILINE)}


def metric(server: TritonServer, name: str, **labels) -> float:
    """The sum of a metric family's values over the series whose labels include `labels`."""
    values = metric_values(server, name)
    return sum(v for k, v in values.items() if all(f'{lk}="{lv}"' in k for lk, lv in labels.items()))
