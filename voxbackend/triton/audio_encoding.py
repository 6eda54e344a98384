"""Float audio chunk -> the bytes a client asked for."""
from __future__ import annotations

import numpy as np

from voxbackend.triton.schema import AUDIO_FORMATS, CHUNK_META, TEXT_OUT

SAMPLE_DTYPES = {"pcm16": np.dtype("<i2"), "fp32": np.dtype("<f4")}


def encode(audio: np.ndarray, fmt: str) -> bytes:
    """float32 samples in [-1, 1] -> raw little-endian bytes: int16 (pcm16) or float32 (fp32)."""
    if fmt not in AUDIO_FORMATS:
        raise ValueError(f"unknown audio format {fmt!r}")
    audio = np.asarray(audio, dtype=np.float32).reshape(-1)
    if fmt == "pcm16":
        # clip first: a codec may overshoot 1.0 slightly, and int16 wraps around
        return np.round(np.clip(audio, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()
    return audio.astype("<f4").tobytes()


def decode(data: bytes, fmt: str) -> np.ndarray:
    """Inverse of encode, as float32 in [-1, 1] (clients use this)."""
    samples = np.frombuffer(data, dtype=SAMPLE_DTYPES[fmt])
    return samples.astype(np.float32) / 32767.0 if fmt == "pcm16" else samples.astype(np.float32)


def client_outputs(engine: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """An engine response (float AUDIO, its AUDIO_FORMAT) -> what a client gets (AUDIO as bytes in that format).

    Every array is new: a BLS response's arrays are views of its shared memory, and sending them on in another
    response crashed a stub ("free(): double free") once a client died mid-stream."""
    fmt = engine["AUDIO_FORMAT"].reshape(-1)[0]
    data = encode(engine["AUDIO"], fmt.decode() if isinstance(fmt, bytes) else str(fmt))
    out = {"AUDIO": np.array([data], dtype=np.object_),
           **{spec.name: np.array(engine[spec.name], copy=True) for spec in CHUNK_META}}
    if TEXT_OUT.name in engine:
        out[TEXT_OUT.name] = np.array(engine[TEXT_OUT.name], copy=True)
    return out
