"""Reading request audio (reference clips): WAV/FLAC bytes or float samples -> float32 mono at the model's rate.

Everything a client can get wrong raises InvalidRequest naming the problem. Resampling is a windowed-sinc
polyphase filter (Kaiser window, 16 zero crossings, cutoff just below the lower Nyquist), built here so the
serving path needs neither scipy nor torchaudio.
"""
from __future__ import annotations

import io
import math
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from voxbackend.errors import InvalidRequest

MIN_RATE, MAX_RATE = 1000, 384000


def read_audio(data: bytes | np.ndarray, sample_rate: int | None, target_rate: int, *,
               max_seconds: float | None = None, field: str = "audio") -> np.ndarray:
    """Encoded bytes (WAV, FLAC, OGG: whatever libsndfile reads; the file's own rate; channels averaged) or float
    samples [n] / [1, n] / [n, 1] at `sample_rate` -> float32 [m] at `target_rate`. A one-element bytes/object
    array (a Triton BYTES tensor) counts as bytes. For bytes, a given `sample_rate` must match the file's."""
    if isinstance(data, np.ndarray) and data.dtype.kind in "OSV" and data.size == 1:
        data = data.reshape(-1)[0]
        data = data.encode() if isinstance(data, str) else data  # never valid audio; refused below
    if isinstance(data, (bytes, bytearray, memoryview)):
        audio, rate = _decode(bytes(data), field)
        if sample_rate is not None and _rate(sample_rate, f"{field} sample_rate") != rate:
            raise InvalidRequest(f"{field}: the file says {rate} Hz but sample_rate={sample_rate} was given",
                                 field=field)
    elif isinstance(data, np.ndarray):
        if sample_rate is None:
            raise InvalidRequest(f"{field}: raw samples need a sample_rate", field=field)
        rate = _rate(sample_rate, f"{field} sample_rate")
        if data.dtype not in (np.float32, np.float64):
            raise InvalidRequest(f"{field}: raw samples must be float32 (or float64) in [-1, 1], got {data.dtype}",
                                 field=field)
        if data.ndim == 2 and 1 in data.shape:
            data = data.reshape(-1)
        if data.ndim != 1:
            raise InvalidRequest(f"{field}: raw samples must be mono [samples] (or [1, samples]), "
                                 f"got shape {list(data.shape)}", field=field)
        audio = data.astype(np.float32)
    else:
        raise InvalidRequest(f"{field} must be audio file bytes or a float32 array, got {type(data).__name__}",
                             field=field)
    if not audio.size:
        raise InvalidRequest(f"{field} is empty", field=field)
    if not np.isfinite(audio).all():
        raise InvalidRequest(f"{field} contains NaN or infinite samples", field=field)
    if max_seconds is not None and audio.size > max_seconds * rate:
        raise InvalidRequest(f"{field} is {audio.size / rate:.2f} s; the limit is {max_seconds:g} s", field=field)
    return resample(audio, rate, _rate(target_rate, "target_rate"))


def _rate(rate, field: str) -> int:
    if isinstance(rate, np.ndarray) and rate.size == 1:
        rate = rate.reshape(-1)[0]
    if isinstance(rate, (bool, np.bool_)) or not isinstance(rate, (int, np.integer)) or \
            not MIN_RATE <= rate <= MAX_RATE:
        raise InvalidRequest(f"{field} must be an integer in [{MIN_RATE}, {MAX_RATE}] Hz, got {rate!r}", field=field)
    return int(rate)


def _decode(data: bytes, field: str) -> tuple[np.ndarray, int]:
    import soundfile as sf  # libsndfile; only needed for encoded input

    if not data:
        raise InvalidRequest(f"{field} is empty", field=field)
    try:
        audio, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as exc:  # soundfile raises LibsndfileError / RuntimeError / TypeError for junk
        why = getattr(exc, "error_string", None) or exc  # libsndfile's reason, without the stream's repr
        raise InvalidRequest(f"{field} is not a readable audio file (WAV, FLAC, OGG): {why}", field=field) from None
    return audio.mean(axis=1, dtype=np.float32), int(rate)


# ---------------------------------------------------------------- resampling

ZERO_CROSSINGS = 16   # filter half-width, in periods of the cutoff: ~ -80 dB stopband with the Kaiser window
ROLLOFF = 0.945       # cutoff as a fraction of the lower Nyquist: leaves room for the transition band
KAISER_BETA = 8.6


def resample(audio: np.ndarray, src: int, dst: int) -> np.ndarray:
    """float32 [n] at src Hz -> float32 [ceil(n * dst / src)] at dst Hz; sample 0 stays at time 0."""
    if src == dst:
        return np.ascontiguousarray(audio, dtype=np.float32)
    g = math.gcd(src, dst)
    up, down = dst // g, src // g
    kernels, pad = _kernels(up, down)
    n = len(audio)
    out_len = -(-n * up // down)
    blocks = -(-out_len // up)  # each block of `down` input samples gives `up` output samples
    x = torch.from_numpy(np.asarray(audio, dtype=np.float64))
    x = F.pad(x, (pad, blocks * down + kernels.shape[-1] - pad - n))[None, None]
    y = F.conv1d(x, kernels, stride=down)[0]  # [up, blocks]: output i * up + p is y[p, i]
    return y.T.reshape(-1)[:out_len].numpy().astype(np.float32)


@lru_cache(maxsize=16)
def _kernels(up: int, down: int) -> tuple[torch.Tensor, int]:
    """Polyphase bank [up, 1, width]: output i * up + p sits at input time t = i * down + p * down / up and is
    sum_j x[i * down + j] * h(t - (i * down + j)), j in [-pad, down + pad); h is a Kaiser-windowed sinc."""
    cutoff = ROLLOFF * min(1.0, up / down)  # in cycles per input sample, relative to the input Nyquist
    half = ZERO_CROSSINGS / cutoff  # filter half-width in input samples
    pad = math.ceil(half)
    j = np.arange(-pad, down + pad)
    tau = np.arange(up)[:, None] * down / up - j[None, :]  # [up, width]: distance to each input sample
    inside = np.abs(tau) < half
    window = np.where(inside, np.i0(KAISER_BETA * np.sqrt(np.clip(1 - (tau / half) ** 2, 0, None))), 0.0)
    h = cutoff * np.sinc(cutoff * tau) * window / np.i0(KAISER_BETA)
    return torch.from_numpy(h[:, None, :]), pad


class StreamResampler:
    """`resample` over a stream that arrives in chunks: the samples out equal resample(whole stream), each given as
    soon as every input sample its filter reads has arrived (the filter's half-width, ~0.4 ms at 22 or 24 kHz, is
    held back until the next chunk or `flush`)."""

    def __init__(self, src: int, dst: int):
        g = math.gcd(src, dst)
        self.src, self.dst, self.up, self.down = src, dst, dst // g, src // g
        self.pad = _kernels(self.up, self.down)[1] if src != dst else 0
        self.buffer = np.zeros(0, np.float32)
        self.start = 0  # stream index of buffer[0], a multiple of `down`
        self.received = 0
        self.sent = 0  # output samples given so far

    def push(self, audio: np.ndarray) -> np.ndarray:
        audio = np.asarray(audio, np.float32).reshape(-1)
        if self.src == self.dst:
            return audio
        self.buffer = np.concatenate([self.buffer, audio])
        self.received += audio.size
        # output k reads inputs up to floor(k * down / up) + pad + 1; give those whose inputs are all here
        ready = max(0, ((self.received - self.pad - 1) * self.up) // self.down + 1)
        return self._emit(min(ready, -(-self.received * self.up // self.down)))

    def flush(self) -> np.ndarray:
        """The rest, the stream ended (zeros past its end, as resample pads)."""
        if self.src == self.dst:
            return np.zeros(0, np.float32)
        return self._emit(-(-self.received * self.up // self.down))

    def _emit(self, until: int) -> np.ndarray:
        if until <= self.sent:
            return np.zeros(0, np.float32)
        out = resample(self.buffer, self.src, self.dst)  # aligned: buffer[0] is output (start / down) * up
        first = self.start // self.down * self.up
        chunk = out[self.sent - first:until - first]
        self.sent = until
        # keep what the next outputs read: from `pad` before the next one's input time, down to a block boundary
        keep_from = max(0, (self.sent * self.down) // self.up - self.pad - 1)
        keep_from -= keep_from % self.down
        if keep_from > self.start:
            self.buffer = self.buffer[keep_from - self.start:]
            self.start = keep_from
        return chunk
