"""Tiny random Hugging Face Qwen2 / Qwen3 causal LMs for parity tests of the generic decoder.

Every parameter is redrawn (biases and norm weights too, which transformers initialises to 0 and 1), so a bias
or a q/k norm that is dropped or swapped on load changes the logits."""
from __future__ import annotations

from pathlib import Path

import torch
import transformers

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)

FAMILIES = {
    # Qwen2: q/k/v bias (no o bias), plain RoPE theta 1e6, tied head
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(rope_theta=1e6, tie_word_embeddings=True)),
    # Qwen3: per-head q/k RMSNorm, head_dim not hidden / heads, attention_bias (q/k/v and o), untied head
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              dict(head_dim=24, attention_bias=True, rope_theta=1e6, tie_word_embeddings=False)),
}


def write_tiny_decoder(family: str, out: Path, seed: int = 0) -> transformers.PreTrainedModel:
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**COMMON, **extra)).eval()
    randomize(model, seed + 1)
    model.save_pretrained(out, safe_serialization=True)
    return model


def randomize(model: torch.nn.Module, seed: int, unit_embeddings: bool = False) -> None:
    """Redraw every parameter (biases and norm weights too), so a weight loaded in the wrong place changes the
    logits. unit_embeddings: embedding tables at std 1 instead of the matrices' scale."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) * 0.5 + 0.75)
            elif p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif unit_embeddings and "embedding" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:  # well-separated logits: greedy never meets a near-tie that rounding could flip
                p.copy_(torch.randn(p.shape, generator=g) * 1.5 * p.shape[-1] ** -0.5)
