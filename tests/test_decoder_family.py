"""The generic decoder equals transformers' Qwen2ForCausalLM and Qwen3ForCausalLM through the paged attention
(prefill, chunked prefill, decode), and the token-only model's greedy tokens equal their generate."""
import json

import pytest
import torch

import voxbackend
from voxbackend import EventKind, SamplingParams
from voxbackend.models import registry
from voxbackend.models.decoder import DecoderConfig
from tests.util_decoder import FAMILIES, write_tiny_decoder
from tests.util_paged import assert_paged_forward_matches

MAX_NEW = 10


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, write_tiny_decoder(request.param, path, seed=5)


def test_config_carries_each_familys_layer(tiny):
    family, path, ref = tiny
    cfg = DecoderConfig.from_hf(json.loads((path / "config.json").read_text()))
    assert cfg.head_dim == {"qwen2": 16, "qwen3": 24}[family]  # qwen3: head_dim from config, not hidden / heads
    assert (cfg.qkv_bias, cfg.o_bias, cfg.qk_norm, cfg.tie_word_embeddings) == {
        "qwen2": (True, False, False, True), "qwen3": (True, True, True, False)}[family]
    model = voxbackend.load(path, kv_pages=8, page_size=4).model
    assert model.spec.name == family and model.spec.stop_ids == (2,)
    if family == "qwen2":  # tied: the head is the embedding table, not a copy
        assert model.backbone.lm_head.weight is model.backbone.embed.weight


def test_paged_forward_matches_transformers(tiny):
    _, path, ref = tiny
    assert_paged_forward_matches(voxbackend.load(path, kv_pages=64, page_size=4), ref, seed=0)


def test_greedy_tokens_equal_generate_under_continuous_batching(tiny):
    _, path, ref = tiny
    engine = voxbackend.load(path, max_batch=4, page_size=4, kv_pages=200, prefill_budget=16)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (1, 4, 6, 9, 17, 23)]
    results: dict[str, list[int]] = {}

    def on_event(e):
        assert e.kind is EventKind.FINISHED, e
        results[e.request_id] = e.token_ids

    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    ids = []
    for p in prompts:  # a new request every step: arrivals land mid-generation
        ids.append(engine.submit(p, greedy, on_event, streaming=False))
        engine.step()
    while len(results) < len(prompts):
        engine.step()
    for rid, p in zip(ids, prompts):
        want = ref.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=2,
                            pad_token_id=0)[0, len(p):].tolist()
        assert results[rid] == want, len(p)
    assert engine.pool.used_pages == 0


def test_null_architectures_load(tiny, tmp_path):
    """A config.json written from a `to_dict()` can hold `"architectures": null`: model_type decides."""
    family, path, ref = tiny
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": None}))
    assert registry.detect_kind(tmp_path).name == "token_lm"
    engine = voxbackend.load(tmp_path, kv_pages=32, page_size=4)
    assert engine.model.spec.name == family
    prompt = [5, 6, 7, 8]
    got = engine.generate_ids([prompt], SamplingParams(temperature=0.0, max_tokens=4))[0]
    want = ref.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, eos_token_id=2,
                        pad_token_id=0)[0, 4:].tolist()
    assert got == want


@pytest.mark.parametrize("config, kind", [
    ({"architectures": None, "model_type": "llama", "vocab_size": 156940}, "orpheus"),
    ({"architectures": None, "model_type": "csm"}, "csm"),
    ({"architectures": None, "model_type": "qwen3"}, "token_lm"),
    ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}, "token_lm"),
])
def test_detection_with_and_without_architectures(tmp_path, config, kind):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert registry.detect_kind(tmp_path).name == kind


def test_unsupported_configs_are_refused_clearly(tmp_path):
    neox = {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"}
    (tmp_path / "config.json").write_text(json.dumps(neox))
    with pytest.raises(ValueError, match="unsupported architecture .*GPTNeoXForCausalLM"):
        registry.detect_kind(tmp_path)
    with pytest.raises(ValueError, match="unknown model kind 'nope'"):
        voxbackend.load(tmp_path, model="nope")
    cfg = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
               model_type="qwen2", use_sliding_window=True)
    with pytest.raises(ValueError, match="sliding-window"):
        DecoderConfig.from_hf(cfg)
