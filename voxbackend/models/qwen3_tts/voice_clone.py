"""Qwen3-TTS Base voice cloning front end: a reference clip -> the two things a Base prompt is conditioned on.

- codes [frames, 16] at 12.5 Hz: the clip through the speech tokenizer's encoder (models.qwen3_tts.codec_encoder), the
  in-context reference the talker continues after the reference transcript;
- x-vector [hidden]: the clip through the ECAPA-TDNN speaker encoder (components.speaker.ecapa_tdnn), one embedding row
  where CustomVoice puts a named speaker.

As the reference `create_voice_clone_prompt`: the clip is read as float32 (encoded files through libsndfile,
channels averaged), resampled once to 24 kHz, and the same 24 kHz waveform feeds both encoders, without gain
normalisation. The reference resamples with librosa (soxr); here it is voxbackend.audio_io's windowed-sinc
filter, so a clip at another rate gives codes and an x-vector close to, not bit-equal with, the reference's; at
24 kHz they are equal. CPU, weights-free of the talker: it runs in the preprocess model, once per request.

Limits on the clip (at 24 kHz): at least one whole codec frame (1920 samples, 80 ms: a reference with no frame
gives the talker nothing to continue) and at most `max_reference_s` (30 s by default: 375 prompt positions of
reference codes, already more than a voice needs, while the prompt's KV pages and prefill time grow with it).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from voxbackend.audio_io import read_audio
from voxbackend.components.speaker.ecapa_tdnn import EcapaTdnn
from voxbackend.models.qwen3_tts.codec_encoder import Qwen3TTSEncoder
from voxbackend.errors import InvalidRequest

FIELD = "reference_audio"
MAX_REFERENCE_S = 30.0


@dataclass(frozen=True)
class VoiceClonePrompt:
    codes: torch.Tensor     # int64 [frames, 16], 12.5 Hz
    x_vector: torch.Tensor  # float32 [talker hidden size]


class Qwen3TTSVoiceClone:
    def __init__(self, encoder: Qwen3TTSEncoder, speaker: EcapaTdnn, max_reference_s: float = MAX_REFERENCE_S):
        if encoder.sample_rate != speaker.cfg.sample_rate:
            raise ValueError(f"the speech tokenizer is {encoder.sample_rate} Hz, the speaker encoder "
                             f"{speaker.cfg.sample_rate} Hz")
        self.encoder = encoder
        self.speaker = speaker.eval()
        self.sample_rate = encoder.sample_rate
        self.max_reference_s = max_reference_s
        self.min_samples = max(encoder.frame_size, speaker.min_samples)
        if max_reference_s * self.sample_rate > encoder.max_samples:
            raise ValueError(f"max_reference_s={max_reference_s:g} is past the encoder's "
                             f"{encoder.max_samples / self.sample_rate:g} s")

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, max_reference_s: float = MAX_REFERENCE_S) -> "Qwen3TTSVoiceClone":
        """A Qwen3-TTS Base checkpoint folder (config.json with speaker_encoder_config, speech_tokenizer/)."""
        return cls(Qwen3TTSEncoder.from_pretrained(model_dir), EcapaTdnn.from_checkpoint(model_dir),
                   max_reference_s)

    def clone(self, audio: bytes | np.ndarray, sample_rate: int | None = None) -> VoiceClonePrompt:
        """Encoded file bytes (WAV, FLAC, OGG; their own rate) or float samples at `sample_rate` -> the prompt
        pieces. Every problem with the clip raises InvalidRequest(field="reference_audio")."""
        try:
            clip = read_audio(audio, sample_rate, self.sample_rate, max_seconds=self.max_reference_s, field=FIELD)
        except InvalidRequest as exc:  # read_audio names the field in its message
            raise InvalidRequest(str(exc), field=FIELD) from None
        if clip.size < self.min_samples:
            raise InvalidRequest(f"{FIELD} is {clip.size / self.sample_rate * 1000:.0f} ms; at least "
                                 f"{self.min_samples / self.sample_rate * 1000:.0f} ms (one codec frame) is needed",
                                 field=FIELD)
        wave = torch.from_numpy(clip)
        # clones: plain tensors, not inference-mode ones, for whoever builds the prompt from them
        return VoiceClonePrompt(codes=self.encoder.encode(wave).clone(), x_vector=self.speaker.embed(wave).clone())
