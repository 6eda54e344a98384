"""The generic decoder with GLM-4's parts (q/k/v bias, fused gate/up, RoPE on half of each head in interleaved
pairs, head_dim from the config, untied head, several end ids) equals transformers' GlmForCausalLM through the
paged attention (prefill, chunked prefill, decode; greedy tokens), loaded from GlmForCausalLM's names and from
GLM-4's own ChatGLM layout (GLM-4-Voice-9B's: fused query_key_value, `transformer.encoder.*`, a chatglm config)."""
import dataclasses
import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

import voxbackend
from voxbackend import SamplingParams
from voxbackend.models.decoder import DecoderConfig, decoder_family, rope_inv_freq
from tests.util_decoder import randomize
from tests.util_paged import assert_paged_forward_matches

pytestmark = pytest.mark.usefixtures("one_thread")

EOS = [2, 305]  # several end ids, as GLM-4's three; 305 ends one greedy reply below
# head_dim 32, not hidden / heads; RoPE on its first 16 dims; theta 10000 * rope_ratio 50 in the ChatGLM config
GLM = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
           rope_parameters={"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.5},
           attention_bias=True, tie_word_embeddings=False, pad_token_id=0, eos_token_id=EOS)
CHATGLM = dict(architectures=["ChatGLMModel"], model_type="chatglm", padded_vocab_size=512, hidden_size=64,
               ffn_hidden_size=96, num_layers=2, num_attention_heads=4, multi_query_attention=True,
               multi_query_group_num=2, kv_channels=32, seq_length=256, layernorm_epsilon=1e-6, rope_ratio=50,
               add_qkv_bias=True, add_bias_linear=False, rmsnorm=True, post_layer_norm=True,
               apply_residual_connection_post_layernorm=False, original_rope=True, tie_word_embeddings=False,
               pad_token_id=0, eos_token_id=EOS)


def write_chatglm(ref: transformers.GlmForCausalLM, out) -> None:
    """The same weights under GLM-4's own names (q/k/v one matrix, gate/up one matrix) with a chatglm config."""
    sd = ref.state_dict()
    w = {"transformer.embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
         "transformer.encoder.final_layernorm.weight": sd["model.norm.weight"],
         "transformer.output_layer.weight": sd["lm_head.weight"],
         # a buffer the official checkpoint carries: not a weight of ours
         "transformer.rotary_pos_emb.inv_freq": torch.ones(8)}
    for i in range(GLM["num_hidden_layers"]):
        a, b = f"model.layers.{i}.", f"transformer.encoder.layers.{i}."
        for param in ("weight", "bias"):
            w[f"{b}self_attention.query_key_value.{param}"] = torch.cat(
                [sd[f"{a}self_attn.{x}_proj.{param}"] for x in "qkv"])
        w[b + "self_attention.dense.weight"] = sd[a + "self_attn.o_proj.weight"]
        w[b + "mlp.dense_h_to_4h.weight"] = sd[a + "mlp.gate_up_proj.weight"]
        w[b + "mlp.dense_4h_to_h.weight"] = sd[a + "mlp.down_proj.weight"]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            w[f"{b}{norm}.weight"] = sd[f"{a}{norm}.weight"]
    save_file({k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(CHATGLM))


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """(ref, GlmForCausalLM folder, ChatGLM-layout folder) of one set of random weights."""
    torch.manual_seed(3)
    ref = transformers.GlmForCausalLM(transformers.GlmConfig(**GLM)).eval()
    randomize(ref, 4)  # biases and norm weights too
    hf, chatglm = tmp_path_factory.mktemp("glm"), tmp_path_factory.mktemp("chatglm")
    ref.save_pretrained(hf, safe_serialization=True)
    write_chatglm(ref, chatglm)
    return ref, hf, chatglm


def test_config_and_family(glm):
    ref, hf, _ = glm
    cfg = DecoderConfig.from_hf(json.loads((hf / "config.json").read_text()))
    assert (cfg.head_dim, cfg.rotary_dim, cfg.rope_interleaved, cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias,
            cfg.tie_word_embeddings) == (32, 16, True, True, False, False, False)
    assert torch.allclose(rope_inv_freq(cfg), ref.model.rotary_emb.inv_freq, rtol=1e-6)
    # the ChatGLM config names the same layer: all equal but the rope dict GLM's config carries
    assert DecoderConfig.from_hf(CHATGLM) == dataclasses.replace(cfg, rope_scaling=None)
    # transformers < 5 wrote partial_rotary_factor beside rope_theta; GLM's default is half the head
    old = {**GLM, "model_type": "glm", "rope_parameters": None, "rope_theta": 5e5}
    assert DecoderConfig.from_hf(old).rotary_dim == 16
    assert DecoderConfig.from_hf({**old, "partial_rotary_factor": 0.25}).rotary_dim == 8
    assert decoder_family({"architectures": ["GlmForCausalLM"], "model_type": "glm"}) == "glm"
    assert decoder_family({"architectures": None, "model_type": "glm"}) == "glm"
    assert decoder_family(CHATGLM) == "chatglm"
    assert decoder_family({"architectures": ["ChatGLMForConditionalGeneration"], "model_type": "chatglm"}) == "chatglm"


@pytest.mark.parametrize("layout", ["hf", "chatglm"])
def test_paged_forward_matches_transformers(glm, layout):
    ref, hf, chatglm = glm
    engine = voxbackend.load(hf if layout == "hf" else chatglm, kv_pages=64, page_size=4)
    assert engine.model.spec.name == {"hf": "glm", "chatglm": "chatglm"}[layout]
    assert engine.model.spec.stop_ids == tuple(EOS)
    assert_paged_forward_matches(engine, ref, seed=0)


def test_greedy_tokens_equal_generate(glm):
    ref, hf, _ = glm
    engine = voxbackend.load(hf, max_batch=4, page_size=4, kv_pages=64)
    prompts = [[5, 6, 8], list(range(3, 20)), [9] * 5]
    got = engine.generate_ids(prompts, SamplingParams(temperature=0.0, max_tokens=8))
    for p, tokens in zip(prompts, got):
        want = ref.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=EOS,
                            pad_token_id=0)[0, len(p):].tolist()
        assert tokens == want, p
    assert got[1][-1] == EOS[1] and len(got[1]) < 8  # a reply ends on the second end id


def test_unservable_configs_are_refused():
    yarn = {**GLM, "model_type": "glm", "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'yarn'"):
        rope_inv_freq(DecoderConfig.from_hf(yarn))
    with pytest.raises(ValueError, match="rmsnorm=False"):
        DecoderConfig.from_hf({**CHATGLM, "rmsnorm": False})
    with pytest.raises(ValueError, match="apply_residual_connection_post_layernorm=True"):
        DecoderConfig.from_hf({**CHATGLM, "apply_residual_connection_post_layernorm": True})
    first_chatglm = {k: v for k, v in CHATGLM.items() if k != "padded_vocab_size"}
    with pytest.raises(ValueError, match="padded_vocab_size"):
        DecoderConfig.from_hf(first_chatglm)
