"""A deterministic random-weight CosyVoice2 detokenizer checkpoint (flow + HiFT), in the official layout.

    python -m voxbackend.models.cosyvoice2.tiny_codec --out DIR [--seed N]

writes DIR/flow.pt and DIR/hift.pt (state dicts under the upstream module names, HiFT's weight-normed convs as
`parametrizations.weight.original0/1` pairs, so the upstream classes load them with strict=True) and
DIR/token2wav.json (the shrunken sizes; anything not listed keeps CosyVoice2-0.5B's value).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from voxbackend.components.flow_hift.flow_matching import FlowMatching
from voxbackend.components.flow_hift.hift import HiFTGenerator, weight_norm_names
from voxbackend.components.flow_hift.token2wav import Token2WavConfig
from voxbackend.models.tiny_weights import perturb_default_inits

TINY_CONFIG = {
    "flow": {
        "vocab_size": 300,
        # the reference hard-codes width 512 in its lookahead and upsample layers, so only depth shrinks
        "encoder": {"size": 512, "heads": 8, "linear_units": 128, "num_blocks": 1, "num_up_blocks": 4},
        "estimator": {"channels": [64], "attention_head_dim": 16, "n_blocks": 1, "num_mid_blocks": 2, "num_heads": 2},
    },
    "hift": {"base_channels": 32, "f0_channels": 32},
}


def tiny_state_dicts(seed: int = 0, vocab_size: int | None = None) -> tuple[Token2WavConfig, dict, dict]:
    """`vocab_size`: the flow's token table (None: TINY_CONFIG's; a whole tiny CosyVoice2 needs the real 6561)."""
    config = (TINY_CONFIG if vocab_size is None
              else {**TINY_CONFIG, "flow": {**TINY_CONFIG["flow"], "vocab_size": vocab_size}})
    cfg = Token2WavConfig.from_dict(config)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        flow, hift = FlowMatching(cfg.flow), HiFTGenerator(cfg.hift)
    generator = torch.Generator().manual_seed(seed + 1)
    perturb_default_inits(flow, generator)
    perturb_default_inits(hift, generator)
    with torch.no_grad():
        # ISTFT log-magnitudes near 4 with small swings: audio around 0.1, rarely at the clipping limit
        half = cfg.hift.n_fft // 2 + 1
        hift.conv_post.weight.mul_(0.05)
        hift.conv_post.bias.zero_()
        hift.conv_post.bias[:half] = 4.0
        # f0 around 60 Hz with wide swings, so both voiced (> 10 Hz) and unvoiced frames occur
        hift.f0_predictor.classifier.weight.mul_(2000.0)
        hift.f0_predictor.classifier.bias.fill_(60.0)
    flow_state = {k: v.clone() for k, v in flow.state_dict().items()}
    hift_state = {}
    plain = hift.state_dict()
    normed = set(weight_norm_names(cfg.hift))
    for key, value in plain.items():
        name = key.removesuffix(".weight")
        if key.endswith(".weight") and name in normed:
            # store (g, v): v = w and g = |w| per output channel, jittered so that folding g into v is tested
            g = value.flatten(1).norm(dim=1).view(-1, *[1] * (value.ndim - 1))
            g = g * (1.0 + 0.1 * torch.randn(g.shape, generator=generator))
            hift_state[f"{name}.parametrizations.weight.original0"] = g.clone()
            hift_state[f"{name}.parametrizations.weight.original1"] = value.clone()
        else:
            hift_state[key] = value.clone()
    return cfg, flow_state, hift_state


def write_tiny_codec(out: str | Path, seed: int = 0, vocab_size: int | None = None) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg, flow_state, hift_state = tiny_state_dicts(seed, vocab_size)
    torch.save(flow_state, out / "flow.pt")
    torch.save(hift_state, out / "hift.pt")
    (out / Token2WavConfig.CONFIG_NAME).write_text(json.dumps(cfg.to_dict(), indent=1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_tiny_codec(args.out, args.seed))


if __name__ == "__main__":
    main()
