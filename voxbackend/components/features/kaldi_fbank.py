"""Kaldi's `compute-fbank-feats` (the defaults CAMPPlus was trained on), in plain torch.

16 kHz, 25 ms frames every 10 ms that fit inside the signal (snip_edges), no dither, per-frame DC removal,
pre-emphasis 0.97 (the first sample repeats itself), Povey window (Hann ** 0.85), zero-padded to 512 for the
FFT, power spectrum, 80 triangular bands equally spaced on Kaldi's mel scale (1127 ln(1 + f / 700)) from 20 Hz
to Nyquist, natural log floored at float32 epsilon. The waveform is taken as given (floats in [-1, 1], not the
int16 range Kaldi's tools read), as CosyVoice's front end does.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

SAMPLE_RATE = 16000
FRAME_LENGTH, FRAME_SHIFT, FFT_SIZE = 400, 160, 512
PREEMPHASIS = 0.97
LOW_HZ = 20.0
LOG_FLOOR = float(np.finfo(np.float32).eps)


def kaldi_mel(hz):
    return 1127.0 * np.log1p(np.asarray(hz, dtype=np.float64) / 700.0)


@lru_cache(maxsize=4)
def kaldi_mel_banks(num_bins: int) -> torch.Tensor:
    """[num_bins, FFT_SIZE // 2 + 1]: triangles in the mel domain; the Nyquist bin gets no weight (as in Kaldi)."""
    low, high = kaldi_mel(LOW_HZ), kaldi_mel(SAMPLE_RATE / 2)
    step = (high - low) / (num_bins + 1)
    left = low + step * np.arange(num_bins)[:, None]
    centre, right = left + step, left + 2 * step
    bin_mel = kaldi_mel(np.arange(FFT_SIZE // 2) * SAMPLE_RATE / FFT_SIZE)[None]
    weights = np.maximum(0.0, np.minimum((bin_mel - left) / (centre - left), (right - bin_mel) / (right - centre)))
    return torch.from_numpy(np.pad(weights, ((0, 0), (0, 1))))


@lru_cache(maxsize=1)
def povey_window() -> torch.Tensor:
    return torch.hann_window(FRAME_LENGTH, periodic=False, dtype=torch.float64) ** 0.85


def kaldi_fbank(audio_16k: torch.Tensor, num_bins: int = 80) -> torch.Tensor:
    """float [samples] at 16 kHz -> float32 [1 + (samples - 400) // 160, num_bins] log mel energies."""
    audio = torch.as_tensor(audio_16k).to(torch.float64).reshape(-1)
    if audio.numel() < FRAME_LENGTH:
        return torch.zeros(0, num_bins)
    frames = audio.unfold(0, FRAME_LENGTH, FRAME_SHIFT)
    frames = frames - frames.mean(dim=1, keepdim=True)
    previous = torch.cat([frames[:, :1], frames[:, :-1]], dim=1)
    frames = (frames - PREEMPHASIS * previous) * povey_window()
    power = torch.fft.rfft(frames, n=FFT_SIZE).abs() ** 2
    energies = power @ kaldi_mel_banks(num_bins).T
    return energies.clamp(min=LOG_FLOOR).log().to(torch.float32)
