"""Scheduling policies on a fake clock."""
import pytest

from voxbackend.config import EngineConfig
from voxbackend.engine.detokenize import window_bounds, window_count
from voxbackend.engine.policies import make_policy
from voxbackend.engine.policies.base import MAX_SKIPPED_STEPS
from voxbackend.engine.policies.online import OnlinePolicy, WindowRate
from voxbackend.models.base import WindowSpec
from voxbackend.request import Request
from voxbackend.sampling_params import SamplingParams


BUSY = EngineConfig().max_batch  # requests on the LM: a full batch, where the online policy holds windows back


def _req(rid: str, arrival: float, *, playing_since=None, audio_s=0.0, prompt=4, cached=4, streaming=True):
    r = Request(rid, list(range(prompt)), SamplingParams(seed=1), lambda e: None, arrival, streaming=streaming)
    r.lm.num_cached = cached
    r.lm.output_ids = [1] if cached >= prompt else []  # decoding: one step sampled, its input not cached yet
    r.lm.input_rows = list(r.lm.output_ids)  # the positions after the prompt: that step's input
    if playing_since is not None:
        r.playback.record_chunk(playing_since, audio_s)  # all its audio so far, as one chunk
        r.playback.last_chunk_s = 0.1
    return r


def test_online_gives_lm_slots_to_streams_about_to_stall():
    now = 100.0
    comfy = [_req(f"c{i}", arrival=i, playing_since=90.0, audio_s=30.0) for i in range(3)]  # 20 s buffered
    low = _req("low", arrival=10, playing_since=90.0, audio_s=10.5)  # 0.5 s left: pressing
    new = _req("new", arrival=11)  # nothing played yet: pressing
    sched = make_policy(EngineConfig(policy="online", max_batch=2))
    chosen = [r.id for r, _ in sched.schedule_lm(comfy + [low, new], now)]
    assert chosen == ["low", "new"]
    fcfs = make_policy(EngineConfig(policy="fcfs", max_batch=2))
    assert [r.id for r, _ in fcfs.schedule_lm(comfy + [low, new], now)] == ["c0", "c1"]


def test_passed_over_requests_age_into_slots():
    now = 100.0
    comfy = _req("comfy", arrival=0, playing_since=90.0, audio_s=60.0)
    busy = [_req(f"n{i}", arrival=1 + i) for i in range(2)]
    sched = make_policy(EngineConfig(policy="online", max_batch=2))
    for _ in range(MAX_SKIPPED_STEPS):
        assert "comfy" not in [r.id for r, _ in sched.schedule_lm([comfy, *busy], now)]
    assert "comfy" in [r.id for r, _ in sched.schedule_lm([comfy, *busy], now)]


def test_chunked_prefill_under_token_budget_with_several_prefills():
    sched = make_policy(EngineConfig(policy="fcfs", max_batch=8, prefill_budget=10))
    a = _req("a", 0, prompt=6, cached=0)
    b = _req("b", 1, prompt=9, cached=0)
    c = _req("c", 2)  # decoding
    plan = [(r.id, n) for r, n in sched.schedule_lm([a, b, c], 0.0)]
    assert plan == [("a", 6), ("b", 4)]  # two prefills share the step; b continues next step


def _online(now: float = 100.0, windows_per_s: float = 1000.0, **config) -> OnlinePolicy:
    """The online scheduler with windows coming at `windows_per_s` (a full batch forms within milliseconds by
    default) and, unless given, no pace floor (the rules with headroom; on a CPU device "auto" is 1.6)."""
    sched = make_policy(EngineConfig(policy="online", **{"detok_pace_floor": 0.0, **config}))
    sched.window_rate = WindowRate(per_s=windows_per_s, at=now)
    return sched


def test_pace_floor_is_checked_and_auto_means_on_only_on_a_cpu():
    assert EngineConfig().pace_floor == 1.6 and EngineConfig(device="cuda:0").pace_floor == 0.0
    assert EngineConfig.from_options({"detok_pace_floor": "0.5"}).pace_floor == 0.5
    for bad in (-1.0, "fast"):
        with pytest.raises(ValueError, match="detok_pace_floor"):
            EngineConfig(detok_pace_floor=bad)


def test_window_rate_follows_growth_between_decisions_and_restarts_after_idle():
    rate = WindowRate()
    rate.observe(0.0, 0)
    for k in range(1, 601):  # 2 windows every 10 ms, all decoded each time: 200 windows/s
        rate.observe(k * 0.01, 2)
        rate.left(0)
    assert rate.per_s == pytest.approx(200.0, rel=0.02)
    assert rate.seconds_for(10) == pytest.approx(0.05, rel=0.02) and rate.seconds_for(0) == 0.0
    for k in range(1, 21):  # the same 2 windows left waiting are not new ones: the rate decays
        rate.observe(6.0 + k * 0.01, 2)
    assert rate.per_s < 170.0
    rate.observe(9.0, 1)  # the engine was idle for 3 s: the rate is unknown again
    assert rate.per_s == 0.0 and rate.seconds_for(1) == float("inf")


def test_online_near_its_limit_decodes_full_batches_in_arrival_order():
    now = 100.0
    sched = _online(detok_batch=4, detok_pace_floor=1.6)

    def stream(rid, arrival, made_s):  # a first chunk of 0.25 s at 90 s, then made_s more, on time
        r = _req(rid, arrival, playing_since=90.0, audio_s=0.25)
        r.playback.record_chunk(90.25, made_s)
        r.codec.windows_done = round((0.25 + made_s) / 0.085)  # 85 ms windows
        return r

    slow = [stream(f"s{i}", i, 9.85) for i in range(2)]  # made 1x real time: 0.1 s left
    slow[0].codec.ready_windows = 2
    assert slow[0].pace(now) == pytest.approx(1.0, abs=0.01) and slow[0].playback.buffer_s(now) == pytest.approx(0.1)
    assert sched.schedule_detok([(slow[1], 1), (slow[0], 2)], 2, now, False) == []  # thin buffers, yet they wait
    plan = sched.schedule_detok([(slow[1], 3), (slow[0], 2)], 2, now, False)
    assert [(r.id, n) for r, n in plan] == [("s0", 2), ("s1", 2)]  # a full batch, oldest first
    assert [(r.id, n) for r, n in sched.schedule_detok([(slow[1], 1)], 0, now, False)] == [("s1", 1)]  # LM idle
    # near the limit the LM serves in arrival order too (with headroom: the thinnest buffer first)
    assert [r.id for r, _ in sched.schedule_lm([slow[1], slow[0]], now)] == ["s0", "s1"]
    # a full batch must form quickly for waiting to be cheap: at 5 windows/s (0.8 s a batch) thin buffers go now
    trickle = _online(windows_per_s=5.0, detok_batch=4, detok_pace_floor=1.6)
    assert [(r.id, n) for r, n in trickle.schedule_detok([(slow[1], 1)], 2, now, False)] == [("s1", 1)]
    # the streams' average pace decides: with a 3x stream beside it the slow one's thin buffer is decoded at once
    fast = stream("f", 2, 29.75)
    assert fast.pace(now) == pytest.approx(2.975)
    assert [(r.id, n) for r, n in sched.schedule_detok([(slow[1], 1), (fast, 1)], 2, now, False)] == [
        ("s1", 1), ("f", 1)]


def test_a_pace_reading_ends_with_the_streams_that_made_it():
    """Slow streams set the near-limit reading; once they are gone a new stream's first window is decoded at once
    (seen: a lone API stream got its first audio only with its last, after a slow stream on a busy machine)."""
    now = 100.0
    sched = _online(detok_batch=4, detok_pace_floor=1.6)
    slow = _req("slow", 0, playing_since=90.0, audio_s=10.1)  # 1x real time
    assert sched.schedule_detok([(slow, 1)], 2, now, False) == []  # near the limit: waits for a full batch
    newcomer = _req("new", 1)
    assert sched.schedule_detok([(newcomer, 1)], 2, now, False) == []  # the slow stream still runs: the reading stands
    assert [(r.id, n) for r, n in sched.schedule_detok([(newcomer, 1)], 1, now, False)] == [("new", 1)]


def test_online_detokenizer_runs_for_pressing_windows_and_fills_with_others():
    now = 100.0
    sched = _online(detok_batch=4)
    comfy = _req("comfy", 0, playing_since=90.0, audio_s=40.0)
    pressing = _req("pressing", 1, playing_since=90.0, audio_s=10.2)
    assert sched.schedule_detok([(comfy, 3)], lm_requests=BUSY, now=now, stateful=False) == []
    plan = sched.schedule_detok([(comfy, 3), (pressing, 2)], lm_requests=BUSY, now=now, stateful=False)
    assert [(r.id, n) for r, n in plan] == [("pressing", 2), ("comfy", 2)]
    # with the LM idle, waiting windows are decoded anyway
    assert [(r.id, n) for r, n in sched.schedule_detok([(comfy, 3)], 0, now, False)] == [("comfy", 3)]


def test_pressing_requests_over_budget_share_it():
    sched = _online(now=0.0, detok_batch=4)
    a, b = _req("a", 0), _req("b", 1)  # nothing played yet
    plan = sched.schedule_detok([(a, 6), (b, 2)], lm_requests=BUSY, now=0.0, stateful=False)
    assert [(r.id, n) for r, n in plan] == [("a", 3), ("b", 1)]


def test_stateful_codec_gets_one_window_per_request_per_call():
    sched = make_policy(EngineConfig(policy="fcfs", detok_batch=8))
    plan = sched.schedule_detok([(_req("a", 0), 3), (_req("b", 1), 2)], BUSY, 0.0, stateful=True)
    assert [(r.id, n) for r, n in plan] == [("a", 1), ("b", 1)]


def test_offline_detokenizes_in_bulk():
    sched = make_policy(EngineConfig(policy="offline", detok_batch=4))
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
    sched = _online(detok_batch=8, detok_margin_s=0.15)
    thin = _req("thin", 0, playing_since=90.0, audio_s=10.3)  # 0.3 s left: pressing for the LM, not yet here
    assert thin.pressing(now, 1.0)
    assert sched.schedule_detok([(thin, 3)], lm_requests=BUSY, now=now, stateful=False) == []
    assert sched.schedule_detok([(thin, 3)], lm_requests=BUSY, now=now + 0.2, stateful=False) == [(thin, 3)]
    new = _req("new", 1)  # its first audio is always due
    assert [(r.id, n) for r, n in sched.schedule_detok([(thin, 3), (new, 1)], BUSY, now, False)] == [
        ("new", 1), ("thin", 3)]  # and the thin one rides along in the same call
    # a full batch of windows is decoded whoever is waiting: it is as cheap per window as the codec gets
    assert [(r.id, n) for r, n in sched.schedule_detok([(thin, 8)], BUSY, now, False)] == [("thin", 8)]


def test_a_player_that_ran_dry_resumes_with_the_next_chunk():
    r = _req("r", 0, playing_since=10.0, audio_s=1.0)
    assert r.playback.buffer_s(10.4) == pytest.approx(0.6)
    assert r.playback.buffer_s(12.0) == pytest.approx(-1.0)  # ran dry at 11.0: its listener has waited 1 s
    r.playback.record_chunk(12.0, 0.5)  # the player plays it from now: 0.5 s queued, not 1 s behind
    assert r.playback.buffer_s(12.0) == pytest.approx(0.5) and r.playback.buffer_s(12.2) == pytest.approx(0.3)
    r.playback.record_chunk(12.2, 0.5)  # arrives while playing: queued on top
    assert r.playback.buffer_s(12.2) == pytest.approx(0.8)
    assert r.playback.audio_sent_s == pytest.approx(2.0) and r.playback.last_chunk_s == 0.5


def test_a_stream_that_stalled_once_is_not_urgent_for_the_codec_forever():
    now = 100.0
    sched = _online(detok_batch=8, detok_margin_s=0.15)
    r = _req("r", 0, playing_since=90.0, audio_s=5.0)  # ran dry at 95 s
    assert sched.schedule_detok([(r, 1)], lm_requests=BUSY, now=now, stateful=False) == [(r, 1)]
    r.playback.record_chunk(now, 0.34)  # the window it waited for: the player resumes with 0.34 s queued
    assert sched.schedule_detok([(r, 1)], lm_requests=BUSY, now=now + 0.05, stateful=False) == []


def test_pace_counts_audio_made_after_the_first_chunk_and_ready_windows():
    r = _req("r", 0, playing_since=10.0, audio_s=0.25)  # the first chunk: made before playback started
    r.codec.windows_done = 3
    assert r.pace(10.4) is None  # too early to tell
    r.playback.record_chunk(10.5, 0.5)
    r.codec.ready_windows = 3  # 3 more windows of 0.25 s each (0.75 s over 3 windows so far)
    assert r.pace(11.0) == pytest.approx((0.5 + 3 * 0.25) / 1.0)
    assert _req("new", 1).pace(11.0) is None
