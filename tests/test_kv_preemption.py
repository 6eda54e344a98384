"""KV pages that grow with the sequence, streaming-aware preemption, and the server-side max_tokens cap.

Most tests use a tiny Llama with a fake stateful codec (tests/fake_codec.py) and a fake clock; the output
equality tests also run the real tiny Orpheus and CSM models.
"""
import random

import numpy as np
import pytest

import voxbackend
from voxbackend.config import EngineConfig
from voxbackend.engine.engine import Engine
from voxbackend.engine.admission import preemption_victim
from voxbackend.engine.policies import make_policy
from voxbackend.errors import InvalidRequest
from voxbackend.events import EventKind
from voxbackend.request import Request
from voxbackend.sampling_params import SamplingParams
from voxbackend.triton.metrics import TritonMetrics
from tests.fake_codec import FakeCodecLM
from tests.util_llama import write_tiny_llama


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    write_tiny_llama(path, seed=5, max_pos=256)
    return path


class FakeClock:
    def __init__(self, step_s: float = 0.01):
        self.now, self.step_s = 0.0, step_s

    def __call__(self) -> float:
        return self.now


class Recorder:
    def __init__(self):
        self.events: dict[str, list] = {}
        self.first_audio_at: dict[str, int] = {}  # engine step of the first audio event
        self.step = 0

    def __call__(self, e):
        self.events.setdefault(e.request_id, []).append(e)
        if e.kind is EventKind.AUDIO:
            self.first_audio_at.setdefault(e.request_id, self.step)

    def final(self, rid):
        evs = self.events.get(rid, [])
        return evs[-1] if evs and evs[-1].final else None

    def audio(self, rid) -> np.ndarray:
        chunks = [e.audio for e in self.events[rid] if e.kind is EventKind.AUDIO]
        return np.concatenate(chunks) if chunks else np.zeros(0, np.float32)


def _engine(llama_dir, clock=None, **kw) -> Engine:
    return Engine(FakeCodecLM(llama_dir), EngineConfig(page_size=4, **kw), clock=clock or FakeClock())


def _drive(engine: Engine, rec: Recorder, ids: list[str], clock: FakeClock | None = None, limit: int = 5000) -> None:
    for _ in range(limit):
        if all(rec.final(i) is not None for i in ids):
            return
        engine.step()
        rec.step += 1
        if clock is not None:
            clock.now += clock.step_s
        _check_pages(engine)
    raise AssertionError("requests did not finish")


def _check_pages(engine: Engine) -> None:
    """Pages held are exactly the running requests' page tables, disjoint; preempted requests hold none."""
    held = [p for r in engine.running for p in r.lm.pages]
    assert len(held) == len(set(held)) == engine.pool.used_pages <= engine.pool.num_pages
    assert all(not r.lm.pages for r in engine.running if r.lm.preempted or r.lm_done)
    assert all(not r.lm.pages for r in engine.waiting)


def _pool_is_whole(engine: Engine) -> bool:
    return sorted(engine.pool._free) == list(range(engine.pool.num_pages)) and engine.pool.holders() == []


# ---------------------------------------------------------------- the scheduler's choices, on a fake clock
def _req(rid, arrival, *, streaming=True, playing_since=None, audio_s=0.0):
    r = Request(rid, [1, 2, 3], SamplingParams(seed=1), lambda e: None, arrival, streaming=streaming)
    if playing_since is not None:
        r.playback.record_chunk(playing_since, audio_s)  # all its audio so far, as one chunk
        r.playback.last_chunk_s = 0.2
    return r


def test_victim_is_a_batch_job_first_then_the_stream_with_most_buffered_audio():
    now = 100.0
    rich = _req("rich", 0, playing_since=90.0, audio_s=30.0)  # 20 s buffered
    poor = _req("poor", 1, playing_since=90.0, audio_s=10.5)  # 0.5 s buffered
    new = _req("new", 2)  # waiting for its first audio
    batch_old, batch_new = _req("b0", 3, streaming=False), _req("b1", 4, streaming=False)
    assert preemption_victim([rich, poor, new, batch_old, batch_new], now).id == "b1"  # latest batch job
    assert preemption_victim([rich, poor, new], now).id == "rich"
    assert preemption_victim([poor, new], now).id == "poor"
    # the clock moves on 25 s: rich's listener has -5 s left (stalling), a stream started at 120 s has 5 s
    late = _req("late", 5, playing_since=120.0, audio_s=10.0)
    assert preemption_victim([rich, poor, late], 125.0).id == "late"


def test_admission_order_puts_waiting_listeners_first_under_online_only():
    now = 100.0
    batch = _req("batch", 0, streaming=False)
    paused_rich = _req("paused_rich", 1, playing_since=90.0, audio_s=30.0)  # preempted, 20 s left
    paused_dry = _req("paused_dry", 2, playing_since=90.0, audio_s=10.1)  # preempted, about to run dry
    new = _req("new", 3)
    waiting = [new, paused_rich, batch, paused_dry]
    online = make_policy(EngineConfig(policy="online"))
    assert [r.id for r in online.admission_order(waiting, now)] == ["paused_dry", "new", "batch", "paused_rich"]
    fcfs = make_policy(EngineConfig(policy="fcfs"))
    assert [r.id for r in fcfs.admission_order(waiting, now)] == ["batch", "paused_rich", "paused_dry", "new"]


# ---------------------------------------------------------------- the max_tokens cap
def test_max_tokens_above_the_models_official_limit_is_refused_naming_it(llama_dir, tiny_orpheus, tiny_csm):
    engine = _engine(llama_dir, kv_pages=200, max_tokens_limit=50)
    with pytest.raises(InvalidRequest, match=r"max_tokens is 51; .* at most 50") as err:
        engine.submit([1, 2], SamplingParams(max_tokens=51))
    assert err.value.field == "max_tokens"
    engine.submit([1, 2], SamplingParams(max_tokens=50))  # at the limit: accepted

    token_lm = voxbackend.load(llama_dir, kv_pages=200, page_size=4)  # token-only: its context (256)
    assert token_lm.max_tokens_limit == 256
    with pytest.raises(InvalidRequest, match="at most 256") as err:
        token_lm.submit([1, 2], SamplingParams(max_tokens=10**9))
    assert err.value.field == "max_tokens"

    orpheus = voxbackend.load(*tiny_orpheus, kv_pages=8)
    csm = voxbackend.load(tiny_csm, kv_pages=8)
    for eng, limit in ((orpheus, 1200), (csm, 1125)):
        assert eng.max_tokens_limit == limit == eng.model.default_sampling().max_tokens
        prompt = eng.model.prepare("Hello there.")
        with pytest.raises(InvalidRequest, match=f"at most {limit} for {eng.model.spec.name}") as err:
            eng.submit(prompt, SamplingParams(max_tokens=limit + 1))
        assert err.value.field == "max_tokens"
        # within the cap but more than the pool can ever hold for one request: refused too, never queued
        with pytest.raises(InvalidRequest, match="KV pages") as err:
            eng.submit(prompt, SamplingParams(max_tokens=limit))
        assert err.value.field == "max_tokens" and eng.stats().queued == 0


def test_prompt_plus_max_tokens_beyond_the_context_ends_with_length_at_the_context(llama_dir):
    engine = _engine(llama_dir, kv_pages=64)  # the fake codec model has no stop token; context 256
    rec = Recorder()
    rid = engine.submit(list(range(3, 203)), SamplingParams(temperature=0, max_tokens=100), rec)
    _drive(engine, rec, [rid])
    assert rec.final(rid).finish_reason == "length" and len(rec.final(rid).token_ids) == 56
    assert _pool_is_whole(engine)


# ---------------------------------------------------------------- the hog scenario
HOG_CAP = 100


def _normal_ttfa_steps(llama_dir, hogs: int, when: str, kv_pages: int = 40) -> tuple[int, Engine]:
    """Engine steps from the normal request's submission to its first audio, with `hogs` requests at the cap
    started at step 0; the normal one comes at once ("start") or once it cannot get a page without a
    preemption ("full")."""
    clock = FakeClock(step_s=0.01)  # 0.1 s of audio per LM step: every stream runs ahead of its listener
    engine = _engine(llama_dir, clock, kv_pages=kv_pages, max_tokens_limit=HOG_CAP, max_batch=8)
    rec = Recorder()
    hog_sp = SamplingParams(temperature=0.8, max_tokens=HOG_CAP, seed=3)
    ids = [engine.submit([5 + i, 6, 7, 8], hog_sp, rec) for i in range(hogs)]
    def room() -> bool:  # a page for the normal prompt plus the headroom of one page per request on the LM
        return engine.pool.free_pages >= 1 + sum(r.on_lm for r in engine.running)

    while when == "full" and room():
        assert rec.step < 500
        engine.step()
        rec.step += 1
        clock.now += clock.step_s
    submitted = rec.step
    normal = engine.submit([9, 10, 11], SamplingParams(temperature=0.8, max_tokens=20, seed=4), rec)
    _drive(engine, rec, ids + [normal], clock)
    assert all(rec.final(i).finish_reason == "length" for i in ids + [normal])  # nothing dropped
    assert len(rec.final(normal).token_ids) == 20 and _pool_is_whole(engine)
    return rec.first_audio_at[normal] - submitted + 1, engine  # steps run, the one that sent audio included


@pytest.mark.parametrize("when", ["start", "full"])
def test_two_hogs_at_the_cap_do_not_delay_a_normal_request(llama_dir, when):
    # each hog needs 26 pages at full length; the pool has 40: they cannot both finish without a preemption
    alone, _ = _normal_ttfa_steps(llama_dir, hogs=0, when="start")
    with_hogs, engine = _normal_ttfa_steps(llama_dir, hogs=2, when=when)
    assert with_hogs == alone == 2  # prefill + one decode -> the first 2-frame window, decoded in that step
    assert engine.stats().preemptions >= 1


# ---------------------------------------------------------------- randomized: every page comes back
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_growth_preemption_resume_cancel_and_errors_free_every_page(llama_dir, seed):
    rng = random.Random(seed)
    clock = FakeClock()
    policy = ["online", "fcfs", "offline"][seed]
    engine = _engine(llama_dir, clock, kv_pages=24, max_batch=4, detok_batch=3, prefill_budget=16,
                     max_queue=1000, max_tokens_limit=60, policy=policy)
    rec = Recorder()
    forward = engine.model.forward
    failing = {"on": True}

    def flaky_forward(*args):
        if failing["on"] and rng.random() < 0.04:
            raise RuntimeError("injected device failure")
        return forward(*args)

    engine.model.forward = flaky_forward
    jobs: dict[str, tuple[list[int], SamplingParams, bool]] = {}
    requests: dict[str, Request] = {}
    for _ in range(400):
        action = rng.random()
        if action < 0.2:
            prompt = [rng.randrange(3, 500) for _ in range(rng.randrange(1, 37))]  # 36 + 60 fill the pool
            sp = SamplingParams(temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randrange(1, 61),
                                repetition_penalty=rng.choice([1.0, 1.3]), seed=rng.randrange(99))
            streaming = rng.random() < 0.7
            rid = engine.submit(prompt, sp, rec, streaming=streaming)
            jobs[rid] = (prompt, sp, streaming)
        elif action < 0.27 and jobs:
            engine.cancel(rng.choice(list(jobs)))
        else:
            engine.step()
            clock.now += rng.choice([0.0, 0.01, 0.3])
        requests.update({r.id: r for r in engine.running})
        _check_pages(engine)
    failing["on"] = False
    _drive(engine, rec, list(jobs), clock)
    assert engine.alive and _pool_is_whole(engine) and not engine.running and not engine.waiting
    for rid in jobs:  # exactly one final event per request, and it is the last
        assert sum(e.final for e in rec.events[rid]) == 1 and rec.events[rid][-1].final
    finals = {rid: rec.final(rid) for rid in jobs}
    assert {EventKind.ERROR, EventKind.FINISHED} <= {f.kind for f in finals.values()}
    assert {"cancelled", "length"} <= {f.finish_reason for f in finals.values()}
    resumed = [rid for rid, r in requests.items() if r.lm.preemptions and finals[rid].finish_reason == "length"]
    assert engine.stats().preemptions >= 5 and resumed
    # a preempted-and-resumed request's tokens and audio equal its run alone (seeded sampling included)
    alone = _engine(llama_dir, kv_pages=24, prefill_budget=16, max_tokens_limit=60)
    for rid in resumed:
        prompt, sp, streaming = jobs[rid]
        rec1 = Recorder()
        rid1 = alone.submit(prompt, sp, rec1, streaming=streaming)
        _drive(alone, rec1, [rid1])
        assert finals[rid].token_ids == rec1.final(rid1).token_ids
        assert np.array_equal(rec.audio(rid), rec1.audio(rid1))


# ---------------------------------------------------------------- resumed output equals alone, real models
def _run(engine: Engine, jobs, *, streaming=True) -> tuple[list, Recorder]:
    rec = Recorder()
    ids = [engine.submit(prompt, sp, rec, streaming=streaming) for prompt, sp in jobs]
    requests = {}
    for _ in range(5000):
        if all(rec.final(i) is not None for i in ids):
            break
        engine.step()
        requests.update({r.id: r for r in engine.running})
        _check_pages(engine)
    assert all(rec.final(i).kind is EventKind.FINISHED for i in ids)
    assert _pool_is_whole(engine)
    return [(rec.final(i).token_ids, rec.audio(i), requests[i].lm.preemptions) for i in ids], rec


def test_token_lm_greedy_output_survives_preemption(llama_dir):
    # 4 prompts x (prompt + 40) tokens need 12-16 pages each at full length; the pool has 20
    prompts = [[3 + i, 40, 41, 42, 43][: 2 + i] * (3 + i) for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=40)
    squeezed = voxbackend.load(llama_dir, kv_pages=20, page_size=4, max_batch=4, prefill_budget=8)
    got, _ = _run(squeezed, [(p, greedy) for p in prompts], streaming=False)
    roomy = voxbackend.load(llama_dir, kv_pages=200, page_size=4, max_batch=1)
    assert any(n for _, _, n in got) and squeezed.stats().preemptions > 0
    for p, (tokens, _, _) in zip(prompts, got):
        [(want, _, n)], _ = _run(roomy, [(p, greedy)], streaming=False)
        assert tokens == want and n == 0


def test_orpheus_tokens_and_audio_survive_preemption(tiny_orpheus):
    # about 12 prompt tokens + 42 steps = 4 pages each at full length; the pool has 7
    squeezed = voxbackend.load(*tiny_orpheus, kv_pages=7, page_size=16, max_batch=4)
    texts = ["First sentence.", "A second one.", "And the third."]
    params = [SamplingParams(temperature=0.0, max_tokens=42, seed=1),
              SamplingParams(temperature=0.0, max_tokens=42, seed=2),
              SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3, max_tokens=35, seed=3)]
    jobs = [(squeezed.model.prepare(t), sp) for t, sp in zip(texts, params)]
    got, _ = _run(squeezed, jobs)
    assert squeezed.stats().preemptions > 0 and any(n for _, _, n in got)
    alone = voxbackend.load(*tiny_orpheus, kv_pages=64, page_size=16, max_batch=1)
    for job, (tokens, audio, _) in zip(jobs, got):
        [(want_tokens, want_audio, _)], _ = _run(alone, [job])
        assert tokens == want_tokens
        assert audio.shape == want_audio.shape and len(audio) and np.abs(audio - want_audio).max() <= 1e-4


def test_csm_frames_and_audio_survive_preemption(tiny_csm):
    squeezed = voxbackend.load(tiny_csm, kv_pages=10, page_size=4, max_batch=3)
    texts = ["Hello there.", "Good night, see you.", "Numbers: one, two."]
    params = [SamplingParams(temperature=0.0, max_tokens=10, seed=5),
              SamplingParams(temperature=0.0, max_tokens=9, seed=6),
              SamplingParams(temperature=0.9, top_k=50, max_tokens=8, seed=7)]
    jobs = [(squeezed.model.prepare(t, i), sp) for i, (t, sp) in enumerate(zip(texts, params))]
    # 9-14 prompt rows: each fits alone (<= 6 pages), the first two together outgrow the pool
    got, _ = _run(squeezed, jobs)
    assert squeezed.stats().preemptions > 0 and any(n for _, _, n in got)
    alone = voxbackend.load(tiny_csm, kv_pages=64, page_size=4, max_batch=1)
    for job, (frames, audio, _) in zip(jobs, got):
        [(want_frames, want_audio, _)], _ = _run(alone, [job])
        assert frames == want_frames  # rows of 33 columns: multi-column steps recomputed on resume
        assert audio.shape == want_audio.shape and len(audio) and np.abs(audio - want_audio).max() <= 1e-4


# ---------------------------------------------------------------- the Prometheus counter
class _FakeMetricFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

    def __init__(self, name, description, kind):
        self.name, self.metrics = name, []

    def Metric(self, labels, buckets=None):  # noqa: N802 - pb_utils' spelling
        m = _FakeMetric(labels)
        self.metrics.append(m)
        return m


class _FakeMetric:
    def __init__(self, labels):
        self.labels, self.value = labels, 0

    def increment(self, n):
        self.value += n

    def set(self, v):
        self.value = v

    def observe(self, v):
        pass


def test_preemption_counter_follows_the_engines_cumulative_count(llama_dir):
    from types import SimpleNamespace

    from voxbackend.triton.streams import ResponseLoop

    metrics = TritonMetrics(SimpleNamespace(MetricFamily=_FakeMetricFamily), "orpheus", "0")
    [family] = [f for f in metrics.families if f.name == "voxbackend_preemptions_total"]
    engine = _engine(llama_dir, kv_pages=6, max_batch=8)
    loop = ResponseLoop(engine, metrics)
    rec = Recorder()
    ids = [engine.submit([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=16), rec) for _ in range(3)]
    _drive(engine, rec, ids)
    loop._update_gauges()
    loop._update_gauges()  # a second reading adds nothing new
    assert family.metrics[0].value == engine.stats().preemptions > 0
    assert family.metrics[0].labels == {"model": "orpheus", "instance": "0"}
