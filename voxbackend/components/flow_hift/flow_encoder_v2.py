"""Streaming for Step-Audio 2's token encoder (`UpsampleConformerEncoderV2.forward_chunk`) on our
`UpsampleConformerEncoder` modules: over a whole utterance V2 is that same network, it only streams differently.

Where the CosyVoice2 encoder re-encodes a window with chunk-causal masks, V2 encodes each chunk once and keeps
caches: every attention layer's keys and values (a chunk attends to all earlier tokens and to its whole self), the
lookahead layer's last two conv1 outputs and the upsampler's last 2 x stride repeated frames. A chunk's input is its
tokens followed by `pre_lookahead_len` lookahead tokens, which open the next chunk; the last chunk has none and is
padded with zeros instead (after the embedding, as the whole-utterance pass does).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from voxbackend.components.flow_hift.flow_encoder import (
    ConformerLayer,
    RelPositionAttention,
    UpsampleConformerEncoder,
    relative_position_table,
)

KeyValue = tuple[torch.Tensor, torch.Tensor]   # (B, heads, cached frames, head_dim) each


@dataclass
class EncoderCache:
    tokens: int                         # tokens encoded so far (the first stack's cached length)
    lookahead_tail: torch.Tensor        # (B, C, 2) the lookahead layer's last conv1 outputs
    upsample_tail: torch.Tensor         # (B, C, 2 x stride) the last repeated frames before the upsampling conv
    key_values: list[KeyValue]          # the encoders', then the up_encoders'


def attend_with_cache(attn: RelPositionAttention, x: torch.Tensor, table: torch.Tensor,
                      past: KeyValue | None) -> tuple[torch.Tensor, KeyValue]:
    """x: (B, T, C), the newest T positions; table: relative sinusoids for (cached + T) positions. No mask."""
    b, t, _ = x.shape
    q = attn.linear_q(x).view(b, t, attn.heads, attn.head_dim)
    k = attn.linear_k(x).view(b, t, attn.heads, attn.head_dim).transpose(1, 2)
    v = attn.linear_v(x).view(b, t, attn.heads, attn.head_dim).transpose(1, 2)
    if past is not None:
        k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
    total = k.size(2)
    p = attn.linear_pos(table).view(1, -1, attn.heads, attn.head_dim).transpose(1, 2)
    content = torch.matmul((q + attn.pos_bias_u).transpose(1, 2), k.transpose(-2, -1))
    position = torch.matmul((q + attn.pos_bias_v).transpose(1, 2), p.transpose(-2, -1))  # (B, H, T, 2 total - 1)
    # column c of `position` is distance total-1-c; query i sits at total-t+i, so it is at distance total-t+i-j
    # from key j
    i, j = torch.arange(t, device=x.device), torch.arange(total, device=x.device)
    index = (t - 1 - i[:, None] + j[None, :]).expand(b, attn.heads, t, total)
    scores = (content + position.gather(-1, index)) / math.sqrt(attn.head_dim)
    out = torch.matmul(torch.softmax(scores, dim=-1), v).transpose(1, 2).reshape(b, t, -1)
    return attn.linear_out(out), (k, v)


def conformer_with_cache(layer: ConformerLayer, x: torch.Tensor, table: torch.Tensor,
                         past: KeyValue | None) -> tuple[torch.Tensor, KeyValue]:
    h, key_value = attend_with_cache(layer.self_attn, layer.norm_mha(x), table, past)
    x = x + h
    return x + layer.feed_forward(layer.norm_ff(x)), key_value


def encode_chunk(encoder: UpsampleConformerEncoder, x: torch.Tensor, cache: EncoderCache | None,
                 last_chunk: bool) -> tuple[torch.Tensor, EncoderCache]:
    """x: (B, T, C) token embeddings, the last pre_lookahead_len of them lookahead unless last_chunk.
    Returns (B, stride x tokens, C) for the chunk's own tokens and the cache for the next chunk."""
    cfg = encoder.cfg
    lookahead, stride = cfg.pre_lookahead_len, cfg.upsample
    b, n_layers = x.size(0), len(encoder.encoders)
    h = encoder.embed(x)
    if last_chunk:
        h = F.pad(h, (0, 0, 0, lookahead))
    past_tokens = cache.tokens if cache else 0
    past = cache.key_values if cache else [None] * (n_layers + len(encoder.up_encoders))

    la = encoder.pre_lookahead_layer
    conv1 = F.leaky_relu(la.conv1(h.transpose(1, 2)))          # one output per token that has its lookahead
    tail = cache.lookahead_tail if cache else conv1.new_zeros(b, conv1.size(1), 2)
    conv1 = torch.cat([tail, conv1], dim=2)
    h = la.conv2(conv1).transpose(1, 2) + h[:, :-lookahead]
    tokens = h.size(1)

    table = relative_position_table(past_tokens + tokens, cfg.size, x.device, h.dtype)
    key_values = []
    for layer, layer_past in zip(encoder.encoders, past[:n_layers]):
        h, key_value = conformer_with_cache(layer, h, table, layer_past)
        key_values.append(key_value)

    repeated = F.interpolate(h.transpose(1, 2), scale_factor=float(stride), mode="nearest")
    up_tail = cache.upsample_tail if cache else repeated.new_zeros(b, repeated.size(1), 2 * stride)
    repeated = torch.cat([up_tail, repeated], dim=2)
    h = encoder.up_embed(encoder.up_layer.conv(repeated).transpose(1, 2))

    table = relative_position_table(stride * (past_tokens + tokens), cfg.size, x.device, h.dtype)
    for layer, layer_past in zip(encoder.up_encoders, past[n_layers:]):
        h, key_value = conformer_with_cache(layer, h, table, layer_past)
        key_values.append(key_value)
    new_cache = EncoderCache(past_tokens + tokens, conv1[:, :, -2:], repeated[:, :, -2 * stride:], key_values)
    return encoder.after_norm(h), new_cache
