"""S3Tokenizer v2 (`speech_tokenizer_v2_25hz`): 16 kHz speech -> 25 Hz tokens in [0, 6561), CosyVoice2's prompt
speech tokens, in plain torch.

Whisper-style log-mel (128 bands, 100 Hz) -> two stride-2 convs with GELU (100 -> 25 Hz) -> transformer blocks
whose attention adds rotary positions (on 64-wide heads) and an FSMN memory (a depthwise conv over the values)
-> a finite scalar quantiser: 8 projections, tanh, rounded to {-1, 0, 1}, read as a base-3 number.
Module names follow the `s3tokenizer` package's torch layout, so its converted state dicts load unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from voxbackend.components.features.mel_features import whisper_log_mel

ROPE_DIM, ROPE_THETA = 64, 10000.0
FSQ_LEVELS, FSQ_DIMS = 3, 8
FSQ_SCALE = 0.9990000128746033  # keeps tanh away from +-1 so rounding never yields a 4th level
TOKEN_RATE = 25


@dataclass(frozen=True)
class S3TokenizerConfig:
    n_mels: int = 128
    hidden: int = 1280
    heads: int = 20
    layers: int = 6
    fsmn_kernel: int = 31

    @classmethod
    def from_dict(cls, d: dict) -> "S3TokenizerConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def __post_init__(self):
        if self.hidden // self.heads != ROPE_DIM:
            raise ValueError(f"S3 tokenizer heads must be {ROPE_DIM} wide (its rotary table), "
                             f"got hidden {self.hidden} / {self.heads} heads")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    left, right = x.chunk(2, dim=-1)
    return torch.cat([-right, left], dim=-1)


class FSMNAttention(nn.Module):
    def __init__(self, cfg: S3TokenizerConfig):
        super().__init__()
        d = cfg.hidden
        self.heads = cfg.heads
        self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d, bias=False), nn.Linear(d, d)
        self.out = nn.Linear(d, d)
        self.fsmn_block = nn.Conv1d(d, d, cfg.fsmn_kernel, groups=d, bias=False)
        self.fsmn_pad = ((cfg.fsmn_kernel - 1) // 2, cfg.fsmn_kernel - 1 - (cfg.fsmn_kernel - 1) // 2)

    def forward(self, x: torch.Tensor, valid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, D], valid [B, T] bool; returns the attention output plus the FSMN memory of the values."""
        b, t, d = x.shape
        q = self.query(x).view(b, t, self.heads, -1)
        k = self.key(x).view(b, t, self.heads, -1)
        v = self.value(x)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        keep = valid[..., None].to(x.dtype)
        v_kept = v * keep
        memory = self.fsmn_block(F.pad(v_kept.transpose(1, 2), self.fsmn_pad)).transpose(1, 2)
        memory = (memory + v_kept) * keep
        bias = torch.zeros(b, 1, 1, t, dtype=x.dtype).masked_fill(~valid[:, None, None], -1e10)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.view(b, t, self.heads, -1).transpose(1, 2), attn_mask=bias)
        return self.out(attn.transpose(1, 2).reshape(b, t, d)) + memory


class Block(nn.Module):
    def __init__(self, cfg: S3TokenizerConfig):
        super().__init__()
        self.attn = FSMNAttention(cfg)
        self.attn_ln = nn.LayerNorm(cfg.hidden)
        self.mlp = nn.Sequential(nn.Linear(cfg.hidden, 4 * cfg.hidden), nn.GELU(),
                                 nn.Linear(4 * cfg.hidden, cfg.hidden))
        self.mlp_ln = nn.LayerNorm(cfg.hidden)

    def forward(self, x, valid, cos, sin):
        x = x + self.attn(self.attn_ln(x), valid, cos, sin)
        return x + self.mlp(self.mlp_ln(x))


class Encoder(nn.Module):
    def __init__(self, cfg: S3TokenizerConfig):
        super().__init__()
        self.conv1 = nn.Conv1d(cfg.n_mels, cfg.hidden, 3, stride=2, padding=1)
        self.conv2 = nn.Conv1d(cfg.hidden, cfg.hidden, 3, stride=2, padding=1)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))

    def forward(self, mel: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """mel [B, n_mels, T], lengths [B] -> hidden [B, T', D], lengths' (T' = ceil(T / 4))."""
        x = mel * _valid(lengths, mel.size(-1))[:, None]
        for conv in (self.conv1, self.conv2):
            x = F.gelu(conv(x))
            lengths = (lengths - 1) // 2 + 1  # each stride-2, pad-1, kernel-3 conv halves, rounding up
            x = x * _valid(lengths, x.size(-1))[:, None]  # padded frames stay zero for the next conv
        x = x.transpose(1, 2)
        valid = _valid(lengths, x.size(1))
        cos, sin = _rotary(x.size(1))
        for block in self.blocks:
            x = block(x, valid, cos, sin)
        return x, lengths


def _valid(lengths: torch.Tensor, size: int) -> torch.Tensor:
    return torch.arange(size)[None] < lengths[:, None]


def _rotary(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [1, T, 1, 64]; the two halves of a head share one frequency table (rotate-half layout)."""
    inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, ROPE_DIM, 2).float() / ROPE_DIM)
    angles = torch.outer(torch.arange(length).float(), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)[None, :, None]
    return angles.cos(), angles.sin()


class FSQCodebook(nn.Module):
    def __init__(self, cfg: S3TokenizerConfig):
        super().__init__()
        self.project_down = nn.Linear(cfg.hidden, FSQ_DIMS)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        digits = (self.project_down(hidden).float().tanh() * FSQ_SCALE).round() + 1  # {0, 1, 2}
        powers = FSQ_LEVELS ** torch.arange(FSQ_DIMS, dtype=digits.dtype)
        return (digits * powers).sum(-1).to(torch.int32)


class Quantizer(nn.Module):
    def __init__(self, cfg: S3TokenizerConfig):
        super().__init__()
        self._codebook = FSQCodebook(cfg)


class S3TokenizerV2(nn.Module):
    codebook_size = FSQ_LEVELS ** FSQ_DIMS  # 6561

    def __init__(self, cfg: S3TokenizerConfig = S3TokenizerConfig()):
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.quantizer = Quantizer(cfg)

    @torch.inference_mode()
    def quantize(self, mel: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """log-mel [B, n_mels, T] (padded), lengths [B] -> tokens int32 [B, T'], token lengths [B]."""
        hidden, lengths = self.encoder(mel.float(), lengths.long())
        return self.quantizer._codebook(hidden), lengths

    def tokenize(self, audio_16k: torch.Tensor) -> torch.Tensor:
        """One clip, float [samples] at 16 kHz -> int32 [ceil((samples // 160) / 4)] tokens (25 Hz)."""
        mel = whisper_log_mel(audio_16k, self.cfg.n_mels)
        tokens, lengths = self.quantize(mel[None], torch.tensor([mel.size(-1)]))
        return tokens[0, : int(lengths[0])]
