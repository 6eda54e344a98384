"""A deterministic random-weight CosyVoice2 voice-cloning front end checkpoint (S3 tokenizer v2 + CAMPPlus).

    python -m voxbackend.models.cosyvoice2.tiny_cloning --out DIR [--seed N]

writes DIR/speech_tokenizer_v2.safetensors and DIR/campplus.safetensors (the reference torch classes' names, so
`s3tokenizer`'s S3TokenizerV2 and the CAMPPlus class load them with strict=True) and DIR/frontend.json (the
shrunken sizes). The tokenizer keeps 64-wide heads (its rotary table) and CAMPPlus its 32-channel 2-D front and
12/24/16-layer blocks (both fixed in the reference classes); widths shrink.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from voxbackend.models.cosyvoice2.cloning import VoiceCloner, ClonerConfig, load_voice_cloner
from voxbackend.components.speaker.campplus import CAMPPlus
from voxbackend.components.s3_tokenizer import S3TokenizerV2
from voxbackend.models.tiny_weights import perturb_default_inits

TINY_CONFIG = {
    "tokenizer": {"hidden": 128, "heads": 2, "layers": 2},
    "speaker": {"growth_rate": 8, "bn_size": 2, "init_channels": 32},
}


def tiny_state_dicts(seed: int = 0) -> tuple[ClonerConfig, dict, dict]:
    cfg = ClonerConfig.from_dict(TINY_CONFIG)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        tokenizer, speaker = S3TokenizerV2(cfg.tokenizer), CAMPPlus(cfg.speaker)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        perturb_default_inits(tokenizer, generator)
        perturb_default_inits(speaker, generator)
        # spread the 8 quantiser projections over all three levels, so tokens cover much of the 6561 codes
        tokenizer.quantizer._codebook.project_down.weight.mul_(8.0)
        # eval-mode BatchNorm does not renormalise: torch's default conv init would shrink the signal ~60 times
        # over; He init (the reference class's own) keeps it, so the embedding depends on the input
        for module in speaker.modules():
            if isinstance(module, (torch.nn.Conv1d, torch.nn.Conv2d)):
                torch.nn.init.kaiming_normal_(module.weight, generator=generator)
    return cfg, dict(tokenizer.state_dict()), dict(speaker.state_dict())


def write_tiny_cloner(out: str | Path, seed: int = 0) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _, tokenizer_state, speaker_state = tiny_state_dicts(seed)
    save_file({k: v.contiguous() for k, v in tokenizer_state.items()}, str(out / "speech_tokenizer_v2.safetensors"))
    save_file({k: v.contiguous() for k, v in speaker_state.items()}, str(out / "campplus.safetensors"))
    (out / ClonerConfig.CONFIG_NAME).write_text(json.dumps(TINY_CONFIG, indent=2))
    return out


def load_tiny_cloner(out: str | Path, seed: int = 0) -> VoiceCloner:
    return load_voice_cloner(write_tiny_cloner(out, seed))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_tiny_cloner(args.out, args.seed))


if __name__ == "__main__":
    main()
