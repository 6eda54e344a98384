"""Deterministic random-weight checkpoints in the Hugging Face layout (no network, no real weights).

    python -m voxbackend.models.orpheus.tiny --out DIR [--seed N] [--size tiny|bench]

writes DIR/orpheus (LlamaForCausalLM + Llama-3 style tokenizer with Orpheus' custom audio tokens) and
DIR/snac_24khz (the published snac_24khz layout with a smaller decoder_dim).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from voxbackend.models.checkpoint_cache import build_once, cache_root
from voxbackend.models.tiny_tokenizer import BOS_ID, EOT_ID, ORPHEUS_VOCAB, write_tokenizer

SIZES = {
    "tiny": dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384),
    # big enough that the model, not Python overhead, dominates a CPU decode step
    "bench": dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536),
}

SNAC_24KHZ_CONFIG = {  # as published in hubertsiuzdak/snac_24khz
    "sampling_rate": 24000, "encoder_dim": 48, "encoder_rates": [2, 4, 8, 8], "decoder_dim": 1024,
    "decoder_rates": [8, 8, 4, 2], "attn_window_size": None, "codebook_size": 4096, "codebook_dim": 8,
    "vq_strides": [4, 2, 1], "noise": True, "depthwise": True,
}

def orpheus_config(hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                   intermediate_size: int, max_position_embeddings: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": ORPHEUS_VOCAB,
        "hidden_size": hidden_size, "intermediate_size": intermediate_size, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads, "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings, "initializer_range": 0.02, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "pretraining_tp": 1,
        "tie_word_embeddings": True, "bos_token_id": BOS_ID, "eos_token_id": EOT_ID, "use_cache": True,
        "torch_dtype": "float32",
    }


def write_tiny_orpheus(out_dir: str | Path, seed: int = 0, hidden_size: int = 128, num_layers: int = 4,
                       num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 384,
                       max_position_embeddings: int = 8192) -> Path:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg_dict = orpheus_config(hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size,
                              max_position_embeddings)
    config = LlamaConfig(**{k: v for k, v in cfg_dict.items() if k not in ("model_type", "torch_dtype")})
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().eval()
    model.save_pretrained(out)
    # our config.json, not transformers' (keeps the Llama-3.2 field set stable across transformers versions)
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2))
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=[128258, EOT_ID], do_sample=True, temperature=0.6,
                     top_p=0.8, repetition_penalty=1.3, max_new_tokens=1200).save_pretrained(out)
    write_tokenizer(out)
    return out


def write_tiny_snac(out_dir: str | Path, seed: int = 0, decoder_dim: int = 64) -> Path:
    from snac import SNAC  # the reference package: its state_dict is exactly the published layout

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = dict(SNAC_24KHZ_CONFIG, decoder_dim=decoder_dim)
    torch.manual_seed(seed)
    model = SNAC(**config)
    sd = {}
    for k, v in model.state_dict().items():  # new parametrization names -> published weight_g / weight_v
        k = k.replace(".parametrizations.weight.original0", ".weight_g")
        k = k.replace(".parametrizations.weight.original1", ".weight_v")
        sd[k] = v.detach().clone().contiguous()
    torch.save(sd, out / "pytorch_model.bin")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def write_default(out_dir: str | Path, seed: int = 0, size: str = "tiny") -> tuple[Path, Path]:
    out = Path(out_dir)
    model_dir = write_tiny_orpheus(out / "orpheus", seed=seed, **SIZES[size])
    codec_dir = write_tiny_snac(out / "snac_24khz", seed=seed)
    return model_dir, codec_dir


def ensure_default_checkpoint(root: str | Path | None = None, size: str = "tiny") -> tuple[Path, Path]:
    """(model_dir, codec_dir) under root (default the cache root); built once, reused afterwards."""
    root = build_once(cache_root() if root is None else root, lambda out: write_default(out, seed=0, size=size))
    return root / "orpheus", root / "snac_24khz"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    args = ap.parse_args(argv)
    model_dir, codec_dir = write_default(args.out, seed=args.seed, size=args.size)
    print(model_dir)
    print(codec_dir)


if __name__ == "__main__":
    main()
