"""Step-Audio 2's flow-matching vector field (its token2wav `DiT`): a diffusion transformer over mel frames.

The input frame is [x, mu, speaker, cond] (4 x 80 channels) projected to `hidden_size`. Each block is adaLN-Zero
conditioned on the time step: attention (qk LayerNorm), then a causal conv block, then a GELU MLP, each with its own
shift/scale/gate. A whole utterance attends in both directions over its valid frames (the mask only hides right
padding); convs are causal and norms per frame, so padding never reaches a row's valid frames.

Streaming (`forward_chunk`) runs one chunk of frames with each block's cache from the chunks before it: the keys
and values of every earlier frame (the chunk attends to all of them and to its whole self) and the last two inputs
of each causal conv.

Module names follow the reference state dict (`decoder.estimator.*` in flow.pt) so it loads with strict=True.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class DiTConfig:
    in_channels: int = 320      # x, mu, speaker, cond: 4 x 80 mel bins
    out_channels: int = 80
    hidden_size: int = 512
    depth: int = 16
    num_heads: int = 8
    head_dim: int = 64
    mlp_ratio: float = 4.0
    time_features: int = 256    # sinusoid size fed to the time MLP


@dataclass
class BlockCache:
    keys: torch.Tensor          # (B, heads, frames so far, head_dim), after k_norm
    values: torch.Tensor
    conv_tails: tuple[torch.Tensor, torch.Tensor]   # (B, C, kernel - 1): the last inputs of each causal conv


def timestep_features(t: torch.Tensor, dim: int) -> torch.Tensor:
    """(B, dim) [cos | sin] of 1000 t at frequencies 10000^(-i / (dim / 2)) (GLIDE's embedding; note cos first, and
    the divisor dim / 2 where the U-Net estimator's `timestep_features` uses dim / 2 - 1)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = (1000 * t)[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden: int, features: int):
        super().__init__()
        self.features = features
        self.mlp = nn.Sequential(nn.Linear(features, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        # the features from float32 t (a bfloat16 t would move the step), then the model's dtype
        return self.mlp(timestep_features(t.float(), self.features).to(self.mlp[0].weight.dtype))


class SelfAttention(nn.Module):
    """Multi-head attention with LayerNorm on each head's queries and keys."""

    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.q_norm = nn.LayerNorm(head_dim)
        self.k_norm = nn.LayerNorm(head_dim)
        self.proj = nn.Linear(inner, dim)

    def heads_of(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None,
                past: BlockCache | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (B, T, C); key_mask: (B, T) bool, the keys each row may read, or None for all. Returns the output and
        the keys and values, the past ones first."""
        q = self.q_norm(self.heads_of(self.to_q(x)))
        k = self.k_norm(self.heads_of(self.to_k(x)))
        v = self.heads_of(self.to_v(x))
        if past is not None:
            k, v = torch.cat([past.keys, k], dim=2), torch.cat([past.values, v], dim=2)
        mask = None if key_mask is None else key_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(x.size(0), x.size(1), -1)), k, v


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


def causal_conv(conv: nn.Conv1d, x: torch.Tensor, tail: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (B, C, T) after `tail`, the kernel - 1 frames before it (zeros at the start). Returns the output and the
    new tail."""
    context = conv.kernel_size[0] - 1
    if tail is None:
        tail = x.new_zeros(x.size(0), x.size(1), context)
    x = torch.cat([tail, x], dim=2)
    return conv(x), x[:, :, -context:]


class CausalConvBlock(nn.Module):
    """Causal conv -> LayerNorm -> Mish -> causal conv, on (B, T, C) frames."""

    def __init__(self, dim: int, kernel: int = 3):
        super().__init__()
        # indices match the reference Sequential(transpose, conv, transpose, norm, mish, transpose, conv, transpose)
        self.block = nn.ModuleDict({"1": nn.Conv1d(dim, dim, kernel), "3": nn.LayerNorm(dim),
                                    "6": nn.Conv1d(dim, dim, kernel)})

    def forward(self, x: torch.Tensor,
                tails: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        tail1, tail2 = tails or (None, None)
        h, tail1 = causal_conv(self.block["1"], x.transpose(1, 2), tail1)
        h = F.mish(self.block["3"](h.transpose(1, 2)))
        h, tail2 = causal_conv(self.block["6"], h.transpose(1, 2), tail2)
        return h.transpose(1, 2), (tail1, tail2)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


def plain_norm(x: torch.Tensor) -> torch.Tensor:
    """The blocks' LayerNorms have no affine parameters (adaLN supplies shift and scale)."""
    return F.layer_norm(x, x.shape[-1:], eps=1e-6)


class DiTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int, mlp_ratio: float):
        super().__init__()
        self.attn = SelfAttention(dim, heads, head_dim)
        self.conv = CausalConvBlock(dim)
        self.mlp = MLP(dim, int(dim * mlp_ratio))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 9 * dim))

    def forward(self, x: torch.Tensor, c: torch.Tensor, key_mask: torch.Tensor | None,
                past: BlockCache | None) -> tuple[torch.Tensor, BlockCache]:
        """x: (B, T, C); c: (B, 1, C) time embedding; past: the earlier frames' cache (None: there are none)."""
        (shift_attn, scale_attn, gate_attn, shift_mlp, scale_mlp, gate_mlp,
         shift_conv, scale_conv, gate_conv) = self.adaLN_modulation(c).chunk(9, dim=-1)
        h, keys, values = self.attn(modulate(plain_norm(x), shift_attn, scale_attn), key_mask, past)
        x = x + gate_attn * h
        h, tails = self.conv(modulate(plain_norm(x), shift_conv, scale_conv), past and past.conv_tails)
        x = x + gate_conv * h
        x = x + gate_mlp * self.mlp(modulate(plain_norm(x), shift_mlp, scale_mlp))
        return x, BlockCache(keys, values, tails)


class FinalLayer(nn.Module):
    def __init__(self, dim: int, out_channels: int):
        super().__init__()
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))
        self.linear = nn.Linear(dim, out_channels)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=-1)
        return self.linear(modulate(plain_norm(x), shift, scale))


class DiT(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.cfg = cfg
        self.t_embedder = TimestepEmbedder(cfg.hidden_size, cfg.time_features)
        self.in_proj = nn.Linear(cfg.in_channels, cfg.hidden_size)
        self.blocks = nn.ModuleList(DiTBlock(cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.mlp_ratio)
                                    for _ in range(cfg.depth))
        self.final_layer = FinalLayer(cfg.hidden_size, cfg.out_channels)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor,
                cond: torch.Tensor) -> torch.Tensor:
        """x, mu, cond: (B, 80, T); mask: (B, 1, T), nonzero on valid frames; t: (B,); spks: (B, 80).
        Returns the velocity (B, 80, T)."""
        return self._run(x, mu, t, spks, cond, mask[:, 0].bool(), None)[0]

    def forward_chunk(self, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
                      past: list[BlockCache] | None) -> tuple[torch.Tensor, list[BlockCache]]:
        """The next chunk's frames (no padding), after the frames `past` caches (None: the first chunk).
        Returns the velocity and the cache with this chunk added."""
        return self._run(x, mu, t, spks, cond, None, past)

    def _run(self, x, mu, t, spks, cond, key_mask, past) -> tuple[torch.Tensor, list[BlockCache]]:
        c = self.t_embedder(t).unsqueeze(1)
        h = torch.cat([x, mu, spks[:, :, None].expand(-1, -1, x.size(-1)), cond], dim=1).transpose(1, 2)
        h = self.in_proj(h)
        caches = []
        for block, block_past in zip(self.blocks, past or [None] * len(self.blocks)):
            h, cache = block(h, c, key_mask, block_past)
            caches.append(cache)
        return self.final_layer(h, c).transpose(1, 2), caches
