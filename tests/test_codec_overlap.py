"""The codec beside the LM step (engine/codec_stream.py), on CPU: the same calls in the same order as on a GPU,
where the codec's stream runs while the LM step is on the device. Every served model's audio (sampled, so its
tokens too) equals the sequential engine's, though each step's windows are those ready before its LM step."""
import numpy as np
import pytest

from voxbackend import SamplingParams
from voxbackend.engine.codec_stream import CodecStream
from tests.util_engine_drive import SERVED, stream_audio, tiny_engine

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest

TEXTS = ["Hello there.", "A second, longer request arrives.", "Third."]


def test_overlap_is_on_for_cuda_only_unless_asked():
    from voxbackend.config import EngineConfig

    assert EngineConfig(device="cuda:0").overlaps_codec and not EngineConfig(device="cpu").overlaps_codec
    assert EngineConfig(device="cpu", overlap_codec="on").overlaps_codec
    assert not EngineConfig(device="cuda", overlap_codec="off").overlaps_codec
    with pytest.raises(ValueError, match="overlap_codec"):
        EngineConfig(overlap_codec="yes")


def test_codec_runs_only_after_the_event_before_the_lm_step():
    stream = CodecStream("cpu")
    with pytest.raises(RuntimeError, match="mark_before_lm"):
        with stream.running():
            pass
    stream.mark_before_lm()
    with stream.running():
        pass
    with pytest.raises(RuntimeError, match="mark_before_lm"):  # one mark per step
        with stream.running():
            pass


@pytest.mark.parametrize("name", SERVED)
def test_overlapped_engine_equals_the_sequential_one(name):
    overlapped, sequential = tiny_engine(name, overlap_codec="on"), tiny_engine(name, overlap_codec="off")
    assert sequential.codec_stream is None and overlapped.codec_stream is not None
    order: list[str] = []
    runner, launch = overlapped.runner, overlapped.runner.launch

    def launch_spy(plan):
        order.append("lm queued")
        step = launch(plan)
        collect = step.collect
        step.collect = lambda: order.append("lm ids") or collect()
        return step

    run_detok, step = overlapped._run_detok, overlapped.step
    runner.launch = launch_spy
    overlapped._run_detok = lambda plan: order.append("codec") or run_detok(plan)
    overlapped.step = lambda: order.append("step") or step()

    sampled = [(overlapped.model.prepare(t, None), SamplingParams(temperature=0.8, max_tokens=48, seed=i))
               for i, t in enumerate(TEXTS)]
    for a, b in zip(stream_audio(overlapped, sampled, every=2), stream_audio(sequential, sampled, every=2)):
        np.testing.assert_allclose(a, b, atol=1e-4)
    # each step with both: the codec between queuing the LM step and waiting for its ids
    steps = [s.strip("|").split("|") for s in "|".join(order).split("step") if s.strip("|")]
    both = [s for s in steps if "codec" in s and "lm ids" in s]
    assert both and all(s == ["lm queued", "codec", "lm ids"] for s in both), steps[:20]
    assert overlapped.pool.used_pages == 0 and not overlapped.running
