"""CosyVoice 1's flow-matching vector field estimator (`ConditionalDecoder`, on Matcha-TTS's blocks): the 1-D U-Net
of flow_estimator.py with non-causal convs (padding 1), GroupNorm instead of per-frame LayerNorm, a stride-2 conv
down and a transposed conv up, and full attention.

Batched over rows of different lengths (right padding) exactly per row: every conv input is masked, so a row's
last frames see zeros past its end as they would alone; GroupNorm's statistics are taken over the row's valid
frames only (upstream normalizes over all frames of its one row); attention reads valid keys only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from voxbackend.components.flow_hift.flow_estimator import TimeMLP, TransformerBlock, timestep_features


@dataclass(frozen=True)
class UNetConfig:
    in_channels: int = 320      # x, mu, speaker, cond: 4 x 80 mel bins
    out_channels: int = 80
    channels: tuple[int, ...] = (256, 256)
    attention_head_dim: int = 64
    n_blocks: int = 4
    num_mid_blocks: int = 12
    num_heads: int = 8
    groups: int = 8             # GroupNorm groups in the resnet blocks


class MaskedGroupNorm(nn.GroupNorm):
    """GroupNorm of a (B, C, T) tensor over the frames where mask (B, 1, T) is 1; statistics in float32."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, c, t = x.shape
        h = x.float().view(b, self.num_groups, -1, t)
        m = mask.float().view(b, 1, 1, t)
        count = m.sum(-1, keepdim=True) * h.size(2)
        mean = (h * m).sum((2, 3), keepdim=True) / count
        var = ((h - mean) * m).pow(2).sum((2, 3), keepdim=True) / count
        h = ((h - mean) * torch.rsqrt(var + self.eps)).view(b, c, t).to(x.dtype)
        return h * self.weight[:, None] + self.bias[:, None]


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, groups: int):
        super().__init__()
        # keys match the reference Sequential(conv, group norm, mish)
        self.block = nn.ModuleDict({"0": nn.Conv1d(cin, cout, 3, padding=1), "1": MaskedGroupNorm(groups, cout)})

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return F.mish(self.block["1"](self.block["0"](x * mask), mask)) * mask


class ResnetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, time_dim: int, groups: int):
        super().__init__()
        self.mlp = nn.ModuleDict({"1": nn.Linear(time_dim, cout)})
        self.block1 = Block(cin, cout, groups)
        self.block2 = Block(cout, cout, groups)
        self.res_conv = nn.Conv1d(cin, cout, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = self.block1(x, mask) + self.mlp["1"](F.mish(temb)).unsqueeze(-1)
        return self.block2(h, mask) + self.res_conv(x * mask)


class Resample(nn.Module):
    """Holds a conv under the reference's `conv` name (Matcha's Downsample1D / Upsample1D)."""

    def __init__(self, conv: nn.Module):
        super().__init__()
        self.conv = conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class ConditionalDecoder(nn.Module):
    def __init__(self, cfg: UNetConfig):
        super().__init__()
        self.cfg = cfg
        channels = tuple(cfg.channels)
        time_dim = channels[0] * 4
        self.time_mlp = TimeMLP(cfg.in_channels, time_dim)

        def transformers(dim: int) -> nn.ModuleList:
            return nn.ModuleList(TransformerBlock(dim, cfg.num_heads, cfg.attention_head_dim)
                                 for _ in range(cfg.n_blocks))

        def resnet(cin: int, cout: int) -> ResnetBlock:
            return ResnetBlock(cin, cout, time_dim, cfg.groups)

        self.down_blocks = nn.ModuleList()
        cout = cfg.in_channels
        for i, ch in enumerate(channels):
            cin, cout = cout, ch
            last = i == len(channels) - 1
            down = nn.Conv1d(cout, cout, 3, padding=1) if last else Resample(nn.Conv1d(cout, cout, 3, 2, 1))
            self.down_blocks.append(nn.ModuleList([resnet(cin, cout), transformers(cout), down]))
        self.mid_blocks = nn.ModuleList(
            nn.ModuleList([resnet(channels[-1], channels[-1]), transformers(channels[-1])])
            for _ in range(cfg.num_mid_blocks))
        ups = channels[::-1] + (channels[0],)
        self.up_blocks = nn.ModuleList()
        for i in range(len(ups) - 1):
            cout = ups[i + 1]
            last = i == len(ups) - 2
            up = nn.Conv1d(cout, cout, 3, padding=1) if last else Resample(nn.ConvTranspose1d(cout, cout, 4, 2, 1))
            self.up_blocks.append(nn.ModuleList([resnet(ups[i] * 2, cout), transformers(cout), up]))
        self.final_block = Block(ups[-1], ups[-1], cfg.groups)
        self.final_proj = nn.Conv1d(ups[-1], cfg.out_channels, 1)

    @staticmethod
    def _attend(blocks: nn.ModuleList, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        bias = (1.0 - mask.to(x.dtype)) * -1.0e10       # (B, 1, T): every query reads the valid keys
        h = x.transpose(1, 2)
        for block in blocks:
            h = block(h, bias)
        return h.transpose(1, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor,
                cond: torch.Tensor) -> torch.Tensor:
        """x, mu, cond: (B, 80, T); mask: (B, 1, T) float, a prefix of ones; t: (B,); spks: (B, 80)."""
        temb = self.time_mlp(timestep_features(t.float(), self.cfg.in_channels).to(x.dtype))
        h = torch.cat([x, mu, spks[:, :, None].expand(-1, -1, x.size(-1)), cond], dim=1)
        skips, masks = [], [mask]
        for resnet, blocks, down in self.down_blocks:
            m = masks[-1]
            h = self._attend(blocks, resnet(h, m, temb), m)
            skips.append(h)
            h = down(h * m)
            masks.append(m[:, :, ::2])
        masks = masks[:-1]
        m = masks[-1]
        for resnet, blocks in self.mid_blocks:
            h = self._attend(blocks, resnet(h, m, temb), m)
        for resnet, blocks, up in self.up_blocks:
            m = masks.pop()
            skip = skips.pop()
            h = torch.cat([h[:, :, :skip.size(-1)], skip], dim=1)
            h = self._attend(blocks, resnet(h, m, temb), m)
            h = up(h * m)
        h = self.final_block(h, m)
        return self.final_proj(h * m) * mask
