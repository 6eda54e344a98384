"""Fail-over behind a balancer: three tritonservers (the weights-free fake engine) behind HAProxy, run with the
project's own deploy/haproxy/haproxy.cfg (its servers replaced by the local ones). Streams spread over the three;
SIGTERM to one mid-run drains it: its open streams finish, HAProxy takes it out, new streams go to the others and
none errors; kill -9 of another: only its own streams fail, with an error, and the rest play on."""
from __future__ import annotations

import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.triton_util import metric
from voxbackend.deploy import configs
from voxbackend.deploy.server import TritonServer, free_port
from voxbackend.stream_client import StreamOutcome, make_inputs, stream_request

ROOT = Path(__file__).resolve().parents[1]
FAKE = {"checkpoint": "unused", "engine_loader": "voxbackend.testing.fake_engine:load",
        "frontend_loader": "voxbackend.testing.fake_engine:load_frontend", "kv_pages": "4096", "max_batch": "16"}
TEXT = "A stream long enough to outlive a server's stop, one chunk per character of this sentence and more."
MAX_TOKENS = 7 * 120  # the fake sends one chunk per prompt id (about 2 s at its 20 ms a step)


def haproxy_config(port: int, servers: list[TritonServer]) -> str:
    """deploy/haproxy/haproxy.cfg with the local address and servers."""
    text = (ROOT / "deploy" / "haproxy" / "haproxy.cfg").read_text()
    text = re.sub(r"bind \S+ proto h2", f"bind 127.0.0.1:{port} proto h2", text)
    lines = [f"    server s{i} {s.grpc_url} proto h2 check port {s.http_port} check-proto h1"
             for i, s in enumerate(servers)]
    return re.sub(r"(    server .*\n)+", "\n".join(lines) + "\n", text)


@pytest.fixture
def farm(tmp_path):
    if shutil.which("haproxy") is None:
        pytest.fail("no haproxy (scripts/setup_env.sh installs Debian's haproxy)")
    repo = configs.write_repository(tmp_path / "repo", FAKE, models=["orpheus"])
    for unused in ("orpheus_engine", "orpheus_preprocess"):  # the streams go to `orpheus`, which hosts its engine:
        shutil.rmtree(repo / unused)  # one stub a server, not three (memory, beside the rest of the suite)
    servers = [TritonServer(repo, log_file=tmp_path / f"triton{i}.log") for i in range(3)]
    for s in servers:
        s.start(timeout=120)
    port = free_port()
    (tmp_path / "haproxy.cfg").write_text(haproxy_config(port, servers))
    proxy = subprocess.Popen(["haproxy", "-db", "-f", str(tmp_path / "haproxy.cfg")], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_for(lambda: answers(f"127.0.0.1:{port}"), timeout=20), "nothing answers through HAProxy"
        time.sleep(1.5)  # every server's health check passed twice (rise 2, every 0.5 s)
        yield f"127.0.0.1:{port}", servers
    finally:
        proxy.terminate()
        proxy.wait(10)
        for s in servers:
            s.close()


def wait_for(check, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def answers(url: str) -> bool:
    try:  # before the first health checks pass HAProxy has no server, and the client's stream breaks at once
        return stream_request(url, "orpheus", make_inputs("Hi.", MAX_TOKENS=14), timeout=5).error is None
    except Exception:  # noqa: BLE001
        return False


def streams(url: str, n: int, tag: str) -> tuple[list[StreamOutcome | None], list[threading.Thread]]:
    outs: list[StreamOutcome | None] = [None] * n

    def run(i: int) -> None:
        outs[i] = stream_request(url, "orpheus", make_inputs(f"{TEXT} {tag} {i}", MAX_TOKENS=MAX_TOKENS, SEED=i),
                                 timeout=60)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return outs, threads


def active(server: TritonServer) -> int:
    return int(metric(server, "voxbackend_active_streams", model="orpheus"))


def test_drain_and_crash_behind_haproxy(farm):
    url, (a, b, c) = farm
    outs, threads = streams(url, 9, "first")
    running = lambda *servers: [active(s) for s in servers]  # noqa: E731
    assert wait_for(lambda: sum(running(a, b, c)) == 9 and min(running(a, b, c)) > 0, timeout=20), \
        running(a, b, c)  # leastconn spread them over all three
    a.proc.send_signal(signal.SIGTERM)  # a drain: its streams finish, Triton's readiness fails at once
    time.sleep(2.0)  # HAProxy's check (every 0.5 s, one failure) takes it out
    late, late_threads = streams(url, 3, "after the drain began")
    for t in threads + late_threads:
        t.join(60)
    assert all(o is not None and o.error is None and o.finish_reason == "length" for o in outs + late), \
        [(o.error, o.finish_reason) if o else None for o in outs + late]
    assert a.proc.wait(30) == 0
    finished_on_c = metric(c, "voxbackend_requests_finished_total", model="orpheus")

    outs, threads = streams(url, 6, "second")
    assert wait_for(lambda: sum(running(b, c)) == 6 and min(running(b, c)) > 0, timeout=20), running(b, c)
    on_b = active(b)
    b.proc.send_signal(signal.SIGKILL)  # a crash: no drain
    for t in threads:
        t.join(60)
    failed = [o for o in outs if o.error is not None]
    assert len(failed) == on_b, ([o.error for o in outs], on_b)  # exactly the killed server's streams
    assert all(o.error.strip() for o in failed), [o.error for o in failed]  # and they say so
    assert all(o.finish_reason == "length" for o in outs if o.error is None)
    assert metric(c, "voxbackend_requests_finished_total", model="orpheus") - finished_on_c == len(outs) - on_b
    print("errors the killed server's streams got:", sorted({o.error.splitlines()[0][:160] for o in failed}))
