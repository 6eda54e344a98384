"""Faults on a real tritonserver: a full queue and a dead engine, with the weights-free fake engine.

The fake (voxbackend.testing.fake_engine) is selected through the same config parameters a deployment uses
(engine_loader / frontend_loader), so everything between the client and the engine API is the real thing.
The engine-death test runs last: it leaves the model without an engine.
"""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from voxbackend.stream_client import StreamOutcome, make_inputs, stream_request  # noqa: E402
from voxbackend.deploy import configs  # noqa: E402
from tests.triton_util import metric, run_concurrently, serve  # noqa: E402


FAKE = {
    "checkpoint": "unused",  # the fake ignores it; a non-empty value skips building the default checkpoint
    "engine_loader": "voxbackend.testing.fake_engine:load",
    "frontend_loader": "voxbackend.testing.fake_engine:load_frontend",
    # pages grow with each sequence, as in the real engine: two requests of 560 prompt ids (35 pages each) and
    # 20 chunks (140 positions more: 44 pages each at the end) fit together; a third waits (its 35 pages and one
    # free page per running request are more than the 30 left), and nobody is preempted
    "kv_pages": "100",
    "max_queue": "2",  # and beyond two waiting ones, requests are refused
}
FILLER = "x" * 541  # "request number 00 " + this: 559 characters, 560 prompt ids in the fake (voice id first)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = configs.write_repository(tmp_path_factory.mktemp("repo") / "model_repository", FAKE, models=["orpheus"])
    # clean even after the engine-death test (an ensemble used to keep its failed streams in flight)
    yield from serve(repo, tmp_path_factory.mktemp("triton"))


@pytest.mark.parametrize("model", ["orpheus_engine", "orpheus"])
def test_more_requests_than_the_pool_holds_queue_then_get_overloaded(server, model):
    outs = run_concurrently([
        lambda i=i: stream_request(server.grpc_url, model,
                                   make_inputs(f"request number {i:02d} {FILLER}", MAX_TOKENS=140), "pcm16",
                                   timeout=60, linger_s=0.2)
        for i in range(8)
    ], stagger_s=0.02, timeout=120)  # arrive in order, so the first ones take the pages
    done = [o for o in outs if o.error is None]
    refused = [o for o in outs if o.error is not None]
    assert len(done) >= 4, "two running plus two queued must be served"  # the queue is a wait, not a refusal
    assert refused, "past max_queue, requests must be refused"
    for o in refused:
        assert "EngineOverloaded" in o.error and "overloaded" in o.error and o.responses == 1, o.error
    for o in done:
        assert o.finish_reason == "length" and len(o.chunks) == 140 // 7  # the fake: one chunk per 7 tokens
    assert all(o.late_responses == 0 for o in outs)
    deadline = time.monotonic() + 10
    while metric(server, "voxbackend_kv_pages_used") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(server, "voxbackend_kv_pages_used") == 0
    assert metric(server, "voxbackend_preemptions_total") == 0  # the pool was sized so that nobody is


def test_an_engine_failure_ends_every_stream_with_an_error_and_refuses_new_ones(server):
    """Both engines (the front model's own and orpheus_engine's), each with a stream running when it dies."""
    assert metric(server, "voxbackend_engine_alive") == 2
    victims: list[StreamOutcome] = []
    models = ("orpheus", "orpheus_engine")

    def victim(model):
        victims.append(stream_request(server.grpc_url, model,
                                      make_inputs(f"a long stream on {model}. " * 5, MAX_TOKENS=600), timeout=60))

    threads = [threading.Thread(target=victim, args=(model,)) for model in models]
    for t in threads:
        t.start()
    time.sleep(0.5)
    # small enough to be admitted next to the victim (43 KV pages each at most, of 100)
    killers = [stream_request(server.grpc_url, model, make_inputs("__die__ please", MAX_TOKENS=7), timeout=30)
               for model in models]
    for t in threads:
        t.join(60)
    for killer in killers:
        assert killer.error and "engine stopped" in killer.error, killer.error
    assert len(victims) == 2
    for v in victims:  # they had audio, then one error; nothing hangs
        assert v.chunks and v.error and "engine stopped" in v.error, v.error
    for model in ("orpheus", "orpheus_engine"):
        after = stream_request(server.grpc_url, model, make_inputs("hello again"), timeout=30)
        assert after.error and "EngineDead" in after.error, after.error
    deadline = time.monotonic() + 5
    while metric(server, "voxbackend_engine_alive") != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(server, "voxbackend_engine_alive") == 0
