"""The engine's FEATURE prompt rows (vectors in place of ids) with a model-neutral test model: a tiny Llama whose
FEATURE positions take the request's vectors as input embeddings. Greedy tokens equal transformers' generate from
the same inputs_embeds, with chunked prefill whose chunks end between feature rows (page size 4), with
preemption (the whole prefix recomputed, features included), and batched beside requests with other vectors or
none; a prompt whose feature rows and vectors disagree is refused."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from util_llama import write_tiny_llama
from voxbackend import SamplingParams
from voxbackend.config import EngineConfig
from voxbackend.engine.engine import Engine
from voxbackend.errors import InvalidRequest
from voxbackend.models.base import FEATURE, Prompt, PromptFeatures
from voxbackend.models.token_lm import TokenLM
from voxbackend.tensor_spec import TensorSpec

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS)
PROMPT = [1, 17, FEATURE, FEATURE, 40, 41, 42, FEATURE, 9, 10, 11]  # 11 positions, feature rows at 2, 3 and 7


class FeatureLM(TokenLM):
    """A token LM whose FEATURE positions take the vectors of the request's `vectors` conditioning array."""

    conditioning = (TensorSpec("VECTORS", "FP32", (-1, -1), optional=True, arg="vectors"),)

    def prompt_features(self, conditioning):
        return conditioning.get("vectors")

    def forward(self, input_ids, positions, attention, features: PromptFeatures | None = None):
        x = self.backbone.embed(input_ids.clamp(min=0))
        if features is not None:
            x = x.index_copy(0, features.rows, features.vectors.to(x.dtype))
        return self.backbone.forward_embeds(x, positions, attention)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    out = tmp_path_factory.mktemp("feature_llama")
    reference = write_tiny_llama(out, seed=4)
    return out, reference


def _vectors(seed: int, n: int = 3) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, 64)) * 2).astype(np.float32)


def _reference_tokens(reference, prompt: list[int], vectors: np.ndarray | None) -> list[int]:
    """transformers, greedy, from inputs_embeds with the vectors at the FEATURE positions."""
    ids = torch.tensor([max(i, 0) for i in prompt])
    with torch.no_grad():
        embeds = reference.get_input_embeddings()(ids)
        at = [i for i, t in enumerate(prompt) if t == FEATURE]
        if at:
            embeds[at] = torch.from_numpy(vectors)
        mask = torch.ones(1, len(prompt), dtype=torch.long)
        out = reference.generate(inputs_embeds=embeds[None], attention_mask=mask, max_new_tokens=STEPS,
                                 min_new_tokens=STEPS, do_sample=False)
    return out[0].tolist()


def _run(engine: Engine, prompts: list[Prompt], stagger: int = 0, preempt_at: int | None = None) -> list[list[int]]:
    """`preempt_at`: each request is preempted once (the engine's own preemption) when it has that many tokens."""
    done: dict[str, list[int]] = {}
    ids = []
    for p in prompts:
        ids.append(engine.submit(p, GREEDY, lambda e: done.__setitem__(e.request_id, e.token_ids) if e.final else None,
                                 streaming=False))
        for _ in range(stagger):
            engine.step()
    while len(done) < len(ids):
        engine.step()
        if preempt_at is not None:
            for r in [r for r in engine.running
                      if r.on_lm and len(r.lm.output_ids) == preempt_at and not r.lm.preemptions]:
                engine.admission.preempt(r)
    assert engine.pool.used_pages == 0
    return [done[i] for i in ids]


@pytest.mark.parametrize("page_size,prefill_budget", [(16, 512), (4, 3), (4, 2)])
def test_feature_rows_equal_transformers_inputs_embeds(llama, page_size, prefill_budget):
    """Chunks of 3 (2) positions end between the feature rows 2 and 3 and on row 7."""
    folder, reference = llama
    model = FeatureLM(folder)
    engine = Engine(model, EngineConfig(kv_pages=64, page_size=page_size, prefill_budget=prefill_budget))
    vectors = _vectors(0)
    got = _run(engine, [Prompt(PROMPT, {"vectors": vectors})])[0]
    assert got == _reference_tokens(reference, PROMPT, vectors)
    other = _run(engine, [Prompt(PROMPT, {"vectors": _vectors(1)})])[0]
    assert other != got  # the vectors are the input: other vectors, other tokens


def test_feature_rows_batched_with_other_vectors_and_none(llama):
    folder, reference = llama
    model = FeatureLM(folder)
    engine = Engine(model, EngineConfig(kv_pages=64, page_size=4, prefill_budget=5, max_batch=8))
    plain = [1, 17, 30, 31, 40]
    prompts = [Prompt(PROMPT, {"vectors": _vectors(2)}), Prompt(plain), Prompt(PROMPT, {"vectors": _vectors(3)}),
               Prompt(PROMPT[:4], {"vectors": _vectors(4, 2)})]
    got = _run(engine, prompts, stagger=2)
    for p, tokens in zip(prompts, got):
        assert tokens == _reference_tokens(reference, p.ids, p.conditioning.get("vectors"))


def test_preempted_request_recomputes_its_features(llama):
    folder, reference = llama
    model = FeatureLM(folder)
    engine = Engine(model, EngineConfig(kv_pages=64, page_size=4, prefill_budget=4, max_batch=8))
    prompts = [Prompt(PROMPT, {"vectors": _vectors(5)}), Prompt(PROMPT, {"vectors": _vectors(6)})]
    got = _run(engine, prompts, preempt_at=3)
    assert engine.preemptions == 2
    for p, tokens in zip(prompts, got):
        assert tokens == _reference_tokens(reference, p.ids, p.conditioning["vectors"])


def test_a_full_pool_preempts_and_the_features_come_back(llama):
    """Requests of 5 pages each (11 + 8 positions) in a pool of 9: growth preempts one of them."""
    folder, reference = llama
    model = FeatureLM(folder)
    engine = Engine(model, EngineConfig(kv_pages=9, page_size=4, prefill_budget=64, max_batch=8, policy="fcfs"))
    prompts = [Prompt(PROMPT, {"vectors": _vectors(7 + i)}) for i in range(3)]
    got = _run(engine, prompts)
    assert engine.preemptions >= 1
    for p, tokens in zip(prompts, got):
        assert tokens == _reference_tokens(reference, p.ids, p.conditioning["vectors"])


def test_feature_rows_and_vectors_must_agree(llama):
    folder, _ = llama
    engine = Engine(FeatureLM(folder), EngineConfig(kv_pages=16))
    with pytest.raises(InvalidRequest) as e:
        engine.submit(Prompt(PROMPT, {"vectors": _vectors(0, 2)}), GREEDY)
    assert e.value.field == "prompt_ids"
    with pytest.raises(InvalidRequest) as e:
        engine.submit(Prompt(PROMPT), GREEDY)
    assert e.value.field == "prompt_ids"
    with pytest.raises(InvalidRequest):  # a model without prompt features takes no FEATURE rows
        Engine(TokenLM(folder), EngineConfig(kv_pages=16)).submit(PROMPT, GREEDY)
    assert engine.pool.used_pages == 0 and not engine.waiting
