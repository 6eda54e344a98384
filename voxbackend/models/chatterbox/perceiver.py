"""T3's Perceiver resampler: any number of conditioning speech rows -> a fixed 32 rows.

32 learned queries and one attention block (shared LayerNorm over both inputs, q/k/v/out projections with bias,
4 heads, residual on the query side) applied twice: the queries attend to the speech rows, then the result to
itself. Upstream hard-codes width 1024; here it is the backbone's hidden size. Weight names are upstream's
(`pre_attention_query`, `attn.norm`, `attn.to_q`, `attn.to_k`, `attn.to_v`, `attn.proj_out`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

QUERIES = 32
HEADS = 4


class AttentionBlock(nn.Module):
    def __init__(self, dim: int, heads: int = HEADS):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)  # upstream's default eps (1e-5)
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.proj_out = nn.Linear(dim, dim)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], self.heads, -1).transpose(0, 1)  # [L, dim] -> [heads, L, head_dim]

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """x [Lq, dim] attends to context [Lk, dim] (no mask) -> [Lq, dim]."""
        xn, cn = self.norm(x), self.norm(context)
        h = F.scaled_dot_product_attention(self.split(self.to_q(xn)), self.split(self.to_k(cn)),
                                           self.split(self.to_v(cn)))
        return x + self.proj_out(h.transpose(0, 1).reshape(x.shape))


class Perceiver(nn.Module):
    def __init__(self, dim: int, queries: int = QUERIES, heads: int = HEADS):
        super().__init__()
        self.pre_attention_query = nn.Parameter(torch.empty(1, queries, dim))
        self.attn = AttentionBlock(dim, heads)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [N, dim] -> [queries, dim]."""
        pre = self.attn(self.pre_attention_query[0], h)
        return self.attn(pre, pre)
