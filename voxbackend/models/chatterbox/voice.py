"""Chatterbox voices: the built-in one (conds.pt), stored ones (voices/<name>.safetensors) and clones of a clip.

A voice conditions both networks (what upstream `ChatterboxTTS.prepare_conditionals` computes):
- T3: the VoiceEncoder embedding of the whole 16 kHz clip and the S3 tokens of its first 6 s (at most 150; Turbo:
  15 s and 375, its subclasses in voxbackend.models.chatterbox.turbo);
- S3Gen, from the clip cut to 10 s at 24 kHz: its S3 tokens (of its 16 kHz resample), its 80-bin mel (2 frames per
  token) and its CAMPPlus x-vector.
As upstream, the 16 kHz clip is a resample of the 24 kHz one. The exaggeration scalar is a request option, not
part of a voice. Unlike upstream, a clip whose mel has an odd frame past 2 per token loses it (upstream keeps it
and the flow's output starts one frame later), so prompt_feat is always [2P, 80].
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from voxbackend.audio_io import read_audio, resample
from voxbackend.components.features.mel_features import FLOW_RATE, WHISPER_RATE, flow_mel, whisper_log_mel
from voxbackend.components.s3_tokenizer import S3TokenizerConfig, S3TokenizerV2
from voxbackend.components.speaker.campplus import CAMPPlus, CAMPPlusConfig
from voxbackend.errors import InvalidRequest
from voxbackend.models.chatterbox.voice_encoder import VoiceEncoder, VoiceEncoderConfig, load_voice_encoder
from voxbackend.models.named_voices import VOICES_DIR, NamedVoices

TOKEN_MEL_RATIO = 2
COND_TOKENS = 150  # T3's speech_cond_prompt_len
ENC_COND_S, DEC_COND_S = 6, 10  # seconds of the clip T3's prompt tokens / S3Gen's prompt see
TOKENIZER_PREFIX, SPEAKER_PREFIX = "tokenizer.", "speaker_encoder."
# chatterbox's S3Tokenizer keeps its mel table and window as buffers; ours computes them
TOKENIZER_BUFFERS = ("_mel_filters", "window")


@dataclass(frozen=True)
class ChatterboxVoice:
    speaker_emb: torch.Tensor    # float32 [256], T3's speaker embedding (VoiceEncoder)
    cond_tokens: torch.Tensor    # int32 [<= 150], T3's prompt speech tokens
    prompt_tokens: torch.Tensor  # int32 [P], S3Gen's prompt tokens (25 Hz)
    prompt_feat: torch.Tensor    # float32 [2P, 80], S3Gen's prompt mel (50 Hz)
    xvector: torch.Tensor        # float32 [192], S3Gen's speaker embedding (CAMPPlus)
    max_cond_tokens: ClassVar[int] = COND_TOKENS  # Chatterbox-Turbo's voices keep more (its subclass)

    def __post_init__(self):
        p = self.prompt_tokens.numel()
        if self.prompt_feat.shape != (TOKEN_MEL_RATIO * p, self.prompt_feat.shape[-1]):
            raise ValueError(f"prompt_feat {list(self.prompt_feat.shape)} is not 2 frames for each of {p} tokens")
        if self.cond_tokens.numel() > self.max_cond_tokens:
            raise ValueError(f"{self.cond_tokens.numel()} T3 prompt tokens; at most {self.max_cond_tokens}")

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def save(self, path: str | Path) -> None:
        """One safetensors file, a tensor per field."""
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in self.tensors().items()}, str(path))

    @classmethod
    def load(cls, path: str | Path) -> "ChatterboxVoice":
        from safetensors.torch import load_file

        return cls.of(**load_file(str(path)))

    @classmethod
    def of(cls, speaker_emb, cond_tokens, prompt_tokens, prompt_feat, xvector) -> "ChatterboxVoice":
        """Normalised dtypes and shapes (1-D tokens and embeddings), detached (upstream saves x-vectors with
        their autograd flag)."""
        speaker_emb, cond_tokens, prompt_tokens, prompt_feat, xvector = (
            t.detach() for t in (speaker_emb, cond_tokens, prompt_tokens, prompt_feat, xvector))
        return cls(speaker_emb.reshape(-1).float(), cond_tokens.reshape(-1).to(torch.int32),
                   prompt_tokens.reshape(-1).to(torch.int32), prompt_feat.reshape(-1, prompt_feat.shape[-1]).float(),
                   xvector.reshape(-1).float())

    @classmethod
    def from_conds(cls, path: str | Path) -> "ChatterboxVoice":
        """An official conds.pt (torch.save of dict(t3=T3Cond fields, gen=S3Gen's ref dict))."""
        conds = torch.load(path, map_location="cpu", weights_only=True)
        t3, gen = conds["t3"], conds["gen"]
        tokens = gen["prompt_token"].reshape(-1)
        feat = gen["prompt_feat"].reshape(-1, gen["prompt_feat"].shape[-1])
        if feat.size(0) == TOKEN_MEL_RATIO * tokens.numel() + 1:
            feat = feat[:-1]  # upstream keeps an odd trailing frame; see the module docstring
        return cls.of(t3["speaker_emb"], t3["cond_prompt_speech_tokens"], tokens, feat, gen["embedding"])

    def to_conds(self, path: str | Path, exaggeration: float = 0.5) -> None:
        """Writes an official conds.pt (upstream `Conditionals.load` reads it; emotion_adv = exaggeration)."""
        p = self.prompt_tokens.numel()
        t3 = dict(speaker_emb=self.speaker_emb[None].clone(), clap_emb=None,
                  cond_prompt_speech_tokens=self.cond_tokens[None].long(), cond_prompt_speech_emb=None,
                  emotion_adv=exaggeration * torch.ones(1, 1, 1))
        gen = dict(prompt_token=self.prompt_tokens[None].long(), prompt_token_len=torch.tensor([p]),
                   prompt_feat=self.prompt_feat[None].clone(), prompt_feat_len=None,
                   embedding=self.xvector[None].clone())
        torch.save(dict(t3=t3, gen=gen), path)


@dataclass(frozen=True)
class VoiceConfig:
    CONFIG_NAME = "voice.json"

    voice_encoder: VoiceEncoderConfig = field(default_factory=VoiceEncoderConfig)
    tokenizer: S3TokenizerConfig = field(default_factory=S3TokenizerConfig)
    speaker: CAMPPlusConfig = field(default_factory=CAMPPlusConfig)
    max_cached_voices: int = 128

    @classmethod
    def from_dict(cls, d: dict) -> "VoiceConfig":
        limits = {k: d[k] for k in ("max_cached_voices",) if k in d}
        return cls(VoiceEncoderConfig.from_dict(d.get("voice_encoder", {})),
                   S3TokenizerConfig.from_dict(d.get("tokenizer", {})),
                   CAMPPlusConfig.from_dict(d.get("speaker", {})), **limits)


class VoiceCloner:
    # under a second there is too little speech for a voice; past 30 s the VoiceEncoder adds nothing and the
    # S3 tokenizer's 30 s window would be exceeded
    MIN_REFERENCE_S = 1.0
    MAX_REFERENCE_S = 30.0
    COND_SECONDS = ENC_COND_S  # the clip's head whose S3 tokens prompt T3
    S3GEN_FILE = "s3gen.safetensors"  # where the S3 tokenizer and CAMPPlus weights are
    voice_type: ClassVar[type[ChatterboxVoice]] = ChatterboxVoice

    def __init__(self, cfg: VoiceConfig, encoder: VoiceEncoder, tokenizer: S3TokenizerV2, speaker: CAMPPlus,
                 folder: str | Path | None = None):
        self.cfg = cfg
        self.encoder = encoder.eval()
        self.tokenizer = tokenizer.eval()
        self.speaker = speaker.eval()
        self.folder = Path(folder) if folder is not None else None
        self.named = NamedVoices(self.folder / VOICES_DIR if self.folder is not None else None, self.voice_type.load,
                                 cfg.max_cached_voices)
        self._builtin: ChatterboxVoice | None = None
        self.computed = 0  # clips run through the networks (tells a cache hit from a recompute)

    @classmethod
    def from_folder(cls, folder: str | Path) -> "VoiceCloner":
        """A Chatterbox checkpoint folder: ve.safetensors, the tokenizer./speaker_encoder. tensors of
        s3gen.safetensors, an optional voice.json (VoiceConfig; absent: the official sizes), conds.pt, voices/."""
        from safetensors import safe_open

        folder = Path(folder)
        config_path = folder / VoiceConfig.CONFIG_NAME
        cfg = VoiceConfig.from_dict(json.loads(config_path.read_text())) if config_path.exists() else VoiceConfig()
        tokenizer_state, speaker_state = {}, {}
        with safe_open(str(folder / cls.S3GEN_FILE), framework="pt") as f:  # ~1 GB: read only these parts
            for key in f.keys():
                if key.startswith(TOKENIZER_PREFIX) and key[len(TOKENIZER_PREFIX):] not in TOKENIZER_BUFFERS:
                    tokenizer_state[key[len(TOKENIZER_PREFIX):]] = f.get_tensor(key)
                elif key.startswith(SPEAKER_PREFIX):
                    speaker_state[key[len(SPEAKER_PREFIX):]] = f.get_tensor(key)
        tokenizer, speaker = S3TokenizerV2(cfg.tokenizer), CAMPPlus(cfg.speaker)
        tokenizer.load_state_dict(tokenizer_state, strict=True)
        speaker.load_state_dict(speaker_state, strict=True)
        encoder = load_voice_encoder(folder / "ve.safetensors", cfg.voice_encoder)
        return cls(cfg, encoder, tokenizer, speaker, folder)

    # ------------------------------------------------------------ cloning

    def clone(self, audio: bytes | np.ndarray, sample_rate: int | None) -> ChatterboxVoice:
        """A reference clip (file bytes, or float samples at sample_rate) -> its voice."""
        try:
            audio_24k = read_audio(audio, sample_rate, FLOW_RATE, max_seconds=self.MAX_REFERENCE_S,
                                   field="reference_audio")
        except InvalidRequest as exc:  # read_audio names the field in its message only
            raise InvalidRequest(str(exc), field=exc.field or "reference_audio") from None
        if audio_24k.size < self.MIN_REFERENCE_S * FLOW_RATE:
            raise InvalidRequest(f"reference_audio is {audio_24k.size / FLOW_RATE:.2f} s; Chatterbox takes "
                                 f"{self.MIN_REFERENCE_S:g} to {self.MAX_REFERENCE_S:g} s", field="reference_audio")
        audio_16k = resample(audio_24k, FLOW_RATE, WHISPER_RATE)
        dec_24k = audio_24k[: DEC_COND_S * FLOW_RATE]
        dec_16k = resample(dec_24k, FLOW_RATE, WHISPER_RATE)  # upstream resamples the cut clip again
        with torch.inference_mode():
            speaker_emb = self.encoder.embed(audio_16k)
            cond_tokens = self._tokens(audio_16k[: self.COND_SECONDS * WHISPER_RATE],
                                       max_tokens=self.voice_type.max_cond_tokens)
            prompt_tokens = self._tokens(dec_16k)
            prompt_feat = flow_mel(torch.from_numpy(dec_24k))
            xvector = self.speaker.embed(torch.from_numpy(dec_16k))
        self.computed += 1
        n = min(prompt_feat.size(0) // TOKEN_MEL_RATIO, prompt_tokens.numel())  # S3Gen: 2 mel frames per token
        return self.voice_type(speaker_emb.clone(), cond_tokens.clone(), prompt_tokens[:n].clone(),
                               prompt_feat[: TOKEN_MEL_RATIO * n].clone(), xvector.clone())

    def _tokens(self, audio_16k: np.ndarray, max_tokens: int | None = None) -> torch.Tensor:
        """S3 tokens; with max_tokens the log-mel (normalised over the whole clip) is cut first, as upstream."""
        mel = whisper_log_mel(torch.from_numpy(audio_16k), self.cfg.tokenizer.n_mels)
        if max_tokens is not None:
            mel = mel[:, : 4 * max_tokens]  # 4 mel frames per token
        tokens, lengths = self.tokenizer.quantize(mel[None], torch.tensor([mel.size(-1)]))
        return tokens[0, : int(lengths[0])]

    # ------------------------------------------------------------ voices by name

    def builtin(self) -> ChatterboxVoice:
        """The checkpoint's own voice (conds.pt)."""
        if self._builtin is None:
            path = self.folder / "conds.pt" if self.folder is not None else None
            if path is None or not path.is_file():
                raise InvalidRequest("voice: this checkpoint has no built-in voice (conds.pt); name a voice or send "
                                     "reference_audio", field="voice")
            self._builtin = self.voice_type.from_conds(path)
        return self._builtin

    def voice(self, name: str | None = None, audio: bytes | np.ndarray | None = None,
              sample_rate: int | None = None) -> ChatterboxVoice:
        """No name, no clip: the built-in voice; a clip: its clone (kept under `name` if given); a name: a voice
        computed earlier (bounded LRU) or stored in voices/. A name already known is not recomputed."""
        if name is None:
            return self.builtin() if audio is None else self.clone(audio, sample_rate)
        return self.named.get(name, None if audio is None else lambda: self.clone(audio, sample_rate))

    def save_voice(self, name: str, voice: ChatterboxVoice) -> Path:
        """Stores a voice in voices/<name>.safetensors so later servers know it without a clip."""
        return self.named.save(name, voice)

    def stored_voices(self) -> list[str]:
        return self.named.stored()
