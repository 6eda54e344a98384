"""Chatterbox's VoiceEncoder: a 16 kHz clip -> the 256-d speaker embedding T3 is conditioned on, in plain torch.

The recipe of upstream `VoiceEncoder.embeds_from_wavs` (a Real-Time-Voice-Cloning style d-vector):
- leading/trailing silence trimmed as librosa.effects.trim(top_db=20) does (2048-sample RMS frames every 512,
  zero padded and centred; frames more than 20 dB under the loudest one are silence);
- a 40-band power mel (Hann STFT 400/160, centred with reflect padding, Slaney bands to 8 kHz, no log);
- 160-frame partial windows every round(sample_rate / rate / 160) frames (rate 1.3: 77 frames), zero padded at
  the end; the last partial is kept when it covers at least 80% new frames;
- each partial through a 3-layer LSTM, the last layer's final state projected, ReLU'd and L2-normalised; the
  partials' mean L2-normalised again.
Module names follow the upstream class, so `ve.safetensors` loads unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from voxbackend.components.features.mel_features import slaney_mel_filters

TRIM_FRAME, TRIM_HOP = 2048, 512  # librosa.effects.trim's defaults, which upstream keeps


@dataclass(frozen=True)
class VoiceEncoderConfig:
    num_mels: int = 40
    sample_rate: int = 16000
    n_fft: int = 400
    hop: int = 160
    fmin: float = 0.0
    fmax: float = 8000.0
    hidden: int = 256
    layers: int = 3
    embed_size: int = 256
    partial_frames: int = 160
    rate: float = 1.3  # partial windows per second: Resemble's default in embeds_from_wavs
    min_coverage: float = 0.8
    trim_top_db: float | None = 20.0

    @classmethod
    def from_dict(cls, d: dict) -> "VoiceEncoderConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @property
    def frame_step(self) -> int:
        """Mel frames between partial windows (upstream divides by the window length, not the hop: kept)."""
        step = int(np.round(self.sample_rate / self.rate / self.partial_frames))
        if not 0 < step <= self.partial_frames:
            raise ValueError(f"rate {self.rate} gives a partial step of {step} frames")
        return step

    def partials(self, n_frames: int) -> tuple[int, int]:
        """(number of partial windows, mel frames they span) for a clip of n_frames mel frames."""
        step, win = self.frame_step, self.partial_frames
        n, remainder = divmod(max(n_frames - win + step, 0), step)
        if n == 0 or (remainder + win - step) / win >= self.min_coverage:
            n += 1
        return n, win + step * (n - 1)


def trim_silence(wav: np.ndarray, top_db: float, frame_length: int = TRIM_FRAME, hop: int = TRIM_HOP) -> np.ndarray:
    """The clip without leading/trailing frames quieter than top_db under its loudest frame (librosa's trim)."""
    n = wav.size
    squares = np.concatenate([[0.0], np.cumsum(np.asarray(wav, dtype=np.float64) ** 2)])
    centres = np.arange(1 + n // hop) * hop  # frame i is centred on sample i * hop (zero padding outside)
    lo, hi = np.clip(centres - frame_length // 2, 0, n), np.clip(centres + frame_length // 2, 0, n)
    power = np.maximum((squares[hi] - squares[lo]) / frame_length, 1e-10)  # cumsum differences can dip below 0
    loud = np.flatnonzero(10 * np.log10(power / power.max()) > -top_db)
    if not loud.size:
        return wav
    return wav[loud[0] * hop: min(n, (loud[-1] + 1) * hop)]


class VoiceEncoder(nn.Module):
    def __init__(self, cfg: VoiceEncoderConfig = VoiceEncoderConfig()):
        super().__init__()
        self.cfg = cfg
        self.lstm = nn.LSTM(cfg.num_mels, cfg.hidden, num_layers=cfg.layers, batch_first=True)
        self.proj = nn.Linear(cfg.hidden, cfg.embed_size)
        # training-only (the GE2E similarity scale); kept so the checkpoint loads strictly
        self.similarity_weight = nn.Parameter(torch.tensor([10.0]))
        self.similarity_bias = nn.Parameter(torch.tensor([-5.0]))

    def forward(self, partials: torch.Tensor) -> torch.Tensor:
        """Mel windows [B, partial_frames, num_mels] -> L2-normalised embeddings [B, embed_size]."""
        _, (hidden, _) = self.lstm(partials)
        return F.normalize(F.relu(self.proj(hidden[-1])), dim=-1)

    def mel(self, wav: torch.Tensor) -> torch.Tensor:
        """float [samples] at 16 kHz -> power mel [1 + samples // hop, num_mels]."""
        c = self.cfg
        if wav.numel() <= c.n_fft // 2:
            raise ValueError(f"the voice encoder needs more than {c.n_fft // 2} samples, got {wav.numel()}")
        spec = torch.stft(wav.float(), c.n_fft, c.hop, window=torch.hann_window(c.n_fft), center=True,
                          pad_mode="reflect", return_complex=True)
        filters = slaney_mel_filters(c.sample_rate, c.n_fft, c.num_mels, c.fmin, c.fmax)
        return (filters @ spec.abs() ** 2).T

    @torch.inference_mode()
    def embed(self, wav_16k: np.ndarray | torch.Tensor) -> torch.Tensor:
        """One clip, float [samples] at 16 kHz -> float32 [embed_size] (unit norm)."""
        wav = np.asarray(wav_16k.cpu() if isinstance(wav_16k, torch.Tensor) else wav_16k, dtype=np.float32)
        if self.cfg.trim_top_db:
            wav = trim_silence(wav, self.cfg.trim_top_db)
        mel = self.mel(torch.from_numpy(np.ascontiguousarray(wav)))
        _, span = self.cfg.partials(mel.size(0))
        mel = F.pad(mel, (0, 0, 0, max(span - mel.size(0), 0)))[:span]
        partials = mel.unfold(0, self.cfg.partial_frames, self.cfg.frame_step).transpose(1, 2)
        return F.normalize(self(partials.contiguous()).mean(0), dim=0)


def load_voice_encoder(path: str | Path, cfg: VoiceEncoderConfig = VoiceEncoderConfig()) -> VoiceEncoder:
    """ve.safetensors (upstream names) -> a VoiceEncoder in eval mode."""
    from safetensors.torch import load_file

    model = VoiceEncoder(cfg)
    model.load_state_dict(load_file(str(path)), strict=True)
    return model.eval()
