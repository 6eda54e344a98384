"""VoxServe's own online policy (the ablation baseline) on a fake clock: its rules, and its faults."""
from voxbackend.config import EngineConfig
from voxbackend.engine.policies import make_policy
from voxbackend.engine.policies.online import OnlinePolicy
from voxbackend.engine.policies.voxserve import PREFILL_BATCH, VoxServePolicy, _proportional
from voxbackend.request import Request
from voxbackend.sampling_params import SamplingParams


def _req(rid: str, arrival: float, *, playing_since=None, audio_s=0.0, prompt=4, cached=4, streaming=True):
    r = Request(rid, list(range(prompt)), SamplingParams(seed=1), lambda e: None, arrival, streaming=streaming)
    r.lm.num_cached = cached
    r.lm.output_ids = [1] if cached >= prompt else []  # decoding: one step sampled, its input not cached yet
    r.lm.input_rows = list(r.lm.output_ids)  # the positions after the prompt: that step's input
    if playing_since is not None:
        r.playback.record_chunk(playing_since, audio_s)  # all its audio so far, as one chunk
        r.playback.last_chunk_s = 0.1
    return r


def _sched(**kw) -> VoxServePolicy:
    s = make_policy(EngineConfig(policy="voxserve", **kw))
    assert isinstance(s, VoxServePolicy)
    return s


def test_other_policies_get_their_own_class():
    assert type(make_policy(EngineConfig(policy="online"))) is OnlinePolicy


def test_one_whole_prefill_per_step_and_the_batch_capped_while_it_runs():
    now = 100.0
    prefills = [_req(f"p{i}", arrival=i, prompt=700, cached=0) for i in range(3)]
    decodes = [_req(f"d{i}", arrival=10 + i, playing_since=90.0, audio_s=10.5) for i in range(20)]
    plan = _sched(max_batch=32, prefill_budget=64).schedule_lm(prefills + decodes, now)
    assert plan[0][0].id == "p0" and plan[0][1] == 700  # the whole prompt, over any token budget
    assert [r.id for r, _ in plan[1:]] == [f"d{i}" for i in range(PREFILL_BATCH - 1)]
    # no prefill waiting: the full batch
    assert len(_sched(max_batch=32).schedule_lm(decodes, now)) == 20


def test_pressing_decodes_first_then_the_rest_in_arrival_order_without_ageing():
    now = 100.0
    comfy = [_req(f"c{i}", arrival=i, playing_since=90.0, audio_s=30.0) for i in range(3)]
    low = [_req(f"l{i}", arrival=10 + i, playing_since=90.0, audio_s=10.5 - i * 0.1) for i in range(2)]
    sched = _sched(max_batch=2)
    for _ in range(20):  # ours ages comfy into a slot after MAX_SKIPPED_STEPS; VoxServe never does
        assert [r.id for r, _ in sched.schedule_lm(comfy + low, now)] == ["l0", "l1"]  # arrival, not buffer


def test_detokenizer_waits_for_a_pressing_window_so_a_lone_batch_job_never_decodes():
    now = 100.0
    job = _req("job", 0, streaming=False)
    sched = _sched(max_batch=4)
    assert sched.schedule_detok([(job, 3)], lm_requests=False, now=now, stateful=False) == []  # ours decodes it
    online = make_policy(EngineConfig(policy="online", detok_batch=4))
    assert [(r.id, n) for r, n in online.schedule_detok([(job, 3)], False, now, False)] == [("job", 3)]
    # a pressing stream lets the batch job piggyback on the leftover budget
    new = _req("new", 1)
    plan = sched.schedule_detok([(job, 3), (new, 1)], lm_requests=1, now=now, stateful=False)
    assert [(r.id, n) for r, n in plan] == [("new", 1), ("job", 3)]


def test_detokenizer_budget_is_the_lm_batch_and_split_proportionally():
    sched = _sched(max_batch=4, detok_batch=16)
    a, b = _req("a", 0), _req("b", 1)  # nothing played yet: both pressing
    plan = sched.schedule_detok([(a, 6), (b, 2)], lm_requests=1, now=0.0, stateful=False)
    assert [(r.id, n) for r, n in plan] == [("a", 3), ("b", 1)]
    assert _proportional([5, 5, 5], 6) == [2, 2, 2]
    assert _proportional([9, 1, 1], 6) == [4, 1, 1]  # max(1, 9*6//11=4), then fits
    assert _proportional([1] * 5, 3) == [1] * 5  # over the cap where VoxServe's loop would never end


def test_a_stateful_codec_still_gets_one_window_per_request_per_call():
    sched = _sched(max_batch=8)
    plan = sched.schedule_detok([(_req("a", 0), 3), (_req("b", 1), 2)], True, 0.0, stateful=True)
    assert [(r.id, n) for r, n in plan] == [("a", 1), ("b", 1)]


def test_voxserve_counts_a_stall_against_the_stream_for_good():
    """VoxServe's playback clock is the first chunk's send time plus all audio sent: a stream that stalled stays
    behind it and pressing; our player model resumes after a stall (Request.buffer_s)."""
    r = _req("r", 0, playing_since=90.0, audio_s=5.0)  # ran dry at 95 s
    r.playback.record_chunk(100.0, 3.0)  # 3 s arrive at 100 s: 3 s queued for our player, 2 s behind VoxServe's clock
    assert r.playback.buffer_s(100.0) == 3.0 and not r.pressing(100.0, 0.0)
    assert _sched(playback_margin_s=0.0)._pressing(r, 100.0)
