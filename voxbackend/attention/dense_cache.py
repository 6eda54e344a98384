"""A dense KV cache for a depth transformer's pass over one frame (CSM's depth decoder, Qwen3-TTS' code
predictor): short, the same length for every row, rebuilt each frame, so it needs no pages."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class DenseDepthCache:
    """Dense KV cache of one depth pass: every row of the batch sits at the same position (a frame's codebooks)."""

    def __init__(self, layers: int, batch: int, length: int, kv_heads: int, head_dim: int, like: torch.Tensor):
        self.k = like.new_zeros(layers, batch, length, kv_heads, head_dim)
        self.v = torch.zeros_like(self.k)
        self.batch, self.start = batch, 0

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, s = self.batch, self.start
        t = q.shape[0] // b
        assert t == 1 or s == 0, "several new positions only at the start (the causal mask is top-left aligned)"
        self.k[layer, :, s : s + t] = k.view(b, t, *k.shape[1:])
        self.v[layer, :, s : s + t] = v.view(b, t, *v.shape[1:])
        keys, values = self.k[layer, :, : s + t].transpose(1, 2), self.v[layer, :, : s + t].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.view(b, t, *q.shape[1:]).transpose(1, 2), keys, values, is_causal=t > 1,
            enable_gqa=keys.shape[1] != q.shape[1],
        )
        return out.transpose(1, 2).reshape(q.shape)
