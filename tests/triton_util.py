"""A tritonserver for one test module: started on loopback ports, stopped and checked at the end."""
from __future__ import annotations

import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import numpy as np

from voxbackend.triton.server import TritonServer

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
    tritonserver once each has had its first audio. Returns the exit code, the engines' open streams at the
    signal (the drain had something to do when > 0) and the jobs' results."""
    first = metric(server, "voxbackend_ttfa_seconds_count")
    results: list = [None] * len(jobs)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, jobs[i]()), daemon=True)
               for i in range(len(jobs))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    while metric(server, "voxbackend_ttfa_seconds_count") < first + len(jobs) and time.monotonic() < deadline:
        time.sleep(0.02)
    open_streams = metric(server, "voxbackend_active_streams")
    server.proc.send_signal(signal.SIGTERM)
    try:
        code = server.proc.wait(60)
    except subprocess.TimeoutExpired:
        code = None
    for t in threads:
        t.join(max(1.0, deadline - time.monotonic()))
    return code, open_streams, results


def committed_models(folders: list[str], repo: Path) -> Path:
    """A repository holding only these folders of the committed model_repository/ (what users copy)."""
    from voxbackend.triton import configs

    for name in folders:
        shutil.copytree(configs.DEFAULT_REPOSITORY / name, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
    return repo


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
    """A finished stream (clients.tts_stream.StreamOutcome) carries exactly the expected audio. The engine may
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
