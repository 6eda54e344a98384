"""The generic decoder with GPT-2's parts (LayerNorm, gelu_new MLP, biases, learned positions, Conv1D weights)
equals transformers' GPT2Model and GPT2LMHeadModel through the paged attention: one flattened prefill of
sequences of different lengths, then decode steps from the paged cache."""
import json

import pytest
import torch
import transformers

import voxbackend
from voxbackend import SamplingParams
from voxbackend.attention.base import SeqSlice
from voxbackend.attention.torch_backend import TorchPagedAttention
from voxbackend.engine.kv_pool import KVPool
from voxbackend.models.decoder import DecoderConfig, build_decoder, decoder_family
from tests.util_decoder import randomize
from tests.util_paged import assert_paged_forward_matches, rel_err

pytestmark = pytest.mark.usefixtures("one_thread")

GPT2 = dict(vocab_size=512, n_embd=64, n_layer=3, n_head=4, n_positions=128, n_inner=None, bos_token_id=1,
            eos_token_id=2, activation_function="gelu_new", layer_norm_epsilon=1e-5)


def tiny_gpt2(model_cls, seed: int):
    torch.manual_seed(seed)
    model = model_cls(transformers.GPT2Config(**GPT2)).eval()
    randomize(model, seed + 1)  # LayerNorm weights/biases and every Conv1D bias too, not 1 and 0
    return model


def test_config_and_family():
    cfg = DecoderConfig.from_hf(transformers.GPT2Config(**GPT2).to_dict())
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.max_position_embeddings) == (64, 256, 3, 4, 4, 16, 128)
    assert (cfg.norm, cfg.mlp, cfg.gelu_approximate, cfg.positions, cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias,
            cfg.tie_word_embeddings) == ("layer", "gelu", "tanh", "learned", True, True, True, True)
    # Chatterbox's GPT2_medium entry names both hidden_size and n_embd; a to_dict() has null architectures
    assert DecoderConfig.from_hf({"model_type": "gpt2", "vocab_size": 8, "hidden_size": 32, "n_head": 2,
                                  "n_layer": 1}).head_dim == 16
    assert decoder_family({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}) == "gpt2"
    assert decoder_family({"architectures": ["GPT2Model"], "model_type": "gpt2"}) == "gpt2"
    assert decoder_family({"architectures": None, "model_type": "gpt2"}) == "gpt2"
    with pytest.raises(ValueError, match="activation_function"):
        DecoderConfig.from_hf({**GPT2, "model_type": "gpt2", "activation_function": "relu"})
    with pytest.raises(ValueError, match="scaled"):
        DecoderConfig.from_hf({**GPT2, "model_type": "gpt2", "scale_attn_by_inverse_layer_idx": True})


def test_paged_hidden_states_match_gpt2model():
    """GPT2Model's state dict has no prefix and no head: final hidden states (after ln_f) for three sequences
    (13, 5, 9 tokens) in one flattened prefill, then three decode steps of all three."""
    ref = tiny_gpt2(transformers.GPT2Model, seed=3)
    cfg = DecoderConfig.from_hf(ref.config.to_dict())
    model = build_decoder(cfg, ref.state_dict(), "cpu", torch.float32, head=False)
    pool = KVPool(cfg.geometry(), num_pages=40, page_size=4, device="cpu", dtype=torch.float32)
    attn = TorchPagedAttention(pool.cache, pool.page_size, pool.scratch_page, cfg.head_dim**-0.5)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=g) for n in (13, 5, 9)]
    pages = [pool.allocate(f"s{i}", 40) for i in range(3)]
    errors = []
    with torch.no_grad():
        starts = [0, 13, 18]
        attn.plan([SeqSlice(s, len(p), 0, pg) for s, p, pg in zip(starts, prompts, pages)])
        hidden = model.forward(torch.cat(prompts), torch.cat([torch.arange(len(p)) for p in prompts]), attn)
        for s, p in zip(starts, prompts):  # every position, not only the last: positions index wpe globally
            errors.append(rel_err(hidden[s:s + len(p)], ref(p[None]).last_hidden_state[0]))
        lengths = [13, 5, 9]
        for _ in range(3):
            new = torch.randint(0, 512, (3,), generator=g)
            attn.plan([SeqSlice(i, 1, lengths[i], pages[i]) for i in range(3)])
            hidden = model.forward(new, torch.tensor(lengths), attn)
            for i in range(3):
                prompts[i] = torch.cat([prompts[i], new[i:i + 1]])
                lengths[i] += 1
                errors.append(rel_err(hidden[i], ref(prompts[i][None]).last_hidden_state[0, -1]))
    assert max(errors) <= 1e-4, errors


@pytest.fixture(scope="module")
def gpt2_lm(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2")
    ref = tiny_gpt2(transformers.GPT2LMHeadModel, seed=7)
    ref.save_pretrained(path, safe_serialization=True)
    return path, ref


def test_lm_head_logits_through_the_engine(gpt2_lm):
    """A saved GPT2LMHeadModel ("transformer." prefix, head tied to wte) loads as a token LM: paged logits (prefill,
    chunked prefill, decode) and greedy tokens equal transformers'."""
    path, ref = gpt2_lm
    assert decoder_family(json.loads((path / "config.json").read_text())) == "gpt2"
    engine = voxbackend.load(path, kv_pages=64, page_size=4)
    assert engine.model.backbone.lm_head.weight is engine.model.backbone.embed.weight
    assert_paged_forward_matches(engine, ref, seed=0)
    prompts = [[5, 6, 7], list(range(3, 30))]
    got = engine.generate_ids(prompts, SamplingParams(temperature=0.0, max_tokens=8))
    for p, tokens in zip(prompts, got):
        want = ref.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=2,
                            pad_token_id=0)[0, len(p):].tolist()
        assert tokens == want
