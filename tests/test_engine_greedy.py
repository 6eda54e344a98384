"""Greedy tokens from continuous batching equal transformers' generate on each prompt alone."""

import pytest
import torch

import voxbackend
from voxbackend import EventKind, SamplingParams
from tests.util_llama import write_tiny_llama

MAX_NEW = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    return path, write_tiny_llama(path, seed=3)


def _reference(ref, prompt):
    out = ref.generate(
        torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=2, pad_token_id=0
    )
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("policy", ["online", "fcfs", "offline", "voxserve"])
def test_greedy_equality_under_continuous_batching(tiny, policy):
    path, ref = tiny
    engine = voxbackend.load(path, policy=policy, max_batch=5, page_size=4, kv_pages=200, prefill_budget=24)
    g = torch.Generator().manual_seed(7)
    lengths = [1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 23, 31, 40]  # several cross 4-token page boundaries
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    results: dict[str, list[int]] = {}

    def on_event(e):
        assert e.kind is EventKind.FINISHED, e
        results[e.request_id] = e.token_ids

    ids = []
    for i, p in enumerate(prompts):  # a new request every other step: arrivals land mid-generation
        ids.append(engine.submit(p, greedy, on_event, streaming=False))
        engine.step()
        if i % 2:
            engine.step()
    while len(results) < len(prompts):
        engine.step()
    for rid, p in zip(ids, prompts):
        assert results[rid] == _reference(ref, p), (policy, len(p))
    assert engine.pool.used_pages == 0


def test_generate_ids_runs_batched_and_on_a_started_engine(tiny):
    path, ref = tiny
    engine = voxbackend.load(path, max_batch=3, page_size=4, kv_pages=200).start()
    try:
        prompts = [[5, 6, 7], [9] * 10, list(range(3, 30))]
        got = engine.generate_ids(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
        assert got == [_reference(ref, p) for p in prompts]
    finally:
        engine.shutdown()
