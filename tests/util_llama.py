"""Tiny random Hugging Face Llama checkpoints for parity tests (GQA + Llama-3 RoPE scaling)."""
from __future__ import annotations

from pathlib import Path

import torch
import transformers


def tiny_llama_config(vocab: int = 512, max_pos: int = 512) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_pos,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )


def write_tiny_llama(out: Path, seed: int = 0, **kw) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(tiny_llama_config(**kw)).eval()
    # random init has tiny weights; scale up so logits are well separated and greedy ties never happen
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.save_pretrained(out, safe_serialization=True)
    return model
