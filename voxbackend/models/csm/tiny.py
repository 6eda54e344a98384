"""A tiny random CSM-1B-architecture checkpoint in the Hugging Face `sesame/csm-1b` layout.

    python -m voxbackend.models.csm.tiny --out DIR [--seed N]

config.json (backbone + depth_decoder_config + codec_config), model.safetensors (with the tiny Mimi codec under
`codec_model.*`), and a locally built Llama-3 style tokenizer.json. Weights are redrawn at unit scale (std
1/sqrt(fan_in) for projections) and the heads scaled so logits spread over tens of units: greedy decoding then never
meets a near-tie that float rounding could flip between two implementations.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from voxbackend.models.checkpoint_cache import build_once, cache_root
from voxbackend.models.tiny_tokenizer import write_tokenizer
from voxbackend.components.mimi.tiny import write_tiny_mimi

ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "high_freq_factor": 4.0,
        "low_freq_factor": 1.0, "original_max_position_embeddings": 2048}
BACKBONE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=2048)
DEPTH = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=33)
HEAD_LOGIT_STD = 10.0


def write_tiny_csm(out_dir: str | Path, seed: int = 0) -> Path:
    from transformers import CsmConfig, CsmForConditionalGeneration, MimiModel

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        mimi = MimiModel.from_pretrained(write_tiny_mimi(tmp, seed=seed))
    config = CsmConfig(
        **BACKBONE, rope_parameters=dict(ROPE),
        depth_decoder_config=dict(DEPTH, backbone_hidden_size=BACKBONE["hidden_size"], rope_parameters=dict(ROPE)),
        codec_config=mimi.config.to_dict(),
    )
    torch.manual_seed(seed)
    model = CsmForConditionalGeneration(config).eval()
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        model.codec_model.load_state_dict(mimi.state_dict())
        for name, p in model.named_parameters():
            if name.startswith("codec_model."):
                continue
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) * 0.5 + 0.75)
            elif name in ("lm_head.weight", "depth_decoder.codebooks_head.weight"):
                fan_in = p.shape[-1] if name == "lm_head.weight" else p.shape[-2]
                p.copy_(torch.randn(p.shape, generator=g) * HEAD_LOGIT_STD * fan_in**-0.5)
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    model.save_pretrained(out)
    write_tokenizer(out)
    return out


def ensure_default_csm(root: str | Path | None = None) -> tuple[Path, None]:
    """(model_dir, None): the tiny CSM the `csm` Triton models serve when no checkpoint is configured.

    Built once into `<VOXBACKEND_CACHE>-csm` (default ~/.cache/voxbackend/default-csm), next to the Orpheus
    default, through a temporary folder and an atomic rename; reused afterwards. The Mimi codec is inside
    the checkpoint (codec_model.*), so there is no codec folder.
    """
    root = cache_root("-csm") if root is None else root
    return build_once(root, lambda out: write_tiny_csm(out / "csm", seed=0)) / "csm", None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(write_tiny_csm(args.out, seed=args.seed))


if __name__ == "__main__":
    main()
