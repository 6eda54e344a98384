"""CosyVoice2 zero-shot voice cloning front end: a reference clip + its transcript -> the prompt pieces the LM and
the flow are conditioned on. Weights-free of the LM: it runs in the CPU preprocess model, once per voice.

For a clip (any rate; resampled with voxbackend.audio_io, as upstream resamples with torchaudio) it computes, as
upstream `CosyVoiceFrontEnd.frontend_zero_shot` does:
- speech tokens: S3 tokenizer v2 on the 16 kHz clip (25 Hz);
- speech_feat: the flow's 80-bin log mel of the 24 kHz clip (50 Hz), both cut to 2 mel frames per token;
- embedding: CAMPPlus on the mean-normalised Kaldi fbank of the 16 kHz clip (192-d; upstream feeds the same
  vector to the LM and the flow).
The transcript is kept as text: the LM's tokenizer turns it into prompt text tokens.

Voices by name: `voice(name, audio=..., transcript=...)` computes a voice once and keeps it (a bounded LRU);
later requests name it without a clip. Named voices stored in the checkpoint folder (voices/<name>.safetensors,
see VoicePrompt.save) load on first use. A name is an identity: a clip sent with a name already known is not
recomputed (pick a new name for a new clip).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from voxbackend.audio_io import read_audio
from voxbackend.components.speaker.campplus import CAMPPlus, CAMPPlusConfig
from voxbackend.components.features.mel_features import FLOW_RATE, WHISPER_RATE, flow_mel
from voxbackend.components.s3_tokenizer import S3TokenizerConfig, S3TokenizerV2
from voxbackend.errors import InvalidRequest
from voxbackend.models.named_voices import VOICES_DIR, NamedVoices

TOKEN_MEL_RATIO = 2


@dataclass(frozen=True)
class VoicePrompt:
    transcript: str
    speech_tokens: torch.Tensor  # int32 [P], 25 Hz
    speech_feat: torch.Tensor    # float32 [2P, 80], 50 Hz
    embedding: torch.Tensor      # float32 [192]

    def save(self, path: str | Path) -> None:
        """One safetensors file: tensors speech_tokens, speech_feat, embedding; metadata {"transcript": ...}."""
        from safetensors.torch import save_file

        tensors = {"speech_tokens": self.speech_tokens, "speech_feat": self.speech_feat, "embedding": self.embedding}
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"transcript": self.transcript})

    @classmethod
    def load(cls, path: str | Path) -> "VoicePrompt":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            transcript = (f.metadata() or {}).get("transcript", "")
            tokens, feat, embedding = (f.get_tensor(k) for k in ("speech_tokens", "speech_feat", "embedding"))
        if feat.size(0) != TOKEN_MEL_RATIO * tokens.numel():
            raise ValueError(f"{path}: speech_feat has {feat.size(0)} frames for {tokens.numel()} tokens")
        return cls(transcript, tokens.to(torch.int32), feat.float(), embedding.float())


@dataclass(frozen=True)
class ClonerConfig:
    CONFIG_NAME = "frontend.json"

    tokenizer: S3TokenizerConfig = field(default_factory=S3TokenizerConfig)
    speaker: CAMPPlusConfig = field(default_factory=CAMPPlusConfig)
    # the S3 tokenizer's attention window is 30 s (upstream asserts it); longer clips add little to a voice
    max_reference_s: float = 30.0
    # CAMPPlus pools statistics over frames: under half a second it has almost nothing to pool
    min_reference_s: float = 0.5
    max_cached_voices: int = 128

    @classmethod
    def from_dict(cls, d: dict) -> "ClonerConfig":
        limits = {k: d[k] for k in ("max_reference_s", "min_reference_s", "max_cached_voices") if k in d}
        return cls(S3TokenizerConfig.from_dict(d.get("tokenizer", {})),
                   CAMPPlusConfig.from_dict(d.get("speaker", {})), **limits)


class VoiceCloner:
    def __init__(self, cfg: ClonerConfig, tokenizer: S3TokenizerV2, speaker: CAMPPlus,
                 voices_dir: str | Path | None = None):
        self.cfg = cfg
        self.tokenizer = tokenizer.eval()
        self.speaker = speaker.eval()
        self.named = NamedVoices(voices_dir, VoicePrompt.load, cfg.max_cached_voices)
        self.computed = 0  # clips run through the networks (tells a cache hit from a recompute)

    def clone(self, audio: bytes | np.ndarray, sample_rate: int | None, transcript: str | None) -> VoicePrompt:
        """A reference clip (file bytes, or float samples at sample_rate) and its transcript -> VoicePrompt."""
        if not isinstance(transcript, str) or not transcript.strip():
            raise InvalidRequest("reference_text: a reference clip needs its transcript", field="reference_text")
        audio_16k = self._read(audio, sample_rate, WHISPER_RATE)
        if audio_16k.size < self.cfg.min_reference_s * WHISPER_RATE:
            raise InvalidRequest(f"reference_audio is {audio_16k.size / WHISPER_RATE:.2f} s; "
                                 f"at least {self.cfg.min_reference_s:g} s is needed", field="reference_audio")
        audio_24k = self._read(audio, sample_rate, FLOW_RATE)
        with torch.inference_mode():
            tokens = self.tokenizer.tokenize(torch.from_numpy(audio_16k))
            feat = flow_mel(torch.from_numpy(audio_24k))
            embedding = self.speaker.embed(torch.from_numpy(audio_16k))
        self.computed += 1
        n = min(feat.size(0) // TOKEN_MEL_RATIO, tokens.numel())  # the flow needs exactly 2 mel frames per token
        return VoicePrompt(transcript, tokens[:n].clone(), feat[: TOKEN_MEL_RATIO * n].clone(), embedding.clone())

    def _read(self, audio, sample_rate: int | None, target_rate: int) -> np.ndarray:
        try:
            return read_audio(audio, sample_rate, target_rate, max_seconds=self.cfg.max_reference_s,
                              field="reference_audio")
        except InvalidRequest as exc:  # read_audio names the field in its message only
            raise InvalidRequest(str(exc), field=exc.field or "reference_audio") from None

    def voice(self, name: str | None = None, audio: bytes | np.ndarray | None = None,
              sample_rate: int | None = None, transcript: str | None = None) -> VoicePrompt:
        """A named voice (cached, or stored in voices/), or a clip + transcript (cached under `name` if given)."""
        if name is None:
            if audio is None:
                if transcript is not None:
                    raise InvalidRequest("reference_text was given without reference_audio", field="reference_audio")
                raise InvalidRequest("voice: give a voice name or a reference clip with its transcript", field="voice")
            return self.clone(audio, sample_rate, transcript)
        return self.named.get(name, None if audio is None else lambda: self.clone(audio, sample_rate, transcript))

    def save_voice(self, name: str, prompt: VoicePrompt) -> Path:
        """Stores a voice in voices/<name>.safetensors so later servers know it without a clip."""
        return self.named.save(name, prompt)

    def stored_voices(self) -> list[str]:
        return self.named.stored()


def load_voice_cloner(folder: str | Path) -> VoiceCloner:
    """Reads speech_tokenizer_v2.{safetensors,pt} (the s3tokenizer package's torch names), campplus.{safetensors,pt}
    (the CAMPPlus torch class's names), an optional frontend.json (ClonerConfig) and the voices/ folder."""
    folder = Path(folder)
    config_path = folder / ClonerConfig.CONFIG_NAME
    cfg = ClonerConfig.from_dict(json.loads(config_path.read_text())) if config_path.exists() else ClonerConfig()

    def state(name: str) -> dict[str, torch.Tensor]:
        if (folder / f"{name}.safetensors").exists():
            from safetensors.torch import load_file
            return load_file(str(folder / f"{name}.safetensors"))
        return torch.load(folder / f"{name}.pt", map_location="cpu", weights_only=True)

    tokenizer = S3TokenizerV2(cfg.tokenizer)
    tokenizer.load_state_dict(state("speech_tokenizer_v2"), strict=True)
    speaker = CAMPPlus(cfg.speaker)
    speaker.load_state_dict(state("campplus"), strict=True)
    return VoiceCloner(cfg, tokenizer, speaker, folder / VOICES_DIR)
