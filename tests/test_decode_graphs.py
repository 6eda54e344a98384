"""Padded decode steps (engine/decode_graphs.py, and the depth pass: models/depth_columns.py): the static-buffer
path a CUDA graph replays, run eagerly on CPU. Every served model's tokens and audio through it equal the unpadded
path's, with requests arriving mid-run so decode batches of 1-4 rows pad up to their buckets (3 -> 4) beside
prefill steps that take the unpadded path."""
import numpy as np
import pytest

from voxbackend import SamplingParams
from voxbackend.attention.base import SeqSlice
from voxbackend.cuda_graphs import buckets
from tests.util_engine_drive import SERVED, run_staggered, stream_audio, tiny_engine

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest

TEXTS = ["Hello there.", "A second, longer request arrives.", "Third.", "And a fourth one to pad the bucket."]


def test_buckets():
    assert buckets(1) == [1]
    assert buckets(3) == [1, 2, 3]
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert buckets(20) == [1, 2, 4, 8, 16, 20]


@pytest.mark.parametrize("name", SERVED)
def test_padded_decode_steps_equal_the_unpadded_path(name):
    padded, plain = tiny_engine(name, cuda_graphs="padded"), tiny_engine(name, cuda_graphs="off")
    assert plain.runner.graphs is None and padded.runner.graphs is not None
    forwards = []
    graphs_forward = padded.runner.graphs.forward
    padded.runner.graphs.forward = lambda ids, positions, seqs: forwards.append(len(seqs)) or \
        graphs_forward(ids, positions, seqs)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24)
    prompts = [padded.model.prepare(t, None) for t in TEXTS]
    assert run_staggered(padded, prompts, greedy, every=2) == run_staggered(plain, prompts, greedy, every=2)
    assert 3 in forwards and max(forwards) <= 4 * (2 if padded.model.spec.guidance else 1), forwards
    if padded.model.depth_columns is not None:  # CSM's depth decoder, Qwen3-TTS' code predictor: padded too
        assert sorted(padded.model.depth_columns.buckets) == [1, 2, 4], padded.model.depth_columns.buckets

    sampled = [(padded.model.prepare(t, None), SamplingParams(temperature=0.8, max_tokens=40, seed=i))
               for i, t in enumerate(TEXTS[:3])]
    for a, b in zip(stream_audio(padded, sampled, every=2), stream_audio(plain, sampled, every=2)):
        np.testing.assert_allclose(a, b, atol=1e-4)
    if name == "orpheus":  # SNAC: fixed 4-frame windows, so the codec decoded from its bucket buffers too
        assert padded.model.codec._static and plain.model.codec.sizes is None, list(padded.model.codec._static)
    assert padded.pool.used_pages == 0  # the dummy rows' keys went to the scratch page, which is not the pool's


def test_dummy_rows_write_only_the_scratch_page():
    """A padded step's keys and values land in the real rows' slots and the scratch page; no other page changes."""
    engine = tiny_engine("orpheus", cuda_graphs="padded")
    pool = engine.pool
    before = pool.cache.clone()
    seqs = [SeqSlice(0, 1, 5, [3]), SeqSlice(1, 1, 17, [7, 9]), SeqSlice(2, 1, 0, [4])]
    engine.runner.graphs.forward([11, 12, 13], [5, 17, 0], seqs)  # 3 rows -> the 4-row bucket: one dummy
    changed = (pool.cache != before).flatten(3).any(-1).any(0).any(0).nonzero().flatten().tolist()
    ps = pool.page_size
    assert changed == [3, 4, 9, pool.scratch_page], changed
    changed_slots = (pool.cache != before).flatten(4).any(-1).any(0).any(0).nonzero().tolist()
    assert [3, 5] in changed_slots and [9, 17 - ps] in changed_slots and [4, 0] in changed_slots


def test_a_capture_that_fails_leaves_the_steps_eager_with_the_same_audio(caplog):
    """A graph whose capture fails (here: no CUDA at all) is logged once, and its steps run eagerly from the same
    buffers: a GPU path CI cannot run must not take a server down."""
    from voxbackend.cuda_graphs import GraphReplayer

    captured, plain = tiny_engine("orpheus", cuda_graphs="padded"), tiny_engine("orpheus", cuda_graphs="off")
    captured.runner.graphs.replayer = GraphReplayer("the decode step", "cpu")
    captured.model.codec.replayer = GraphReplayer("the SNAC decoder", "cpu")
    request = [(captured.model.prepare("Hello there.", None), SamplingParams(temperature=0.8, max_tokens=40, seed=3))]
    [a], [b] = stream_audio(captured, request, every=1), stream_audio(plain, request, every=1)
    np.testing.assert_allclose(a, b, atol=1e-4)
    assert captured.runner.graphs.replayer.failed and captured.model.codec.replayer.failed
    failures = [r.getMessage() for r in caplog.records if "capture" in r.getMessage()]
    assert len(failures) == 2 and "running it eagerly" in failures[0], failures
