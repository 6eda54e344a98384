"""Step-Audio 2's audio encoder: what turns a user's clip into the LM rows that replace its `<audio_patch>`
placeholders.

A Whisper-large-v3-shaped encoder (128 log-mel bins, two convolutions, pre-norm blocks) with two differences from
Whisper: its output is halved by an average pool before the final norm, and it runs on the clip's own length (no
padding to 30 s; in a batch, each clip gets the rows it would get alone). An adapter then takes the rows
to the LM's width: a stride-2 convolution with GELU, then linear -> ReLU -> linear. Clips longer than 25 s go in
as several 25 s pieces, each its own `<audio_start>...<audio_end>` span (`pieces`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from voxbackend.components.features.mel_features import whisper_log_mel

SAMPLE_RATE = 16000
PIECE_SAMPLES = 25 * SAMPLE_RATE  # upstream cuts a clip into pieces of this length
TAIL_PAD_SAMPLES = 479  # zeros appended to each piece before its spectrogram, as upstream does
ADAPTER_HIDDEN = 2048


@dataclass(frozen=True)
class AudioEncoderConfig:
    """config.json's `audio_encoder_config` (the official names)."""

    n_mels: int = 128
    n_audio_ctx: int = 1500
    n_audio_state: int = 1280
    n_audio_head: int = 20
    n_audio_layer: int = 32
    llm_dim: int = 3584
    kernel_size: int = 3
    adapter_stride: int = 2

    @classmethod
    def from_hf(cls, section: dict) -> "AudioEncoderConfig":
        return cls(**{k: section[k] for k in cls.__dataclass_fields__ if k in section})


def pieces(audio_16k: torch.Tensor) -> list[torch.Tensor]:
    """A clip's log-mel spectrograms [n_mels, frames], one per 25 s piece."""
    return [piece_mel(audio_16k[i:i + PIECE_SAMPLES]) for i in range(0, audio_16k.shape[0], PIECE_SAMPLES)]


def piece_mel(audio_16k: torch.Tensor, n_mels: int = 128) -> torch.Tensor:
    return whisper_log_mel(F.pad(torch.as_tensor(audio_16k, dtype=torch.float32), (0, TAIL_PAD_SAMPLES)), n_mels)


def encoder_frames(mel_frames: int) -> int:
    """Rows the encoder gives for a spectrogram of `mel_frames` (the 479-sample tail adds 2 frames that do not
    count): conv2 (stride 2) then the average pool (2)."""
    return (mel_frames - 2 + 1) // 2 // 2


def placeholder_count(mel_frames: int, kernel_size: int = 3, stride: int = 2) -> int:
    """`<audio_patch>` rows of a piece: the adapter's convolution (padding 1) over the encoder's rows."""
    return (encoder_frames(mel_frames) + 2 - kernel_size) // stride + 1


class EncoderAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(width, width)
        self.key = nn.Linear(width, width, bias=False)
        self.value = nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (proj(x).view(b, t, self.heads, -1).transpose(1, 2) for proj in (self.query, self.key, self.value))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class EncoderBlock(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.attn = EncoderAttention(width, heads)
        self.attn_ln = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.mlp_ln = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.attn_ln(x), bias)
        return x + self.mlp(self.mlp_ln(x))


class Encoder(nn.Module):
    """Checkpoint names under `encoder.`."""

    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        width = cfg.n_audio_state
        self.conv1 = nn.Conv1d(cfg.n_mels, width, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(width, width, kernel_size=3, stride=2, padding=1)
        self.positional_embedding = nn.Embedding(cfg.n_audio_ctx, width)
        self.blocks = nn.ModuleList(EncoderBlock(width, cfg.n_audio_head) for _ in range(cfg.n_audio_layer))
        self.avg_pooler = nn.AvgPool1d(2, stride=2)
        self.after_norm = nn.LayerNorm(width)

    def forward(self, mels: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        """mels [batch, n_mels, max frames], zero-padded; frames [batch]: each spectrogram's own length ->
        [batch, ceil(max frames / 2) // 2, width], each clip's rows as it would have them alone (rows past
        ceil(frames / 2) // 2 are zero; upstream's batch masks each clip on the longest one's frame grid instead)."""
        steps = torch.arange(mels.shape[-1], device=mels.device)
        x = F.gelu(self.conv1(mels)) * (steps[None, :] < frames[:, None])[:, None, :]  # conv2 pads with zeros alone
        x = F.gelu(self.conv2(x)).transpose(1, 2)  # [b, t, width]
        rows = torch.arange(x.shape[1], device=mels.device)[None, :]
        # conv2's row j (centred on mel frame 2j) is real when that frame is, the 2 tail-pad frames not counting
        real = 2 * rows < frames[:, None] - 2
        bias = torch.zeros(real.shape, dtype=x.dtype, device=x.device).masked_fill(~real, -1e10)[:, None, None, :]
        x = x + self.positional_embedding.weight[:x.shape[1]]
        for block in self.blocks:
            x = block(x, bias)
        x = self.after_norm(self.avg_pooler(x.transpose(1, 2)).transpose(1, 2))
        kept = torch.arange(x.shape[1], device=mels.device)[None, :] < ((frames + 1) // 2 // 2)[:, None]
        return x * kept[:, :, None]  # the adapter's convolution pads with zeros alone


class Adapter(nn.Module):
    """Checkpoint names under `adapter.`."""

    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        width = cfg.n_audio_state
        self.conv = nn.Conv1d(width, width, cfg.kernel_size, cfg.adapter_stride, padding=1)
        self.linear1 = nn.Linear(width, ADAPTER_HIDDEN)
        self.linear2 = nn.Linear(ADAPTER_HIDDEN, cfg.llm_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.conv(x.transpose(1, 2))).transpose(1, 2)
        return self.linear2(F.relu(self.linear1(x)))


class AudioEncoder(nn.Module):
    """Spectrograms of any lengths -> each one's LM rows, batched."""

    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.adapter = Adapter(cfg)

    @torch.inference_mode()
    def forward(self, mels: list[torch.Tensor]) -> list[torch.Tensor]:
        """[n_mels, frames] each -> [placeholder_count(frames), llm_dim] each."""
        p = next(self.parameters())
        frames = max(m.shape[-1] for m in mels)
        batch = torch.stack([F.pad(m, (0, frames - m.shape[-1])) for m in mels]).to(p.device, p.dtype)
        rows = self.adapter(self.encoder(batch, torch.tensor([m.shape[-1] for m in mels], device=p.device)))
        return [rows[i, :placeholder_count(m.shape[-1], self.cfg.kernel_size, self.cfg.adapter_stride)]
                for i, m in enumerate(mels)]


def load_audio_encoder(hf_config: dict, weights: dict[str, torch.Tensor], device: str = "cpu",
                       dtype: torch.dtype = torch.float32) -> AudioEncoder:
    """The encoder and adapter of an official checkpoint: config.json's `audio_encoder_config`, and the tensors
    under `encoder.` and `adapter.` (the LM's are under `model.` and `lm_head.`)."""
    model = AudioEncoder(AudioEncoderConfig.from_hf(hf_config["audio_encoder_config"]))
    model.load_state_dict({k: v for k, v in weights.items() if k.startswith(("encoder.", "adapter."))}, strict=True)
    return model.to(device, dtype).eval()
