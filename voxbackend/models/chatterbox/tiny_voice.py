"""Deterministic random weights for a tiny Chatterbox voice front end: VoiceEncoder, S3 tokenizer and CAMPPlus.

`tiny_voice(seed)` returns (voice.json, ve.safetensors state dict, the `tokenizer.*` + `speaker_encoder.*`
tensors to merge into s3gen.safetensors), all under upstream names. The tokenizer and CAMPPlus are CosyVoice2's
tiny front end (voxbackend.models.cosyvoice2.tiny_cloning: same classes, same weights in Chatterbox's s3gen);
the VoiceEncoder keeps its 40 mels and 256-d output (T3's speaker projection reads 256) and shrinks its LSTM.
"""
from __future__ import annotations

import torch

from voxbackend.models.chatterbox.voice import SPEAKER_PREFIX, TOKENIZER_PREFIX, VoiceConfig
from voxbackend.models.chatterbox.voice_encoder import VoiceEncoder
from voxbackend.models.cosyvoice2.tiny_cloning import TINY_CONFIG as TINY_FRONTEND, tiny_state_dicts
from voxbackend.models.tiny_weights import perturb_default_inits

TINY_VOICE_ENCODER = {"hidden": 64}
INPUT_GAIN = 30.0


def tiny_voice(seed: int = 0) -> tuple[dict, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    config = {"voice_encoder": dict(TINY_VOICE_ENCODER), **{k: dict(v) for k, v in TINY_FRONTEND.items()}}
    cfg = VoiceConfig.from_dict(config)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        encoder = VoiceEncoder(cfg.voice_encoder)
    with torch.no_grad():
        perturb_default_inits(encoder, torch.Generator().manual_seed(seed + 1))
        # its mels are raw power (speech: mostly far under 1): at the default init scale the biases drown them
        encoder.lstm.weight_ih_l0.mul_(INPUT_GAIN)
    _, tokenizer, speaker = tiny_state_dicts(seed)
    s3gen = {**{TOKENIZER_PREFIX + k: v for k, v in tokenizer.items()},
             **{SPEAKER_PREFIX + k: v for k, v in speaker.items()}}
    return config, {k: v.clone() for k, v in encoder.state_dict().items()}, s3gen
