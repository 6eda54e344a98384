"""A deterministic random-weight glm-4-voice-decoder folder: flow.pt and hift.pt under upstream's names (HiFT's convs
weight-normed as upstream stores them) and our codec.json with the tiny sizes (the released folder has none: its
sizes are CodecConfig's defaults). The block schedule is the released one.

    python -m voxbackend.models.glm4_voice.tiny_decoder --out DIR [--seed N]
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from voxbackend.components.flow_hift.conformer_encoder import ConformerConfig
from voxbackend.components.flow_hift.hift import HiFTGenerator, weight_norm_pairs
from voxbackend.components.flow_hift.unet_estimator import UNetConfig
from voxbackend.components.flow_hift.xvec_flow import XvecFlow, XvecFlowConfig
from voxbackend.models.glm4_voice.codec import GLM4_VOICE_HIFT, CodecConfig
from voxbackend.models.tiny_weights import perturb_default_inits

TINY = CodecConfig(
    flow=XvecFlowConfig(encoder=ConformerConfig(size=64, heads=2, linear_units=64, num_blocks=2),
                        decoder=UNetConfig(channels=(32, 32), attention_head_dim=16, n_blocks=1, num_mid_blocks=1,
                                           num_heads=2)),
    hift=replace(GLM4_VOICE_HIFT, base_channels=32, f0_channels=32))


def tiny_states(seed: int = 0, cfg: CodecConfig = TINY) -> tuple[dict, dict]:
    """(flow state, plain HiFT state): random weights, norms and biases away from their inits; HiFT's output set
    so the audio sits around 0.1 with voiced and unvoiced frames."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        flow, hift = XvecFlow(cfg.flow), HiFTGenerator(cfg.hift)
    generator = torch.Generator().manual_seed(seed + 1)
    perturb_default_inits(flow, generator)
    perturb_default_inits(hift, generator)
    with torch.no_grad():
        half = cfg.hift.n_fft // 2 + 1  # ISTFT log-magnitudes near 4 with small swings
        hift.conv_post.weight.mul_(0.05)
        hift.conv_post.bias.zero_()
        hift.conv_post.bias[:half] = 4.0
        hift.f0_predictor.classifier.weight.mul_(2000.0)  # f0 around 60 Hz with wide swings
        hift.f0_predictor.classifier.bias.fill_(60.0)
    return dict(flow.state_dict()), dict(hift.state_dict())


def write_tiny_decoder(out: str | Path, seed: int = 0, cfg: CodecConfig = TINY) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    flow, hift = tiny_states(seed, cfg)
    torch.save(flow, out / "flow.pt")
    torch.save(weight_norm_pairs(hift, cfg.hift), out / "hift.pt")
    (out / CodecConfig.CONFIG_NAME).write_text(json.dumps(cfg.to_dict(), indent=1) + "\n")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(write_tiny_decoder(args.out, args.seed))


if __name__ == "__main__":
    main()
