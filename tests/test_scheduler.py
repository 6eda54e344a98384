"""Scheduling policies on a fake clock."""
import pytest

from voxbackend.config import EngineConfig
from voxbackend.engine.detokenize import window_bounds, window_count
from voxbackend.engine.scheduler import MAX_SKIPPED_STEPS, Scheduler
from voxbackend.models.base import WindowSpec
from voxbackend.request import Request
from voxbackend.sampling_params import SamplingParams


BUSY = EngineConfig().max_batch  # requests on the LM: a full batch, where the online policy holds windows back


def _req(rid: str, arrival: float, *, playing_since=None, audio_s=0.0, prompt=4, cached=4, streaming=True):
    r = Request(rid, list(range(prompt)), SamplingParams(seed=1), lambda e: None, arrival, streaming=streaming)
    r.num_cached = cached
    r.output_ids = [1] if cached >= prompt else []  # decoding: one step sampled, its input not cached yet
    r.input_rows = list(r.output_ids)  # the positions after the prompt: that step's input
    if playing_since is not None:
        r.first_chunk_at, r.audio_sent_s, r.last_chunk_s = playing_since, audio_s, 0.1
    return r


def test_online_gives_lm_slots_to_streams_about_to_stall():
    now = 100.0
    comfy = [_req(f"c{i}", arrival=i, playing_since=90.0, audio_s=30.0) for i in range(3)]  # 20 s buffered
    low = _req("low", arrival=10, playing_since=90.0, audio_s=10.5)  # 0.5 s left: pressing
    new = _req("new", arrival=11)  # nothing played yet: pressing
    sched = Scheduler(EngineConfig(policy="online", max_batch=2))
    chosen = [r.id for r, _ in sched.schedule_lm(comfy + [low, new], now)]
    assert chosen == ["low", "new"]
    fcfs = Scheduler(EngineConfig(policy="fcfs", max_batch=2))
    assert [r.id for r, _ in fcfs.schedule_lm(comfy + [low, new], now)] == ["c0", "c1"]


def test_passed_over_requests_age_into_slots():
    now = 100.0
    comfy = _req("comfy", arrival=0, playing_since=90.0, audio_s=60.0)
    busy = [_req(f"n{i}", arrival=1 + i) for i in range(2)]
    sched = Scheduler(EngineConfig(policy="online", max_batch=2))
    for _ in range(MAX_SKIPPED_STEPS):
        assert "comfy" not in [r.id for r, _ in sched.schedule_lm([comfy, *busy], now)]
    assert "comfy" in [r.id for r, _ in sched.schedule_lm([comfy, *busy], now)]


def test_chunked_prefill_under_token_budget_with_several_prefills():
    sched = Scheduler(EngineConfig(policy="fcfs", max_batch=8, prefill_budget=10))
    a = _req("a", 0, prompt=6, cached=0)
    b = _req("b", 1, prompt=9, cached=0)
    c = _req("c", 2)  # decoding
    plan = [(r.id, n) for r, n in sched.schedule_lm([a, b, c], 0.0)]
    assert plan == [("a", 6), ("b", 4)]  # two prefills share the step; b continues next step


def test_online_holds_windows_back_only_with_the_lm_past_the_defer_fill():
    now = 100.0
    comfy = _req("comfy", 0, playing_since=90.0, audio_s=40.0)  # 30 s buffered: its windows may wait
    sched = Scheduler(EngineConfig(policy="online", detok_batch=4, max_batch=8, detok_defer_fill=0.5))
    assert [(r.id, n) for r, n in sched.schedule_detok([(comfy, 3)], 3, now, False)] == [("comfy", 3)]
    assert sched.schedule_detok([(comfy, 3)], 4, now, False) == []  # 4 of 8 on the LM: held back
    # fill 0: held back whenever the LM has work
    always = Scheduler(EngineConfig(policy="online", detok_batch=4, max_batch=8, detok_defer_fill=0.0))
    assert always.schedule_detok([(comfy, 3)], 1, now, False) == []
    with pytest.raises(ValueError, match="detok_defer_fill"):
        EngineConfig(detok_defer_fill=1.5)


def test_online_detokenizer_runs_for_pressing_windows_and_fills_with_others():
    now = 100.0
    sched = Scheduler(EngineConfig(policy="online", detok_batch=4))
    comfy = _req("comfy", 0, playing_since=90.0, audio_s=40.0)
    pressing = _req("pressing", 1, playing_since=90.0, audio_s=10.2)
    assert sched.schedule_detok([(comfy, 3)], lm_requests=BUSY, now=now, stateful=False) == []
    plan = sched.schedule_detok([(comfy, 3), (pressing, 2)], lm_requests=BUSY, now=now, stateful=False)
    assert [(r.id, n) for r, n in plan] == [("pressing", 2), ("comfy", 2)]
    # with the LM idle, waiting windows are decoded anyway
    assert [(r.id, n) for r, n in sched.schedule_detok([(comfy, 3)], 0, now, False)] == [("comfy", 3)]


def test_pressing_requests_over_budget_share_it():
    sched = Scheduler(EngineConfig(policy="online", detok_batch=4))
    a, b = _req("a", 0), _req("b", 1)  # nothing played yet
    plan = sched.schedule_detok([(a, 6), (b, 2)], lm_requests=BUSY, now=0.0, stateful=False)
    assert [(r.id, n) for r, n in plan] == [("a", 3), ("b", 1)]


def test_stateful_codec_gets_one_window_per_request_per_call():
    sched = Scheduler(EngineConfig(policy="fcfs", detok_batch=8))
    plan = sched.schedule_detok([(_req("a", 0), 3), (_req("b", 1), 2)], BUSY, 0.0, stateful=True)
    assert [(r.id, n) for r, n in plan] == [("a", 1), ("b", 1)]


def test_offline_detokenizes_in_bulk():
    sched = Scheduler(EngineConfig(policy="offline", detok_batch=4))
    a = _req("a", 0)
    assert sched.schedule_detok([(a, 3)], lm_requests=BUSY, now=0.0, stateful=False) == []
    assert [(r.id, n) for r, n in sched.schedule_detok([(a, 4)], BUSY, 0.0, False)] == [("a", 4)]
    assert [(r.id, n) for r, n in sched.schedule_detok([(a, 1)], 0, 0.0, False)] == [("a", 1)]


def test_orpheus_windows():
    spec = WindowSpec(frames=4, hop_frames=1, first_frames=4, flush_on_finish=False)
    assert [window_count(spec, n, False) for n in (0, 3, 4, 5, 9)] == [0, 0, 1, 2, 6]
    assert window_bounds(spec, 0, 9) == (0, 4) and window_bounds(spec, 5, 9) == (5, 9)
    tail = WindowSpec(frames=10, hop_frames=10, first_frames=10, flush_on_finish=True, stateful=True)
    assert window_count(tail, 25, lm_done=False) == 2 and window_count(tail, 25, lm_done=True) == 3
    assert window_bounds(tail, 2, 25) == (20, 25)


def test_online_detokenizer_lets_windows_pile_up_until_a_listener_needs_them():
    now = 100.0
    sched = Scheduler(EngineConfig(policy="online", detok_batch=8, detok_margin_s=0.15))
    thin = _req("thin", 0, playing_since=90.0, audio_s=10.3)  # 0.3 s left: pressing for the LM, not yet here
    assert thin.pressing(now, 1.0)
    assert sched.schedule_detok([(thin, 3)], lm_requests=BUSY, now=now, stateful=False) == []
    assert sched.schedule_detok([(thin, 3)], lm_requests=BUSY, now=now + 0.2, stateful=False) == [(thin, 3)]
    new = _req("new", 1)  # its first audio is always due
    assert [(r.id, n) for r, n in sched.schedule_detok([(thin, 3), (new, 1)], BUSY, now, False)] == [
        ("new", 1), ("thin", 3)]  # and the thin one rides along in the same call
    # a full batch of windows is decoded whoever is waiting: it is as cheap per window as the codec gets
    assert [(r.id, n) for r, n in sched.schedule_detok([(thin, 8)], BUSY, now, False)] == [("thin", 8)]
