"""The flow's token encoder (CosyVoice2 `UpsampleConformerEncoder` layout): 25 Hz token embeddings -> a causal
lookahead conv -> conformer blocks -> x2 upsampling -> conformer blocks -> 50 Hz features for the estimator.

Batched over rows of different lengths (right padding). Exactness per row needs two things the padded batch
would otherwise break: the lookahead conv must see each row's own context tokens (or zeros when finalizing) right
after its last token, not its neighbours' padding; and attention must never read padded columns. Every other op
is causal in time (or pointwise), so garbage in padded rows never reaches valid ones. With `streaming` a row
attends chunk-causally (`chunk_size` tokens, twice that after upsampling), as the model was trained for.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class EncoderConfig:
    size: int = 512             # model width; the reference hard-codes 512 in its lookahead and upsample layers
    heads: int = 8
    linear_units: int = 2048
    num_blocks: int = 6
    num_up_blocks: int = 4
    chunk_size: int = 25        # tokens per attention chunk when streaming
    pre_lookahead_len: int = 3
    upsample: int = 2           # token_mel_ratio


def chunk_attention_mask(lengths: torch.Tensor, total: int, chunk_size: int, streaming: torch.Tensor) -> torch.Tensor:
    """(B, T, T) bool: query i may read key j when j is a valid position and, for streaming rows, j lies in i's chunk
    or an earlier one."""
    pos = torch.arange(total, device=lengths.device)
    valid_key = pos[None, None, :] < lengths[:, None, None]
    chunk_end = (pos // chunk_size + 1) * chunk_size
    causal = pos[None, :] < chunk_end[:, None]
    return valid_key & (causal[None] | ~streaming[:, None, None])


def relative_position_table(length: int, size: int, device, dtype) -> torch.Tensor:
    """(1, 2L-1, size) sinusoids for relative distances L-1 ... -(L-1) (ESPnet's relative positional encoding)."""
    distance = torch.arange(length - 1, -length, -1, dtype=torch.float32, device=device).unsqueeze(1)
    inv_freq = torch.exp(torch.arange(0, size, 2, dtype=torch.float32, device=device) * -(math.log(10000.0) / size))
    table = torch.zeros(2 * length - 1, size, device=device)
    table[:, 0::2] = torch.sin(distance * inv_freq)
    table[:, 1::2] = torch.cos(distance * inv_freq)
    return table.unsqueeze(0).to(dtype)


class LinearEmbed(nn.Module):
    """Linear + LayerNorm, scaled by sqrt(size) (the positional part is applied inside attention)."""

    def __init__(self, size: int):
        super().__init__()
        self.out = nn.Sequential(nn.Linear(size, size), nn.LayerNorm(size, eps=1e-5))
        self.scale = math.sqrt(size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x) * self.scale


class RelPositionAttention(nn.Module):
    """Transformer-XL style attention: content score (q + u)k plus position score (q + v)p(i - j)."""

    def __init__(self, size: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, size // heads
        self.linear_q = nn.Linear(size, size)
        self.linear_k = nn.Linear(size, size)
        self.linear_v = nn.Linear(size, size)
        self.linear_out = nn.Linear(size, size)
        self.linear_pos = nn.Linear(size, size, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(heads, self.head_dim))
        self.pos_bias_v = nn.Parameter(torch.zeros(heads, self.head_dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pos_table: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.linear_q(x).view(b, t, self.heads, self.head_dim)
        k = self.linear_k(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        v = self.linear_v(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        p = self.linear_pos(pos_table).view(1, -1, self.heads, self.head_dim).transpose(1, 2)
        content = torch.matmul((q + self.pos_bias_u).transpose(1, 2), k.transpose(-2, -1))
        position = torch.matmul((q + self.pos_bias_v).transpose(1, 2), p.transpose(-2, -1))  # (B, H, T, 2T-1)
        # column c of `position` is distance T-1-c; query i and key j are at distance i-j
        i = torch.arange(t, device=x.device)
        index = (t - 1 - i[:, None] + i[None, :]).expand(b, self.heads, t, t)
        scores = (content + position.gather(-1, index)) / math.sqrt(self.head_dim)
        blocked = ~mask[:, None]
        attn = torch.softmax(scores.masked_fill(blocked, float("-inf")), dim=-1).masked_fill(blocked, 0.0)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, t, -1)
        return self.linear_out(out)


class FeedForward(nn.Module):
    def __init__(self, size: int, hidden: int):
        super().__init__()
        self.w_1 = nn.Linear(size, hidden)
        self.w_2 = nn.Linear(hidden, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class ConformerLayer(nn.Module):
    """Pre-norm attention + feed-forward (CosyVoice2 runs its conformer without the conv module or macaron FFN)."""

    def __init__(self, size: int, heads: int, hidden: int):
        super().__init__()
        self.self_attn = RelPositionAttention(size, heads)
        self.feed_forward = FeedForward(size, hidden)
        self.norm_mha = nn.LayerNorm(size, eps=1e-12)
        self.norm_ff = nn.LayerNorm(size, eps=1e-12)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pos_table: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.norm_mha(x), mask, pos_table)
        return x + self.feed_forward(self.norm_ff(x))


class PreLookahead(nn.Module):
    """conv1 reads each token and the `lookahead` after it; conv2 is causal; residual."""

    def __init__(self, size: int, lookahead: int):
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(size, size, kernel_size=lookahead + 1)
        self.conv2 = nn.Conv1d(size, size, kernel_size=3)

    def forward(self, x: torch.Tensor, out_len: int) -> torch.Tensor:
        """x: (B, T, C) with each row's lookahead context (or zeros) already right after its tokens."""
        h = F.pad(x.transpose(1, 2), (0, self.lookahead))
        h = F.leaky_relu(self.conv1(h))[:, :, :out_len]
        h = self.conv2(F.pad(h, (2, 0)))
        return h.transpose(1, 2) + x[:, :out_len]


class Upsample(nn.Module):
    """Nearest-neighbour repeat, then a causal conv."""

    def __init__(self, size: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(size, size, stride * 2 + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.interpolate(x.transpose(1, 2), scale_factor=float(self.stride), mode="nearest")
        return self.conv(F.pad(h, (self.stride * 2, 0))).transpose(1, 2)


class UpsampleConformerEncoder(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = LinearEmbed(cfg.size)
        self.pre_lookahead_layer = PreLookahead(cfg.size, cfg.pre_lookahead_len)
        self.encoders = nn.ModuleList(ConformerLayer(cfg.size, cfg.heads, cfg.linear_units)
                                      for _ in range(cfg.num_blocks))
        self.up_layer = Upsample(cfg.size, cfg.upsample)
        self.up_embed = LinearEmbed(cfg.size)
        self.up_encoders = nn.ModuleList(
            ConformerLayer(cfg.size, cfg.heads, cfg.linear_units) for _ in range(cfg.num_up_blocks))
        self.after_norm = nn.LayerNorm(cfg.size, eps=1e-5)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor, context_lens: torch.Tensor,
                streaming: torch.Tensor, max_length: int | None = None) -> torch.Tensor:
        """x: (B, T, C) token embeddings, row b = lengths[b] tokens then context_lens[b] lookahead tokens.
        streaming: (B,) bool; max_length: max(lengths) when the caller knows it (else read back from the device).
        Returns (B, upsample * max(lengths), C); row b is valid for upsample * lengths[b]."""
        cfg = self.cfg
        pos = torch.arange(x.size(1), device=x.device)
        h = self.embed(x)
        # the reference pads the lookahead with zeros *after* the embedding: zero what lies past the context
        h = h * (pos[None, :] < (lengths + context_lens)[:, None]).unsqueeze(-1).to(h.dtype)
        t = int(lengths.max()) if max_length is None else max_length
        h = self.pre_lookahead_layer(h, t)
        mask = chunk_attention_mask(lengths, t, cfg.chunk_size, streaming)
        table = relative_position_table(t, cfg.size, x.device, h.dtype)
        for layer in self.encoders:
            h = layer(h, mask, table)
        h = self.up_embed(self.up_layer(h))
        t, lengths = h.size(1), lengths * cfg.upsample
        mask = chunk_attention_mask(lengths, t, cfg.chunk_size * cfg.upsample, streaming)
        table = relative_position_table(t, cfg.size, x.device, h.dtype)
        for layer in self.up_encoders:
            h = layer(h, mask, table)
        return self.after_norm(h)
