"""Tiny random Mimi codec checkpoints in the Hugging Face `MimiModel` layout (config.json + model.safetensors).

    python -m voxbackend.components.mimi.tiny --out DIR [--seed N] [--size tiny|full]

The tiny size keeps the real structure and timing: 24 kHz, ratios [8, 6, 5, 4] (960-sample SEANet hop at 25 Hz,
a stride-2 upsample to 12.5 Hz codec frames, so 1920 samples per frame), 32 codebooks of 2048 (1 semantic + 31
acoustic), causal convs and a sliding-window decoder transformer. Only the widths shrink, and the window is 10
steps (5 frames) instead of 250 so short tests already run past it. `full` is kyutai/mimi's geometry.

HF's own init leaves every codebook at zero and the layer scales at 0.01, which would hide bugs in the
quantizer and the transformer, so the codebooks, cluster usages, layer scales and transformer weights are redrawn,
and the last conv is scaled so that random codes decode to audio peaking near 1.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

SIZES = {
    "tiny": dict(hidden_size=64, num_filters=4, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                 intermediate_size=128, vector_quantization_hidden_dimension=16, codebook_dim=16, sliding_window=10),
    "full": dict(),  # MimiConfig defaults are kyutai/mimi's
}


def write_tiny_mimi(out_dir: str | Path, seed: int = 0, size: str = "tiny", **overrides) -> Path:
    from transformers import MimiConfig, MimiModel

    kw = dict(SIZES[size])
    kw.update(overrides)
    kw.setdefault("upsample_groups", kw.get("hidden_size", 512))  # channel-wise upsample, as kyutai/mimi
    kw.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(seed)
    model = MimiModel(MimiConfig(**kw)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in model.named_buffers():
            if name.endswith("embed_sum"):
                t.copy_(torch.randn(t.shape, generator=g))
            elif name.endswith("cluster_usage"):
                t.copy_(torch.rand(t.shape, generator=g) * 1.5 + 0.5)
        for name, p in model.named_parameters():
            if "transformer" not in name:
                continue
            if name.endswith("layer_scale.scale"):
                p.copy_(torch.rand(p.shape, generator=g) * 0.8 + 0.2)
            elif "proj" in name or ".fc" in name:  # std 1/sqrt(fan_in): attention that is far from uniform
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        # scale the last conv so random codes give audio peaking near 1, as real speech does: an absolute
        # tolerance in tests then means what it says
        codes = torch.randint(0, model.config.codebook_size, (1, model.config.num_quantizers, 8), generator=g)
        peak = model.decode(codes).audio_values.abs().max()
        last = [m for n, m in model.named_modules() if n.startswith("decoder") and isinstance(m, torch.nn.Conv1d)][-1]
        last.weight.div_(peak)
        last.bias.div_(peak)
    out = Path(out_dir)
    model.save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    args = ap.parse_args()
    print(write_tiny_mimi(args.out, seed=args.seed, size=args.size))


if __name__ == "__main__":
    main()
