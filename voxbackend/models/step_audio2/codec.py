"""Step-Audio 2's speech out: the checkpoint's token2wav folder as the model's codec, and its voices.

`token2wav/` holds the official `flow.pt` (the DiT flow's state dict) and `hift.pt` (the HiFT vocoder's, its keys
under `generator.`); an optional `token2wav.json` of ours overrides sizes (the tiny checkpoint's; the defaults are
the real model's). Upstream speaks with a prompt clip's speech tokens, mel and speaker vector; here a voice is those
three, precomputed, in `voices/<name>.safetensors` (the layout CosyVoice2's voices use: `speech_tokens`,
`speech_feat`, `embedding`).

A request's codec state (`ReplyAudio`) collects the reply's audio ids as they come and decodes them the way a
complete reply is cut (dit_token2wav.split_chunks): 25 new tokens plus 3 of lookahead a chunk, 1 s of audio, and
the rest without lookahead once the reply has ended. So a reply's audio does not depend on timing.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import torch

from voxbackend.components.flow_hift.dit_estimator import DiTConfig
from voxbackend.components.flow_hift.dit_flow import DiTFlow, DiTFlowConfig
from voxbackend.components.flow_hift.dit_token2wav import (DiTToken2Wav, DiTToken2WavConfig, DiTToken2WavState,
                                                           VoicePrompt)
from voxbackend.components.flow_hift.flow_encoder import EncoderConfig
from voxbackend.components.flow_hift.hift import HiFTConfig, HiFTGenerator, fold_weight_norm

CODEC_FOLDER = "token2wav"
CONFIG_NAME = "token2wav.json"
VOICES_FOLDER = "voices"
DEFAULT_VOICE = "default"


def _build(kind, data: dict):
    """A (nested) frozen config dataclass from a dict; list values become tuples."""
    nested = {"encoder": EncoderConfig, "estimator": DiTConfig, "flow": DiTFlowConfig, "hift": HiFTConfig,
              "stream": DiTToken2WavConfig}
    names = {f.name for f in fields(kind)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"unknown {kind.__name__} keys in {CONFIG_NAME}: {sorted(unknown)}")
    kwargs = {}
    for key, value in data.items():
        if key in nested and isinstance(value, dict):
            value = _build(nested[key], value)
        elif isinstance(value, list):
            value = tuple(tuple(v) if isinstance(v, list) else v for v in value)
        kwargs[key] = value
    return kind(**kwargs)


@dataclass(frozen=True)
class CodecConfig:
    flow: DiTFlowConfig = field(default_factory=DiTFlowConfig)
    hift: HiFTConfig = field(default_factory=HiFTConfig)
    stream: DiTToken2WavConfig = field(default_factory=DiTToken2WavConfig)

    @classmethod
    def from_dict(cls, data: dict) -> "CodecConfig":
        return _build(cls, data)


def codec_config(model_dir: str | Path) -> CodecConfig:
    config_file = Path(model_dir) / CODEC_FOLDER / CONFIG_NAME
    return CodecConfig.from_dict(json.loads(config_file.read_text())) if config_file.is_file() else CodecConfig()


def load_codec(model_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> DiTToken2Wav:
    folder = Path(model_dir) / CODEC_FOLDER
    if not (folder / "flow.pt").is_file() or not (folder / "hift.pt").is_file():
        raise FileNotFoundError(f"no {CODEC_FOLDER}/flow.pt and hift.pt in {model_dir}: Step-Audio 2 speaks with them")
    cfg = codec_config(model_dir)
    flow = DiTFlow(cfg.flow)
    flow.load_state_dict(torch.load(folder / "flow.pt", map_location="cpu", weights_only=True), strict=True)
    hift_state = torch.load(folder / "hift.pt", map_location="cpu", weights_only=True)
    hift = HiFTGenerator(cfg.hift)
    hift.load_state_dict(fold_weight_norm({k.removeprefix("generator."): v for k, v in hift_state.items()},
                                          cfg.hift), strict=True)
    # the flow in the model's dtype; HiFT's F0 and phase stay float32 (as CosyVoice2's)
    return DiTToken2Wav(cfg.stream, flow.to(device, dtype).eval(), hift.to(device).eval())


def voice_names(model_dir: str | Path) -> tuple[str, ...]:
    folder = Path(model_dir) / VOICES_FOLDER
    return tuple(sorted(p.stem for p in folder.glob("*.safetensors"))) if folder.is_dir() else ()


def load_voice(model_dir: str | Path, name: str) -> dict[str, np.ndarray]:
    """A stored voice as a request's conditioning arrays."""
    from safetensors.numpy import load_file

    arrays = load_file(str(Path(model_dir) / VOICES_FOLDER / f"{name}.safetensors"))
    tokens, mel, embedding = arrays["speech_tokens"], arrays["speech_feat"], arrays["embedding"]
    if mel.shape[0] != 2 * tokens.size:
        raise ValueError(f"voice {name}: speech_feat has {mel.shape[0]} frames for {tokens.size} tokens")
    return {"prompt_speech_tokens": tokens.astype(np.int32), "prompt_feat": mel.astype(np.float32),
            "speaker_embedding": embedding.astype(np.float32).reshape(-1)}


@dataclass
class ReplyAudio:
    """One request's speech: its voice, the reply's audio ids so far and how far they are spoken."""

    prompt: VoicePrompt
    codes: list[int] = field(default_factory=list)
    spoken: int = 0  # ids decoded as new tokens (a chunk's lookahead is decoded again with the next chunk)
    ended: bool = False
    decoder: DiTToken2WavState | None = None  # from the first chunk

    def window(self, chunk: int, lookahead: int) -> tuple[int, int, bool] | None:
        """The next chunk (start, end, last) of the complete reply's cut, once its ids are in; None before."""
        left = len(self.codes) - self.spoken
        if left > chunk + lookahead:
            return self.spoken, self.spoken + chunk + lookahead, False
        if self.ended and left > 0:
            return self.spoken, len(self.codes), True
        return None
