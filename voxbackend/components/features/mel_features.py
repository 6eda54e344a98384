"""Mel spectrograms of the voice-cloning front ends, in plain torch (no librosa, no torchaudio).

- `whisper_log_mel`: the S3 tokenizer's input (Whisper's recipe: 16 kHz, 25 ms Hann frames every 10 ms, power
  spectrum, 128 Slaney mel bands, log10 floored 8 decades under the clip's peak, scaled to about [-1, 1]).
- `hifigan_log_mel`: the HiFi-GAN/Matcha-TTS recipe (reflect padded by (n_fft - hop) / 2 on each side and framed
  without centring, so frame i is centred on sample hop * i + hop / 2; magnitude spectrum; Slaney bands; natural
  log floored at 1e-5). Two users, two settings:
  - `flow_mel`: CosyVoice2's flow prompt mel (24 kHz, 80 ms frames every 20 ms, 80 bands up to 8 kHz);
  - `speaker_mel`: Qwen3-TTS's speaker-encoder input (24 kHz, 1024-sample frames every 256, 128 bands to 12 kHz).
- `slaney_mel_filters`: the filter bank both use (librosa's default `filters.mel`: Slaney's mel scale, linear
  below 1 kHz and logarithmic above, each triangle normalised to unit area).
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

WHISPER_RATE, WHISPER_N_FFT, WHISPER_HOP = 16000, 400, 160
FLOW_RATE, FLOW_N_FFT, FLOW_HOP, FLOW_MELS, FLOW_FMAX = 24000, 1920, 480, 80, 8000.0
SPEAKER_RATE, SPEAKER_N_FFT, SPEAKER_HOP, SPEAKER_MELS, SPEAKER_FMAX = 24000, 1024, 256, 128, 12000.0

_LINEAR_HZ_PER_MEL = 200.0 / 3    # Slaney: 3 mels per 200 Hz below 1 kHz
_LOG_START_HZ = 1000.0
_LOG_START_MEL = _LOG_START_HZ / _LINEAR_HZ_PER_MEL
_LOG_STEP = math.log(6.4) / 27.0  # 27 mels per factor 6.4 above 1 kHz


def hz_to_slaney_mel(hz: np.ndarray) -> np.ndarray:
    hz = np.asarray(hz, dtype=np.float64)
    log_part = _LOG_START_MEL + np.log(np.maximum(hz, _LOG_START_HZ) / _LOG_START_HZ) / _LOG_STEP
    return np.where(hz >= _LOG_START_HZ, log_part, hz / _LINEAR_HZ_PER_MEL)


def slaney_mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    log_part = _LOG_START_HZ * np.exp(_LOG_STEP * (np.maximum(mel, _LOG_START_MEL) - _LOG_START_MEL))
    return np.where(mel >= _LOG_START_MEL, log_part, mel * _LINEAR_HZ_PER_MEL)


@lru_cache(maxsize=8)
def slaney_mel_filters(sample_rate: int, n_fft: int, n_mels: int, fmin: float = 0.0,
                       fmax: float | None = None) -> torch.Tensor:
    """[n_mels, n_fft // 2 + 1] float32: triangles with corners equally spaced in Slaney mels between fmin and
    fmax, evaluated at the FFT bin frequencies, each scaled by 2 / (its width in Hz)."""
    fmax = sample_rate / 2 if fmax is None else fmax
    bin_hz = np.linspace(0.0, sample_rate / 2, n_fft // 2 + 1)
    corners = slaney_mel_to_hz(np.linspace(hz_to_slaney_mel(fmin), hz_to_slaney_mel(fmax), n_mels + 2))
    left, centre, right = corners[:-2, None], corners[1:-1, None], corners[2:, None]
    rising = (bin_hz[None] - left) / (centre - left)
    falling = (right - bin_hz[None]) / (right - centre)
    weights = np.maximum(0.0, np.minimum(rising, falling)) * (2.0 / (right - left))
    return torch.from_numpy(weights.astype(np.float32))


def whisper_log_mel(audio_16k: torch.Tensor, n_mels: int = 128) -> torch.Tensor:
    """float [samples] at 16 kHz -> [n_mels, samples // 160]: the S3 tokenizer's input features."""
    audio = torch.as_tensor(audio_16k, dtype=torch.float32)
    window = torch.hann_window(WHISPER_N_FFT)
    spec = torch.stft(audio, WHISPER_N_FFT, WHISPER_HOP, window=window, center=True, pad_mode="reflect",
                      return_complex=True)
    power = spec[..., :-1].abs() ** 2  # Whisper drops the frame centred past the end
    mel = slaney_mel_filters(WHISPER_RATE, WHISPER_N_FFT, n_mels) @ power
    log_mel = mel.clamp(min=1e-10).log10()
    log_mel = torch.maximum(log_mel, log_mel.max() - 8.0)
    return (log_mel + 4.0) / 4.0


def hifigan_log_mel(audio: torch.Tensor, sample_rate: int, n_fft: int, hop: int, n_mels: int, fmin: float,
                    fmax: float) -> torch.Tensor:
    """float [samples] -> [samples // hop, n_mels] (Hann window of n_fft; needs more than (n_fft - hop) / 2
    samples, the reflect padding)."""
    audio = torch.as_tensor(audio, dtype=torch.float32)
    side = (n_fft - hop) // 2
    padded = F.pad(audio[None, None], (side, side), mode="reflect")[0]
    spec = torch.stft(padded, n_fft, hop, win_length=n_fft, window=torch.hann_window(n_fft), center=False,
                      return_complex=True)[0]
    magnitude = torch.sqrt(spec.real ** 2 + spec.imag ** 2 + 1e-9)
    mel = slaney_mel_filters(sample_rate, n_fft, n_mels, fmin, fmax) @ magnitude
    return mel.clamp(min=1e-5).log().T.contiguous()


def flow_mel(audio_24k: torch.Tensor) -> torch.Tensor:
    """float [samples] at 24 kHz -> [samples // 480, 80]: the flow's mel features (its prompt_feat layout)."""
    return hifigan_log_mel(audio_24k, FLOW_RATE, FLOW_N_FFT, FLOW_HOP, FLOW_MELS, 0.0, FLOW_FMAX)


def speaker_mel(audio_24k: torch.Tensor) -> torch.Tensor:
    """float [samples] at 24 kHz -> [samples // 256, 128]: Qwen3-TTS's speaker-encoder input."""
    return hifigan_log_mel(audio_24k, SPEAKER_RATE, SPEAKER_N_FFT, SPEAKER_HOP, SPEAKER_MELS, 0.0, SPEAKER_FMAX)
