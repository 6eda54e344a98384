"""The flow-matching vector field estimator (CosyVoice2 `CausalConditionalDecoder` layout): a 1-D U-Net of causal
conv resnet blocks and transformer blocks, conditioned on the time step, the encoder output `mu`, the speaker
vector and the prompt mel `cond`.

Every conv is causal and every norm is per frame, so right padding never leaks into a row's valid frames; the
transformer blocks attend over valid frames only, chunk-causally (`chunk_size` mel frames) for streaming rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from voxbackend.components.flow_hift.flow_encoder import chunk_attention_mask


@dataclass(frozen=True)
class EstimatorConfig:
    in_channels: int = 320      # x, mu, speaker, cond: 4 x 80 mel bins
    out_channels: int = 80
    channels: tuple[int, ...] = (256,)
    attention_head_dim: int = 64
    n_blocks: int = 4
    num_mid_blocks: int = 12
    num_heads: int = 8
    chunk_size: int = 50        # mel frames per attention chunk when streaming (25 tokens x 2)
    # Chatterbox-Turbo's mean-flow decoder: also embeds the step's end time r and mixes both time embeddings
    meanflow: bool = False


class CausalConv1d(nn.Conv1d):
    def __init__(self, cin: int, cout: int, kernel: int):
        super().__init__(cin, cout, kernel)
        self.left = kernel - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (self.left, 0)))


class ChannelLayerNorm(nn.LayerNorm):
    """LayerNorm over channels of a (B, C, T) tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.transpose(1, 2)).transpose(1, 2)


class CausalBlock(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        # indices match the reference Sequential(conv, transpose, norm, transpose, mish)
        self.block = nn.ModuleDict({"0": CausalConv1d(cin, cout, 3), "2": ChannelLayerNorm(cout)})

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return F.mish(self.block["2"](self.block["0"](x * mask))) * mask


class CausalResnetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, time_dim: int):
        super().__init__()
        self.mlp = nn.ModuleDict({"1": nn.Linear(time_dim, cout)})
        self.block1 = CausalBlock(cin, cout)
        self.block2 = CausalBlock(cout, cout)
        self.res_conv = nn.Conv1d(cin, cout, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = self.block1(x, mask) + self.mlp["1"](F.mish(temb)).unsqueeze(-1)
        return self.block2(h, mask) + self.res_conv(x * mask)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
                   for proj in (self.to_q, self.to_k, self.to_v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[:, None])
        return self.to_out[0](out.transpose(1, 2).reshape(b, t, -1))


class GeluProj(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.proj = nn.Linear(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = Attention(dim, heads, head_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = nn.ModuleDict(
            {"net": nn.ModuleList([GeluProj(dim, 4 * dim), nn.Identity(), nn.Linear(4 * dim, dim)])})

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn1(self.norm1(x), bias)
        net = self.ff["net"]
        return x + net[2](net[0](self.norm3(x)))


def timestep_features(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freq = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
    arg = 1000 * t.unsqueeze(1) * freq.unsqueeze(0)
    return torch.cat((arg.sin(), arg.cos()), dim=-1)


class TimeMLP(nn.Module):
    def __init__(self, cin: int, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(cin, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(t)))


class CausalConditionalDecoder(nn.Module):
    def __init__(self, cfg: EstimatorConfig):
        super().__init__()
        self.cfg = cfg
        channels = tuple(cfg.channels)
        time_dim = channels[0] * 4
        self.time_mlp = TimeMLP(cfg.in_channels, time_dim)
        if cfg.meanflow:
            self.time_embed_mixer = nn.Linear(2 * time_dim, time_dim, bias=False)

        def transformers(dim: int) -> nn.ModuleList:
            return nn.ModuleList(TransformerBlock(dim, cfg.num_heads, cfg.attention_head_dim)
                                 for _ in range(cfg.n_blocks))

        self.down_blocks = nn.ModuleList()
        cout = cfg.in_channels
        for i, ch in enumerate(channels):
            cin, cout = cout, ch
            last = i == len(channels) - 1
            down = CausalConv1d(cout, cout, 3) if last else nn.Conv1d(cout, cout, 3, 2, 1)
            self.down_blocks.append(nn.ModuleList([CausalResnetBlock(cin, cout, time_dim), transformers(cout), down]))
        self.mid_blocks = nn.ModuleList(
            nn.ModuleList([CausalResnetBlock(channels[-1], channels[-1], time_dim), transformers(channels[-1])])
            for _ in range(cfg.num_mid_blocks))
        ups = channels[::-1] + (channels[0],)
        self.up_blocks = nn.ModuleList()
        for i in range(len(ups) - 1):
            cout = ups[i + 1]
            last = i == len(ups) - 2
            up = CausalConv1d(cout, cout, 3) if last else nn.ConvTranspose1d(cout, cout, 4, 2, 1)
            self.up_blocks.append(
                nn.ModuleList([CausalResnetBlock(ups[i] * 2, cout, time_dim), transformers(cout), up]))
        self.final_block = CausalBlock(ups[-1], ups[-1])
        self.final_proj = nn.Conv1d(ups[-1], cfg.out_channels, 1)

    def _attend(self, blocks: nn.ModuleList, x: torch.Tensor, mask: torch.Tensor,
                streaming: torch.Tensor) -> torch.Tensor:
        allowed = chunk_attention_mask(mask[:, 0].sum(-1).long(), x.size(-1), self.cfg.chunk_size, streaming)
        bias = (1.0 - allowed.to(x.dtype)) * -1.0e10
        h = x.transpose(1, 2)
        for block in blocks:
            h = block(h, bias)
        return h.transpose(1, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor,
                cond: torch.Tensor, streaming: torch.Tensor, r: torch.Tensor | None = None) -> torch.Tensor:
        """x, mu, cond: (B, 80, T); mask: (B, 1, T) float, a prefix of ones; t: (B,); spks: (B, 80); streaming: (B,);
        r: (B,) the step's end time (meanflow only)."""
        # the time features from float32 t (a bfloat16 t would move the step by up to 0.4%), then the model's dtype
        temb = self.time_mlp(timestep_features(t.float(), self.cfg.in_channels).to(x.dtype))
        if self.cfg.meanflow:
            remb = self.time_mlp(timestep_features(r.float(), self.cfg.in_channels).to(x.dtype))
            temb = self.time_embed_mixer(torch.cat([temb, remb], dim=1))
        h = torch.cat([x, mu, spks[:, :, None].expand(-1, -1, x.size(-1)), cond], dim=1)
        skips, masks = [], [mask]
        for resnet, blocks, down in self.down_blocks:
            m = masks[-1]
            h = self._attend(blocks, resnet(h, m, temb), m, streaming)
            skips.append(h)
            h = down(h * m)
            masks.append(m[:, :, ::2])
        masks = masks[:-1]
        m = masks[-1]
        for resnet, blocks in self.mid_blocks:
            h = self._attend(blocks, resnet(h, m, temb), m, streaming)
        for resnet, blocks, up in self.up_blocks:
            m = masks.pop()
            skip = skips.pop()
            h = torch.cat([h[:, :, :skip.size(-1)], skip], dim=1)
            h = self._attend(blocks, resnet(h, m, temb), m, streaming)
            h = up(h * m)
        h = self.final_block(h, m)
        return self.final_proj(h * m) * mask
