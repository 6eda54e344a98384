"""The policy simulator: the real engine on a simulated clock is deterministic and plays Orpheus-shaped streams."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from clients.stream_metrics import audio_seconds, summarize  # noqa: E402
from perf.policy_sim import FRAME_SAMPLES, SAMPLE_RATE, CostModel, Workload, simulate  # noqa: E402

COST = CostModel("test", 8e-3, 6e-5, 2e-3, 1e-4, 2e-4)


def test_same_seed_same_run_and_every_stream_complete():
    wl = Workload("poisson", rate=3.0, duration_s=4.0)
    a = simulate("online", wl, COST, seed=3, record=True)
    b = simulate("online", wl, COST, seed=3)
    assert [tl.chunks for tl in a.timelines] == [tl.chunks for tl in b.timelines]
    lengths = [tokens for _, tokens in wl.arrivals(3)]
    assert len(a.timelines) == len(lengths) > 5
    for tl, tokens in zip(a.timelines, lengths):
        assert tl.finish_reason == "length" and tl.error is None
        frames = tokens // 7  # every window after the first 3 frames plays one frame
        assert abs(audio_seconds(tl) - (frames - 3) * FRAME_SAMPLES / SAMPLE_RATE) < 1e-9
    assert a.steps and max(s.lm_rows for s in a.steps) <= 32
    assert summarize(a.timelines)["stall_free_pct"] == 100.0  # light load on a fast cost model


def test_overload_stalls_and_policies_differ():
    wl = Workload("poisson", rate=12.0, duration_s=4.0)
    online = summarize(simulate("online", wl, COST, seed=0).timelines)
    voxserve = summarize(simulate("voxserve", wl, COST, seed=0).timelines)
    assert online["stall_free_pct"] < 100.0
    assert online != voxserve


def test_the_detok_margin_reaches_the_online_policy():
    """A thinner margin lets windows pile up into fewer, larger codec calls; a margin longer than any stream makes
    every ready window urgent (decoded at once)."""
    wl = Workload("poisson", rate=6.0, duration_s=4.0)

    def codec_calls(margin: float) -> list[int]:
        steps = simulate("online", wl, COST, seed=1, detok_margin_s=margin, record=True).steps
        return [s.detok_windows for s in steps if s.detok_windows]

    thin, thick = codec_calls(0.15), codec_calls(100.0)
    assert sum(thin) == sum(thick)  # the same windows, every one decoded
    assert len(thin) < len(thick)


def test_delivery_jitter_delays_chunks_in_order_and_leaves_the_engine_alone():
    wl = Workload("poisson", rate=3.0, duration_s=4.0)
    plain = simulate("online", wl, COST, seed=2, first_chunk_s=0.25)
    late = simulate("online", wl, COST, seed=2, first_chunk_s=0.25, delivery_jitter_s=0.05)
    assert len(plain.timelines) == len(late.timelines)
    delays = []
    for a, b in zip(plain.timelines, late.timelines):
        assert [n for _, n in a.chunks] == [n for _, n in b.chunks]  # the same audio: the engine saw no change
        times = [t for t, _ in b.chunks]
        assert times == sorted(times) and b.end_time >= times[-1]
        delays += [tb - ta for (ta, _), (tb, _) in zip(a.chunks, b.chunks)]
    assert min(delays) >= 0 and 0.02 < sum(delays) / len(delays) < 0.2
    very_late = simulate("online", wl, COST, seed=2, first_chunk_s=0.25, delivery_jitter_s=0.5)
    assert summarize(plain.timelines)["stall_free_pct"] == 100.0 > summarize(very_late.timelines)["stall_free_pct"]
