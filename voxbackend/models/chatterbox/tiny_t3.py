"""Deterministic random weights for a tiny Chatterbox T3 LM (Llama backbone, hidden 64) under upstream's names.

`tiny_t3(seed)` returns (the Llama config dict, the t3_cfg state dict). Everything but the backbone's width keeps
the official shapes: 704 text ids, 8194 speech ids, 2050 text and 4100 speech positions, 32 perceiver queries, a
256-d speaker input; text_head and tfmr.embed_tokens are there too (unused, as upstream's checkpoint has them).
"""
from __future__ import annotations

import torch

from voxbackend.models.chatterbox.perceiver import QUERIES
from voxbackend.models.chatterbox.t3_lm import LLAMA_520M, SPEAKER_EMBED, SPEECH_VOCAB, STOP_SPEECH, TEXT_VOCAB

TINY_LLAMA = {**LLAMA_520M, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16, "torch_dtype": "float32"}
TEXT_POSITIONS = 2048 + 2  # upstream: max_text_tokens + 2
SPEECH_POSITIONS = 4096 + 4  # upstream: max_speech_tokens + 2 + 2
GAIN = 1.5  # matrices a bit above unit gain: sharper logits, so greedy decoding meets no near-ties
# the stop token's head row scaled up: random weights then end most greedy streams within ~10-120 tokens (rarely
# at once) instead of almost never
STOP_GAIN = 1.75


def shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape, in the (fixed) order they are drawn."""
    h, inner, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    q, kv = heads * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    out: dict[str, tuple[int, ...]] = {"tfmr.embed_tokens.weight": (cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"tfmr.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "mlp.gate_proj.weight": (inner, h), p + "mlp.up_proj.weight": (inner, h),
                    p + "mlp.down_proj.weight": (h, inner),
                    p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
    out["tfmr.norm.weight"] = (h,)
    out.update({"cond_enc.spkr_enc.weight": (h, SPEAKER_EMBED), "cond_enc.spkr_enc.bias": (h,),
                "cond_enc.perceiver.pre_attention_query": (1, QUERIES, h),
                "cond_enc.perceiver.attn.norm.weight": (h,), "cond_enc.perceiver.attn.norm.bias": (h,)})
    for proj in ("to_q", "to_k", "to_v", "proj_out"):
        out[f"cond_enc.perceiver.attn.{proj}.weight"] = (h, h)
        out[f"cond_enc.perceiver.attn.{proj}.bias"] = (h,)
    out.update({"cond_enc.emotion_adv_fc.weight": (h, 1),
                "text_emb.weight": (TEXT_VOCAB, h), "speech_emb.weight": (SPEECH_VOCAB, h),
                "text_pos_emb.emb.weight": (TEXT_POSITIONS, h), "speech_pos_emb.emb.weight": (SPEECH_POSITIONS, h),
                "text_head.weight": (TEXT_VOCAB, h), "speech_head.weight": (SPEECH_VOCAB, h)})
    return out


def draw(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    if len(shape) == 1 and (name.endswith("norm.weight") or "layernorm" in name):
        return 1.0 + 0.2 * torch.randn(shape, generator=g)  # norm scales away from 1: a skipped one shows
    if len(shape) == 1:
        return 0.1 * torch.randn(shape, generator=g)  # biases away from 0
    if name.endswith("emb.weight") or "embed_tokens" in name:
        # token and position rows at comparable scales, so a wrong index moves the output visibly
        return (0.5 if "pos_emb" in name else 1.0) * torch.randn(shape, generator=g)
    if "pre_attention_query" in name:
        return torch.randn(shape, generator=g)
    return GAIN * torch.randn(shape, generator=g) * shape[1] ** -0.5  # [out, in]: fan-in scaled


def tiny_t3(seed: int = 0) -> tuple[dict, dict[str, torch.Tensor]]:
    cfg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in TINY_LLAMA.items()}
    g = torch.Generator().manual_seed(seed)
    weights = {name: draw(name, shape, g) for name, shape in shapes(cfg).items()}
    weights["speech_head.weight"][STOP_SPEECH] *= STOP_GAIN
    return cfg, weights
