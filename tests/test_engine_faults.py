"""Bad input, cancellation, failures and the KV pool invariant: every page comes back."""
import random

import pytest

from voxbackend.config import EngineConfig
from voxbackend.engine.engine import Engine
from voxbackend.errors import EngineOverloaded, InvalidRequest
from voxbackend.events import EventKind
from voxbackend.sampling_params import SamplingParams
from tests.fake_codec import FakeCodecLM
from tests.util_llama import write_tiny_llama


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    write_tiny_llama(path, seed=5, max_pos=128)
    return path


class Recorder:
    def __init__(self):
        self.events = {}

    def __call__(self, e):
        self.events.setdefault(e.request_id, []).append(e)

    def final(self, rid):
        evs = self.events.get(rid, [])
        return evs[-1] if evs and evs[-1].final else None


def _engine(llama_dir, **kw) -> Engine:
    return Engine(FakeCodecLM(llama_dir), EngineConfig(page_size=4, **kw))


def test_windows_decoded_in_order_with_state_carried(llama_dir):
    engine = _engine(llama_dir, max_batch=3, kv_pages=100, detok_batch=3)
    rec = Recorder()
    sp = SamplingParams(temperature=1.0, max_tokens=9, seed=3)
    ids = [engine.submit([5 + i] * (3 + i), sp, rec) for i in range(4)]
    while any(rec.final(i) is None for i in ids):
        engine.step()
    for rid in ids:
        mine = [(k, state, codes) for r, k, state, codes in engine.model.decoded if r == rid]
        assert [k for k, _, _ in mine] == list(range(5))  # 9 codes -> 4 full windows + the flushed tail
        assert [state for _, state, _ in mine] == list(range(5))
        tokens = rec.final(rid).token_ids
        assert [c for _, _, codes in mine for c in codes] == tokens  # every code decoded once, in order
        audio = [e for e in rec.events[rid] if e.kind is EventKind.AUDIO]
        assert [e.index for e in audio] == list(range(len(audio)))
    assert engine.pool.used_pages == 0


@pytest.mark.parametrize("policy", ["online", "fcfs", "offline"])
def test_non_streaming_requests_finish_under_every_policy(llama_dir, policy):
    engine = _engine(llama_dir, policy=policy, max_batch=2, kv_pages=100, detok_batch=2)
    rec = Recorder()
    sp = SamplingParams(temperature=0.0, max_tokens=7)
    ids = [engine.submit([7, 8, 9], sp, rec, streaming=False) for _ in range(3)]
    ids += [engine.submit([3, 4], sp, rec) for _ in range(2)]
    for _ in range(500):
        engine.step()
    for rid in ids:
        assert rec.final(rid) is not None and rec.final(rid).finish_reason == "length", (policy, rid)


def test_bad_input_is_refused_before_any_work(llama_dir):
    engine = _engine(llama_dir, kv_pages=20, max_queue=2)
    cases = [
        ([], None, "empty"),
        ([1, 2, 10**6], None, "token ids"),
        (["a"], None, "integers"),
        ([1] * 200, None, "context"),
        ([1, 2], SamplingParams(max_tokens=100), "KV pages"),
        ([1, 2], SamplingParams(top_p=3.0), "top_p"),
    ]
    for prompt, sp, match in cases:
        with pytest.raises(InvalidRequest, match=match):
            engine.submit(prompt, sp)
    engine.submit([1], SamplingParams(max_tokens=2))
    engine.submit([1], SamplingParams(max_tokens=2))
    with pytest.raises(EngineOverloaded, match="overloaded"):
        engine.submit([1], SamplingParams(max_tokens=2))
    assert engine.stats().queued == 2


def test_requests_wait_for_pages_instead_of_failing(llama_dir):
    engine = _engine(llama_dir, kv_pages=6, max_batch=8)  # room for one 20-token request at full length
    rec = Recorder()
    ids = [engine.submit([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=16), rec) for _ in range(3)]
    engine.step()
    # pages grow with the sequence: all three start (a page each); when the pool runs dry one is preempted
    assert engine.stats().running == 3 and engine.stats().queued == 0 and engine.stats().kv_pages_used == 3
    while any(rec.final(i) is None for i in ids):
        engine.step()
        assert engine.pool.used_pages <= 6
    assert all(rec.final(i).kind is EventKind.FINISHED for i in ids)
    assert engine.stats().preemptions > 0
    assert len({tuple(rec.final(i).token_ids) for i in ids}) == 1  # same prompt, greedy: resumed output unchanged
    assert engine.pool.used_pages == 0


def test_random_admissions_cancellations_and_failures_leave_every_page_free(llama_dir):
    """KV pages and repetition-penalty slots all come back, through admissions, cancellations and failures."""
    engine = _engine(llama_dir, kv_pages=40, max_batch=4, detok_batch=3, max_queue=1000)
    rng = random.Random(0)
    rec = Recorder()
    forward = engine.model.forward

    def flaky_forward(*args):
        if rng.random() < 0.05:
            raise RuntimeError("injected device failure")
        return forward(*args)

    engine.model.forward = flaky_forward
    penalties = engine.runner.penalties
    ids = []
    for _ in range(300):
        action = rng.random()
        if action < 0.25:
            prompt = [rng.randrange(3, 500) for _ in range(rng.randrange(1, 30))]
            sp = SamplingParams(temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randrange(1, 40),
                                seed=rng.randrange(99), repetition_penalty=rng.choice([1.0, 1.3]))
            ids.append(engine.submit(prompt, sp, rec))
        elif action < 0.35 and ids:
            engine.cancel(rng.choice(ids))
        else:
            engine.step()
        assert engine.pool.used_pages == sum(len(r.lm.pages) for r in engine.running)
        held = [r.penalty.slot for r in engine.running if r.penalty.slot is not None]
        assert len(set(held)) == len(held) and not set(held) & set(penalties.free)
    engine.model.forward = forward
    while any(rec.final(i) is None for i in ids):
        engine.step()
    assert engine.alive
    kinds = {rec.final(i).kind for i in ids}
    reasons = {rec.final(i).finish_reason for i in ids}
    assert EventKind.ERROR in kinds and {"cancelled", "length"} <= reasons
    for rid in ids:  # exactly one final event per request, and it is the last
        assert sum(e.final for e in rec.events[rid]) == 1
    assert engine.pool.used_pages == 0 and engine.pool.holders() == []
    assert len(penalties.table) and sorted(penalties.free) == list(range(len(penalties.table)))  # no slot leaked


def test_cancel_mid_stream_stops_generation_and_frees_pages(llama_dir):
    engine = _engine(llama_dir, kv_pages=40)
    rec = Recorder()
    rid = engine.submit([5, 6], SamplingParams(max_tokens=60, seed=1), rec)
    other = engine.submit([7, 8], SamplingParams(max_tokens=20, seed=2), rec)
    for _ in range(5):
        engine.step()
    engine.cancel(rid)
    engine.step()
    assert rec.final(rid).finish_reason == "cancelled"
    assert len(rec.final(rid).token_ids) < 10
    while rec.final(other) is None:
        engine.step()
    assert rec.final(other).finish_reason == "length" and engine.pool.used_pages == 0


def test_repeated_failures_mark_the_engine_dead_and_fail_everything(llama_dir):
    engine = _engine(llama_dir, kv_pages=40)
    rec = Recorder()

    def broken(*args):
        raise RuntimeError("device lost")

    engine.model.forward = broken
    ids = [engine.submit([5, 6], SamplingParams(max_tokens=5), rec) for _ in range(4)]
    for _ in range(10):
        engine.step()
        ids += [engine.submit([5], SamplingParams(max_tokens=5), rec)] if engine.alive else []
    assert not engine.alive
    assert all(rec.final(i).kind is EventKind.ERROR for i in ids)
    assert engine.pool.used_pages == 0
    with pytest.raises(Exception, match="engine stopped"):
        engine.submit([5], SamplingParams(max_tokens=5), rec)


def test_first_chunk_is_held_until_long_enough(llama_dir):
    for hold_s, first_len in ((0.0, 20), (0.55, 60)):  # the fake codec makes 0.2 s per 2-frame window
        engine = _engine(llama_dir, kv_pages=40, first_chunk_s=hold_s)
        rec = Recorder()
        rid = engine.submit([5, 6], SamplingParams(temperature=0, max_tokens=12), rec)
        while rec.final(rid) is None:
            engine.step()
        chunks = [e.audio for e in rec.events[rid] if e.kind is EventKind.AUDIO]
        assert len(chunks[0]) == first_len and sum(map(len, chunks)) == 120
