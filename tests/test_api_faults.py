"""The speech API when the engine is overloaded or dies: 429 and 503 in OpenAI's shape, on a real tritonserver
with the weights-free fake engine (selected by config parameters, as in tests/test_triton_faults.py).

Death runs last: it leaves the model without an engine.
"""
from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import openai  # noqa: E402
from websockets.sync.client import connect as ws_connect  # noqa: E402

from voxbackend.stream_client import make_inputs, stream_request  # noqa: E402
from voxbackend.api.server import ApiServer  # noqa: E402
from voxbackend.deploy import configs  # noqa: E402
from tests.triton_util import serve  # noqa: E402
from tests.util_http import get_json, http_status  # noqa: E402

FAKE = {
    "checkpoint": "unused",  # the fake ignores it; a non-empty value skips building the default checkpoint
    "engine_loader": "voxbackend.testing.fake_engine:load",
    "frontend_loader": "voxbackend.testing.fake_engine:load_frontend",
    # pages grow with each sequence, as in the real engine: two requests of 560 prompt ids (35 pages each, 44 at
    # the end of their 20 chunks) fit together; the next ones wait (as in tests/test_triton_faults.py)
    "kv_pages": "100",
    "max_queue": "2",  # and beyond two waiting ones, requests are refused
}
FILLER = "x" * 541  # "request number 00 " + this: 559 characters, 560 prompt ids in the fake (voice id first)


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    repo = configs.write_repository(tmp_path_factory.mktemp("repo") / "model_repository", FAKE, models=["orpheus"])
    # clean even after the engine-death test (an ensemble used to keep its failed streams in flight)
    yield from serve(repo, tmp_path_factory.mktemp("triton"))


@pytest.fixture(scope="module")
def api(triton):
    with ApiServer(triton.grpc_url, triton.metrics_url, prefetch_voices=False).start(120) as server:
        yield server


@pytest.fixture(scope="module")
def client(api):
    return openai.OpenAI(base_url=api.url + "/v1", api_key="not-needed", max_retries=0, timeout=60)


def test_past_the_queue_requests_get_429(api, client):
    outcomes: list = [None] * 8

    def one(i: int) -> None:
        try:
            outcomes[i] = client.audio.speech.create(
                model="orpheus", voice="tara", input=f"request number {i:02d} {FILLER}", response_format="pcm",
                extra_body={"max_tokens": 140}).content
        except openai.APIStatusError as e:
            outcomes[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
        time.sleep(0.02)  # arrive in order, so the first ones take the pages
    for t in threads:
        t.join(120)
    served = [o for o in outcomes if isinstance(o, bytes)]
    refused = [o for o in outcomes if isinstance(o, openai.APIStatusError)]
    assert len(served) >= 4, outcomes  # two running plus two queued: the queue is a wait, not a refusal
    assert refused and all(isinstance(e, openai.RateLimitError) for e in refused), refused
    for e in refused:
        assert e.status_code == 429 and e.code == "engine_overloaded" and "overloaded" in e.message
    assert all(len(o) > 0 for o in served)


def test_an_engine_death_is_503_and_health_says_so(triton, api, client):
    assert http_status(api.url + "/health") == 200
    deadline = time.monotonic() + 20
    while _stats(api)["active_streams"] or _stats(api)["queued_requests"]:  # the last test's streams have ended
        assert time.monotonic() < deadline, _stats(api)
        time.sleep(0.2)
    socket_messages: list[dict] = []
    http_outcome: list = []
    # the fake speaks one chunk per prompt character (20 ms each): 80 characters keep both victims talking
    # while the killer goes in, and 80 + 640 positions (45 KV pages each) leave it room to be admitted
    text = "one long sentence without a stop, " * 2 + "still going on and"
    started = [threading.Event(), threading.Event()]

    def socket_victim() -> None:
        with ws_connect(api.url.replace("http", "ws") + "/v1/audio/speech/stream", open_timeout=30) as ws:
            ws.send(json.dumps({"type": "start", "model": "orpheus", "max_tokens": 640}))
            ws.send(json.dumps({"type": "text", "text": text}))
            ws.send(json.dumps({"type": "end"}))
            while True:
                try:
                    message = ws.recv(timeout=60)
                except Exception:
                    return
                if isinstance(message, str):
                    socket_messages.append(json.loads(message))
                else:
                    started[0].set()

    def http_victim() -> None:
        try:
            with client.audio.speech.with_streaming_response.create(
                    model="orpheus", voice="tara", input=text, response_format="pcm",
                    extra_body={"max_tokens": 640}) as response:
                received = 0
                for piece in response.iter_bytes():
                    received += len(piece)
                    started[1].set()
                http_outcome.append(received)
        except Exception as e:  # the body is cut: the status had already gone out
            http_outcome.append(e)

    victims = [threading.Thread(target=socket_victim), threading.Thread(target=http_victim)]
    for t in victims:
        t.start()
    assert all(event.wait(30) for event in started), "the victims never got audio"
    killer = stream_request(triton.grpc_url, "orpheus", make_inputs("__die__ please", MAX_TOKENS=7), timeout=30)
    assert killer.error and "engine stopped" in killer.error
    for t in victims:
        t.join(60)
    errors = [m for m in socket_messages if m["type"] == "error"]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "engine_error", socket_messages
    assert len(http_outcome) == 1 and isinstance(http_outcome[0], Exception), http_outcome  # not a clean end

    with pytest.raises(openai.InternalServerError) as e:
        client.audio.speech.create(model="orpheus", voice="tara", input="hello again")
    assert e.value.status_code == 503 and e.value.code == "engine_dead"
    deadline = time.monotonic() + 10
    while http_status(api.url + "/health") != 503:
        assert time.monotonic() < deadline, "/health still says ok after the engine died"
        time.sleep(0.2)
    with pytest.raises(urllib.error.HTTPError) as health:
        urllib.request.urlopen(api.url + "/health", timeout=5)
    body = json.load(health.value)
    assert body["status"] == "unavailable" and body["triton"] == "ready"  # Triton's readiness stays green
    assert body["engines"] == {"orpheus": {"alive": False}}


def _stats(api) -> dict:
    return get_json(api.url + "/v1/stats")["models"]["orpheus"]


