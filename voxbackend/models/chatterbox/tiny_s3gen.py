"""Deterministic random weights for a tiny Chatterbox S3Gen (flow + HiFT), under the official names.

`tiny_s3gen(seed)` returns (s3gen.json, the `flow.*` + `mel2wav.*` tensors of s3gen.safetensors; with
`meanflow=True` those of s3gen_meanflow.safetensors). HiFT's weight-normed convs are stored as
`parametrizations.weight.original0/1` pairs, as the official file has them. The vocabulary stays 6561: the LM
emits S3 codes 0..6560.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from voxbackend.components.flow_hift.flow_matching import FlowMatching
from voxbackend.components.flow_hift.hift import HiFTGenerator, weight_norm_names
from voxbackend.models.chatterbox.s3gen import CONFIG_NAME, FLOW_PREFIX, HIFT_PREFIX, MEANFLOW_FILE, S3GEN_FILE, \
    SPEECH_TOKENS, s3gen_config
from voxbackend.models.tiny_weights import perturb_default_inits

TINY_CONFIG = {
    "flow": {
        "vocab_size": SPEECH_TOKENS,
        "encoder": {"size": 64, "heads": 2, "linear_units": 128, "num_blocks": 1, "num_up_blocks": 1},
        "estimator": {"channels": [64], "attention_head_dim": 16, "n_blocks": 1, "num_mid_blocks": 1, "num_heads": 2},
    },
    "hift": {"base_channels": 32, "f0_channels": 32},
}


def _weight_normed(state: dict[str, torch.Tensor], names: set[str], generator: torch.Generator) -> dict:
    """Plain conv weights -> (g, v) pairs: v = w, g = |w| per output channel, jittered so that a loader that skips
    folding g into v gives different audio."""
    out = {}
    for key, value in state.items():
        name = key.removesuffix(".weight")
        if key.endswith(".weight") and name in names:
            g = value.flatten(1).norm(dim=1).view(-1, *[1] * (value.ndim - 1))
            g = g * (1.0 + 0.1 * torch.randn(g.shape, generator=generator))
            out[f"{name}.parametrizations.weight.original0"] = g
            out[f"{name}.parametrizations.weight.original1"] = value.clone()
        else:
            out[key] = value.clone()
    return out


def tiny_s3gen(seed: int = 0, meanflow: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
    cfg = s3gen_config(TINY_CONFIG, meanflow)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        flow, hift = FlowMatching(cfg.flow), HiFTGenerator(cfg.hift)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        perturb_default_inits(flow, generator)
        perturb_default_inits(hift, generator)
        if meanflow:
            # upstream initialises the mixer to pass t through and ignore r: make r matter
            mixer = flow.decoder.estimator.time_embed_mixer.weight
            mixer.add_(0.05 * torch.randn(mixer.shape, generator=generator))
        # ISTFT log-magnitudes near 4 with small swings: audio around 0.1, rarely clipped
        half = cfg.hift.n_fft // 2 + 1
        hift.conv_post.weight.mul_(0.05)
        hift.conv_post.bias.zero_()
        hift.conv_post.bias[:half] = 4.0
        # |f0| spread around 20 Hz (the classifier's raw output sits near +0.07): voiced (> 10 Hz) and unvoiced
        # frames both occur
        hift.f0_predictor.classifier.weight.mul_(1000.0)
        hift.f0_predictor.classifier.bias.fill_(-50.0)
    state = {FLOW_PREFIX + k: v.clone() for k, v in flow.state_dict().items()}
    hift_state = _weight_normed(hift.state_dict(), set(weight_norm_names(cfg.hift)), generator)
    state.update({HIFT_PREFIX + k: v for k, v in hift_state.items()})
    return TINY_CONFIG, state


def write_tiny_s3gen(out: str | Path, seed: int = 0, meanflow: bool = False) -> Path:
    """out/s3gen.json + out/s3gen.safetensors (Turbo: s3gen_meanflow.safetensors)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config, state = tiny_s3gen(seed, meanflow)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / (MEANFLOW_FILE if meanflow else S3GEN_FILE)))
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=1))
    return out
