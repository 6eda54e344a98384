"""CAM++ (CAMPPlus) speaker encoder: mean-normalised Kaldi fbank -> a 192-d speaker embedding, in plain torch.

CosyVoice2 conditions its LM and flow on this embedding (upstream runs it as `campplus.onnx`). The network
(3D-Speaker's, as FunASR and Chatterbox ship it as torch code): a 2-D conv front (FCM) over (frequency, time)
that halves frequency three times, a strided TDNN, three densely connected blocks of context-aware-masked TDNN
layers (each layer's local conv gated by a sigmoid of utterance-mean + 100-frame segment-mean context), transit
layers halving the width, then mean+std statistics pooling and a dense layer with a non-affine batch norm.
Every norm is eval-mode BatchNorm. Module names follow that torch class, so its state dicts load unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from voxbackend.components.features.kaldi_fbank import kaldi_fbank

SEGMENT_FRAMES = 100


@dataclass(frozen=True)
class CAMPPlusConfig:
    feat_dim: int = 80
    embedding_size: int = 192
    growth_rate: int = 32
    bn_size: int = 4
    init_channels: int = 128
    head_channels: int = 32
    block_layers: tuple[int, ...] = (12, 24, 16)
    block_dilations: tuple[int, ...] = (1, 2, 2)

    @classmethod
    def from_dict(cls, d: dict) -> "CAMPPlusConfig":
        known = {f.name for f in fields(cls)}
        d = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in known}
        return cls(**d)


class BatchNormReLU(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.batchnorm = nn.BatchNorm1d(channels)

    def forward(self, x):
        return F.relu(self.batchnorm(x))


class ResBlock2d(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=(stride, 1), padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=(stride, 1), bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(y + self.shortcut(x))


class FCM(nn.Module):
    """[B, F, T] -> [B, C * F / 8, T]: 2-D residual convs, frequency strided by 2 three times."""

    def __init__(self, cfg: CAMPPlusConfig):
        super().__init__()
        c = cfg.head_channels
        self.conv1 = nn.Conv2d(1, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.layer1 = nn.Sequential(ResBlock2d(c, c, 2), ResBlock2d(c, c, 1))
        self.layer2 = nn.Sequential(ResBlock2d(c, c, 2), ResBlock2d(c, c, 1))
        self.conv2 = nn.Conv2d(c, c, 3, stride=(2, 1), padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.out_channels = c * (cfg.feat_dim // 8)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x[:, None])))
        x = F.relu(self.bn2(self.conv2(self.layer2(self.layer1(x)))))
        return x.flatten(1, 2)


class TDNN(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.linear = nn.Conv1d(cin, cout, 5, stride=2, padding=2, bias=False)
        self.nonlinear = BatchNormReLU(cout)

    def forward(self, x):
        return self.nonlinear(self.linear(x))


class CAMLayer(nn.Module):
    """A dilated local conv gated per channel by the utterance mean plus the mean of each 100-frame segment."""

    def __init__(self, cin: int, cout: int, dilation: int):
        super().__init__()
        self.linear_local = nn.Conv1d(cin, cout, 3, padding=dilation, dilation=dilation, bias=False)
        self.linear1 = nn.Conv1d(cin, cin // 2, 1)
        self.linear2 = nn.Conv1d(cin // 2, cout, 1)

    def forward(self, x):
        t = x.size(-1)
        segments = F.avg_pool1d(x, SEGMENT_FRAMES, SEGMENT_FRAMES, ceil_mode=True)  # last one partial
        segment_mean = segments.repeat_interleave(SEGMENT_FRAMES, dim=-1)[..., :t]
        context = x.mean(-1, keepdim=True) + segment_mean
        gate = torch.sigmoid(self.linear2(F.relu(self.linear1(context))))
        return self.linear_local(x) * gate


class CAMDenseLayer(nn.Module):
    def __init__(self, cin: int, cfg: CAMPPlusConfig, dilation: int):
        super().__init__()
        width = cfg.bn_size * cfg.growth_rate
        self.nonlinear1 = BatchNormReLU(cin)
        self.linear1 = nn.Conv1d(cin, width, 1, bias=False)
        self.nonlinear2 = BatchNormReLU(width)
        self.cam_layer = CAMLayer(width, cfg.growth_rate, dilation)

    def forward(self, x):
        return self.cam_layer(self.nonlinear2(self.linear1(self.nonlinear1(x))))


class CAMDenseBlock(nn.Module):
    """Each layer sees the block input and every earlier layer's output (DenseNet-style concatenation)."""

    def __init__(self, layers: int, cin: int, cfg: CAMPPlusConfig, dilation: int):
        super().__init__()
        for i in range(layers):
            self.add_module(f"tdnnd{i + 1}", CAMDenseLayer(cin + i * cfg.growth_rate, cfg, dilation))

    def forward(self, x):
        for layer in self.children():
            x = torch.cat([x, layer(x)], dim=1)
        return x


class Transit(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.nonlinear = BatchNormReLU(cin)
        self.linear = nn.Conv1d(cin, cout, 1, bias=False)

    def forward(self, x):
        return self.linear(self.nonlinear(x))


class Dense(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.linear = nn.Conv1d(cin, cout, 1, bias=False)
        self.nonlinear = nn.Module()
        self.nonlinear.batchnorm = nn.BatchNorm1d(cout, affine=False)

    def forward(self, stats):
        return self.nonlinear.batchnorm(self.linear(stats[..., None])[..., 0])


class StatsPool(nn.Module):
    def forward(self, x):
        return torch.cat([x.mean(-1), x.std(-1)], dim=-1)  # std is the unbiased one, as trained


class CAMPPlus(nn.Module):
    def __init__(self, cfg: CAMPPlusConfig = CAMPPlusConfig()):
        super().__init__()
        self.cfg = cfg
        self.head = FCM(cfg)
        self.xvector = nn.Sequential()
        self.xvector.add_module("tdnn", TDNN(self.head.out_channels, cfg.init_channels))
        channels = cfg.init_channels
        for i, (layers, dilation) in enumerate(zip(cfg.block_layers, cfg.block_dilations), start=1):
            self.xvector.add_module(f"block{i}", CAMDenseBlock(layers, channels, cfg, dilation))
            channels += layers * cfg.growth_rate
            self.xvector.add_module(f"transit{i}", Transit(channels, channels // 2))
            channels //= 2
        self.xvector.add_module("out_nonlinear", BatchNormReLU(channels))
        self.xvector.add_module("stats", StatsPool())
        self.xvector.add_module("dense", Dense(2 * channels, cfg.embedding_size))

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        """feats [B, T, feat_dim] (mean-normalised fbank) -> [B, embedding_size]."""
        return self.xvector(self.head(feats.transpose(1, 2)))

    @torch.inference_mode()
    def embed_features(self, feats: torch.Tensor) -> torch.Tensor:
        """One clip's mean-normalised fbank [T, feat_dim] -> float32 [embedding_size]."""
        return self.forward(feats[None].float())[0]

    def embed(self, audio_16k: torch.Tensor) -> torch.Tensor:
        """One clip, float [samples] at 16 kHz -> float32 [embedding_size]."""
        feats = kaldi_fbank(audio_16k, self.cfg.feat_dim)
        return self.embed_features(feats - feats.mean(dim=0, keepdim=True))  # per-utterance mean normalisation
