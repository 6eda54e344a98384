"""CosyVoice 1's flow token encoder (`ConformerEncoder`: linear input layer, ESPnet relative positions, pre-norm
attention + feed-forward blocks without the conv module or macaron FFN), at the token rate: no lookahead conv and
no upsampling, unlike CosyVoice2's (flow_encoder.py), whose layers it reuses.

GLM-4-Voice's decoder runs it block-causally, streamed or not (its `BlockConformerEncoder` with
`block_rel_selfattn`): a token attends to every earlier token and to the rest of its block of `block_size`, blocks
counted from the first prompt token. Its layer norms use eps 1e-5 where upstream CosyVoice's use 1e-12.

Batched over rows of different lengths (right padding): attention never reads padded keys and every other op is
per position, so each row gets what it would alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from voxbackend.components.flow_hift.flow_encoder import (
    ConformerLayer,
    LinearEmbed,
    chunk_attention_mask,
    relative_position_table,
)


@dataclass(frozen=True)
class ConformerConfig:
    size: int = 512
    heads: int = 8
    linear_units: int = 2048
    num_blocks: int = 6
    block_size: int = 10        # tokens per causal attention block; 0: full attention
    norm_eps: float = 1e-5      # the blocks' layer norms (GLM-4-Voice's value)


class ConformerEncoder(nn.Module):
    def __init__(self, cfg: ConformerConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = LinearEmbed(cfg.size)
        self.encoders = nn.ModuleList(ConformerLayer(cfg.size, cfg.heads, cfg.linear_units)
                                      for _ in range(cfg.num_blocks))
        for layer in self.encoders:     # ConformerLayer is built with CosyVoice's eps
            layer.norm_mha.eps = layer.norm_ff.eps = cfg.norm_eps
        self.after_norm = nn.LayerNorm(cfg.size, eps=1e-5)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """x: (B, T, size) token embeddings, row b valid for lengths[b]. Returns (B, T, size)."""
        cfg = self.cfg
        b, t, _ = x.shape
        blocked = torch.full((b,), cfg.block_size > 0, device=x.device)
        mask = chunk_attention_mask(lengths, t, max(cfg.block_size, 1), blocked)
        h = self.embed(x)
        table = relative_position_table(t, cfg.size, x.device, h.dtype)
        for layer in self.encoders:
            h = layer(h, mask, table)
        return self.after_norm(h)
