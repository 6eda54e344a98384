"""The fake engine (voxbackend.testing.fake_engine) against the real Engine on the tiny Orpheus: the Triton glue
tests run on the fake, so every behaviour the glue relies on is checked here on both, by the same code: the
methods and their parameters, the refusals and their messages, the stats, and the events of a stream."""
import inspect
import re
import threading

import pytest

import voxbackend
from voxbackend.engine.engine import Engine, EngineStats
from voxbackend.errors import EngineOverloaded, InvalidRequest
from voxbackend.events import EventKind
from voxbackend.sampling_params import SamplingParams
from voxbackend.testing.fake_engine import FakeEngine

POOL = {"kv_pages": 8, "page_size": 16, "max_queue": 2}


@pytest.fixture(params=["real", "fake"])
def engine(request, tiny_orpheus):
    engine = voxbackend.load(*tiny_orpheus, **POOL) if request.param == "real" else FakeEngine(**POOL, step_s=0.002)
    yield engine
    engine.shutdown()


def test_the_fake_has_the_methods_the_glue_calls_with_the_engines_parameters():
    for name in ("submit", "cancel", "append_text", "stats", "start", "shutdown", "synthesize"):
        real = list(inspect.signature(getattr(Engine, name)).parameters.values())
        fake = list(inspect.signature(getattr(FakeEngine, name)).parameters.values())
        shape = [(p.name, p.kind, p.default) for p in fake]
        assert shape == [(p.name, p.kind, p.default) for p in real[:len(fake)]], name
        assert all(p.kind is p.VAR_KEYWORD for p in real[len(fake):]), name  # only model options beyond


def test_refusals_are_the_same_errors_with_the_same_messages(engine):
    prompt = engine.model.prepare("hello")
    with pytest.raises(InvalidRequest) as e:
        engine.submit(prompt, SamplingParams(max_tokens=1200))
    assert e.value.field == "max_tokens"
    assert re.fullmatch(r"prompt \(\d+ tokens\) \+ max_tokens \(1200\) needs \d+ KV pages; the pool has 8",
                        str(e.value)), str(e.value)
    with pytest.raises(InvalidRequest) as e:
        engine.submit(prompt, text_open=True)
    assert e.value.field == "text" and str(e.value).endswith(" does not take text in pieces (text_open)")
    with pytest.raises(InvalidRequest, match="^prompt is empty$"):
        engine.submit([])
    with pytest.raises(InvalidRequest, match="top_p"):
        engine.submit(prompt, SamplingParams(top_p=3.0))

    short = SamplingParams(max_tokens=70)
    engine.submit(prompt, short)
    engine.submit(prompt, short)
    with pytest.raises(EngineOverloaded, match="^overloaded: 2 requests already queued; retry later$"):
        engine.submit(prompt, short)
    assert engine.stats() == EngineStats(running=0, queued=2, kv_pages_used=0, kv_pages_total=8, preemptions=0)


def test_a_stream_and_a_cancelled_queued_request_end_as_the_glue_expects(engine):
    events: dict[str, list] = {}
    finals = threading.Semaphore(0)

    def record(e) -> None:
        events.setdefault(e.request_id, []).append(e)
        if e.final:
            finals.release()

    prompt = engine.model.prepare("hello there")
    # min_tokens: the real model's random weights could sample the end of speech early
    played = engine.submit(prompt, SamplingParams(max_tokens=70, min_tokens=70, seed=3), record)
    cancelled = engine.submit(prompt, SamplingParams(max_tokens=70, seed=3), record)
    engine.cancel(cancelled)
    engine.start()
    assert finals.acquire(timeout=60) and finals.acquire(timeout=60)

    [gone] = events[cancelled]
    assert gone.kind is EventKind.FINISHED and gone.final and gone.finish_reason == "cancelled"
    *audio, last = events[played]
    assert audio and all(e.kind is EventKind.AUDIO and not e.final for e in audio)
    assert [e.index for e in audio] == list(range(len(audio)))
    assert last.kind is EventKind.FINISHED and last.final and last.finish_reason == "length"
    assert engine.stats() == EngineStats(running=0, queued=0, kv_pages_used=0, kv_pages_total=8, preemptions=0)
