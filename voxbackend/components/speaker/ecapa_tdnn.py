"""ECAPA-TDNN speaker encoder: Qwen3-TTS Base's x-vector (a 24 kHz reference clip -> one embedding row of the
talker's hidden size, which the Base prompt puts where CustomVoice puts a speaker's codec embedding).

  log mel [frames, 128] (mel_features.speaker_mel) -> TDNN -> SE-Res2Net blocks (1x1 TDNN; Res2Net: channel
  groups each convolved after adding the previous group's output; 1x1 TDNN; squeeze-excitation gate; residual)
  -> aggregation TDNN over the blocks' concatenated outputs -> attentive statistics pooling (attention over time
  from the frame plus the clip's mean and std; attention-weighted mean and std) -> 1x1 projection.

Every TDNN is a conv with "same" reflect padding and a ReLU; module names follow the checkpoint's
`speaker_encoder.*` tensors (and `speaker_encoder_config`), so they load strictly. Eval only, one clip at a time:
the pooling runs over the whole clip, so clips of different lengths are not batched.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from voxbackend.components.features.mel_features import SPEAKER_HOP, SPEAKER_RATE, speaker_mel
from voxbackend.components.mimi.weights import read_codec_tensors
from voxbackend.models.checkpoint import read_config

PREFIX = "speaker_encoder."
STD_EPS = 1e-12  # the pooling's variance floor


@dataclass(frozen=True)
class EcapaConfig:
    mel_dim: int = 128
    enc_dim: int = 1024
    enc_channels: tuple[int, ...] = (512, 512, 512, 512, 1536)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128
    sample_rate: int = 24000

    @classmethod
    def from_dict(cls, d: dict) -> "EcapaConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in known})

    def __post_init__(self):
        n = len(self.enc_channels)
        if n < 3 or len(self.enc_kernel_sizes) != n or len(self.enc_dilations) != n:
            raise ValueError("enc_channels, enc_kernel_sizes and enc_dilations need the same length (at least 3)")
        if sum(self.enc_channels[1:-1]) != self.enc_channels[-1]:
            raise ValueError("the aggregation width (last enc_channels) must be the sum of the SE-Res2Net widths")
        if any(c % self.enc_res2net_scale for c in self.enc_channels[1:-1]):
            raise ValueError("SE-Res2Net widths must divide by enc_res2net_scale")


class Tdnn(nn.Module):
    """Conv1d with "same" reflect padding, then ReLU."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, dilation=dilation)
        total = dilation * (kernel - 1)
        self.pad = (total // 2, total - total // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if any(self.pad):
            x = F.pad(x, self.pad, mode="reflect")
        return F.relu(self.conv(x))


class Res2Net(nn.Module):
    """`scale` channel groups: the first passes through, each later one is convolved after adding the previous
    group's output, so the receptive field grows across the groups."""

    def __init__(self, channels: int, scale: int, kernel: int, dilation: int):
        super().__init__()
        self.scale = scale
        self.blocks = nn.ModuleList([Tdnn(channels // scale, channels // scale, kernel, dilation)
                                     for _ in range(scale - 1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        groups = torch.chunk(x, self.scale, dim=1)
        out = [groups[0]]
        for i, block in enumerate(self.blocks, start=1):
            out.append(block(groups[i] if i == 1 else groups[i] + out[-1]))
        return torch.cat(out, dim=1)


class SqueezeExcitation(nn.Module):
    def __init__(self, channels: int, squeeze: int):
        super().__init__()
        self.conv1 = nn.Conv1d(channels, squeeze, 1)
        self.conv2 = nn.Conv1d(squeeze, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * gate


class SeRes2NetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, scale: int, squeeze: int, kernel: int, dilation: int):
        super().__init__()
        self.tdnn1 = Tdnn(cin, cout, 1)
        self.res2net_block = Res2Net(cout, scale, kernel, dilation)
        self.tdnn2 = Tdnn(cout, cout, 1)
        self.se_block = SqueezeExcitation(cout, squeeze)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))


def _weighted_stats(x: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std over time of x [B, C, T] under weights [B, C or 1, T] that sum to 1 over time."""
    mean = (weights * x).sum(dim=2)
    std = torch.sqrt((weights * (x - mean.unsqueeze(2)).pow(2)).sum(dim=2).clamp(STD_EPS))
    return mean, std


class AttentiveStatsPooling(nn.Module):
    def __init__(self, channels: int, attention: int):
        super().__init__()
        self.tdnn = Tdnn(channels * 3, attention, 1)
        self.conv = nn.Conv1d(attention, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C, T] -> [B, 2C, 1]."""
        B, _, T = x.shape
        uniform = torch.ones(B, 1, T, dtype=x.dtype, device=x.device) / T
        mean, std = _weighted_stats(x, uniform)
        context = torch.cat([x, mean.unsqueeze(2).expand(-1, -1, T), std.unsqueeze(2).expand(-1, -1, T)], dim=1)
        attention = F.softmax(self.conv(torch.tanh(self.tdnn(context))), dim=2)
        mean, std = _weighted_stats(x, attention)
        return torch.cat([mean, std], dim=1).unsqueeze(2)


class EcapaTdnn(nn.Module):
    def __init__(self, cfg: EcapaConfig = EcapaConfig()):
        super().__init__()
        self.cfg = cfg
        ch, ks, dil = cfg.enc_channels, cfg.enc_kernel_sizes, cfg.enc_dilations
        self.blocks = nn.ModuleList([Tdnn(cfg.mel_dim, ch[0], ks[0], dil[0])])
        self.blocks.extend(SeRes2NetBlock(ch[i - 1], ch[i], cfg.enc_res2net_scale, cfg.enc_se_channels, ks[i], dil[i])
                           for i in range(1, len(ch) - 1))
        self.mfa = Tdnn(ch[-1], ch[-1], ks[-1], dil[-1])
        self.asp = AttentiveStatsPooling(ch[-1], cfg.enc_attention_channels)
        self.fc = nn.Conv1d(ch[-1] * 2, cfg.enc_dim, 1)
        # the widest reflect padding needs more mel frames than it pads
        self.min_frames = max(d * (k - 1) // 2 + 1 for k, d in zip(ks, dil))
        self.min_samples = self.min_frames * SPEAKER_HOP

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path, device: str | torch.device = "cpu") -> "EcapaTdnn":
        """A Qwen3-TTS Base folder: `speaker_encoder_config` from config.json, `speaker_encoder.*` tensors (only
        those are read from the safetensors files)."""
        model_dir = Path(model_dir)
        config = read_config(model_dir).get("speaker_encoder_config")
        if config is None:
            raise ValueError(f"{model_dir} has no speaker_encoder_config: not a Qwen3-TTS Base checkpoint")
        model = cls(EcapaConfig.from_dict(config))
        model.load_state_dict(read_codec_tensors(model_dir, PREFIX), strict=True)
        return model.to(device).eval()

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        """mels [B, frames, mel_dim] -> embeddings [B, enc_dim]."""
        x = mels.transpose(1, 2)
        outputs = []
        for block in self.blocks:
            x = block(x)
            outputs.append(x)
        x = self.mfa(torch.cat(outputs[1:], dim=1))  # the SE-Res2Net blocks' outputs, not the first TDNN's
        return self.fc(self.asp(x)).squeeze(2)

    @torch.inference_mode()
    def embed(self, audio: torch.Tensor) -> torch.Tensor:
        """float [samples] at sample_rate (24 kHz) -> float32 [enc_dim]."""
        if self.cfg.sample_rate != SPEAKER_RATE:
            raise ValueError(f"the speaker mel front end is {SPEAKER_RATE} Hz, the config says {self.cfg.sample_rate}")
        if audio.shape[-1] < self.min_samples:
            raise ValueError(f"audio has {audio.shape[-1]} samples; the speaker encoder needs {self.min_samples}")
        mels = speaker_mel(audio)
        w = self.fc.weight
        return self(mels[None].to(device=w.device, dtype=w.dtype))[0].float()
