"""PCM16 chunks from Triton -> the bytes of one `response_format`, chunk by chunk.

wav and pcm leave as they arrive (a WAV header with unknown-length size fields goes first, as streamed WAV
does); opus (Ogg Opus) streams too, through libsndfile's encoder, page by page. flac and mp3 are written whole
when the stream ends: libsndfile's writers for them seek back at close to fill in the header, which a stream
that already left cannot take.
"""
from __future__ import annotations

import io
import struct

from voxbackend.triton.audio_encoding import decode

MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "opus": "audio/ogg", "flac": "audio/flac", "mp3": "audio/mpeg"}
RESPONSE_FORMATS = tuple(MEDIA_TYPES)
UNKNOWN_SIZE = 0xFFFFFFFF  # what a streamed WAV puts in its RIFF and data sizes


def wav_header(sample_rate: int, channels: int = 1, bits: int = 16, data_bytes: int | None = None) -> bytes:
    """A 44-byte PCM WAV header; without `data_bytes` its sizes say "unknown": readers take the data to the end of
    the stream."""
    block = channels * bits // 8
    riff = UNKNOWN_SIZE if data_bytes is None else 36 + data_bytes
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, sample_rate * block, block, bits)
            + b"data" + struct.pack("<I", UNKNOWN_SIZE if data_bytes is None else data_bytes))


def encode_whole(pcm16: bytes, sample_rate: int, response_format: str) -> bytes:
    """A whole reply as one file of `response_format` (a chat completion's audio): a WAV with its real sizes."""
    if response_format == "wav":
        return wav_header(sample_rate, data_bytes=len(pcm16)) + pcm16
    encoder = AudioEncoder(response_format)
    return encoder.start(sample_rate) + encoder.add(pcm16) + encoder.finish()


class _Sink:
    """A file object for libsndfile that hands over what was appended since the last drain()."""

    def __init__(self) -> None:
        self.buf = io.BytesIO()
        self.sent = 0

    def write(self, data) -> int:
        return self.buf.write(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.buf.seek(offset, whence)

    def tell(self) -> int:
        return self.buf.tell()

    def read(self, n: int = -1) -> bytes:
        return self.buf.read(n)

    def drain(self) -> bytes:
        data = self.buf.getvalue()[self.sent:]
        self.sent += len(data)
        return data


class AudioEncoder:
    """start(rate) once, then add(pcm16 bytes) per chunk, then finish(); each returns the bytes to send now."""

    _SOUNDFILE = {"opus": ("OGG", "OPUS"), "flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III")}
    STREAMED = ("wav", "pcm", "opus")

    def __init__(self, response_format: str):
        if response_format not in MEDIA_TYPES:
            raise ValueError(f"unknown response_format {response_format!r}")
        self.format = response_format
        self._file = None
        self._sink: _Sink | None = None
        self._whole: list[bytes] = []

    @property
    def media_type(self) -> str:
        return MEDIA_TYPES[self.format]

    def start(self, sample_rate: int) -> bytes:
        if self.format == "wav":
            return wav_header(sample_rate)
        if self.format in self._SOUNDFILE:
            import soundfile as sf

            container, subtype = self._SOUNDFILE[self.format]
            self._sink = _Sink()
            self._file = sf.SoundFile(self._sink, "w", sample_rate, 1, format=container, subtype=subtype)
        return b""

    def add(self, pcm16: bytes) -> bytes:
        if self._file is None:
            return pcm16
        self._file.write(decode(pcm16, "pcm16"))
        return self._sink.drain() if self.format in self.STREAMED else b""

    def finish(self) -> bytes:
        if self._file is None:
            return b""
        self._file.close()
        return self._sink.drain()
