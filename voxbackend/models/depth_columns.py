"""A frame's depth pass, one column at a time (CSM's depth decoder, Qwen3-TTS' code predictor).

The backbone's hidden state and the frame's sampled codebook 0 go in; each further codebook k comes from the same
computation: the new positions' inputs (projected where the model has a projection) through the depth transformer,
then column k's head. Between columns the sampled ids are embedded as the next input; sampling stays outside, with
each row's own parameters.

With buckets (engine/decode_graphs.py) a pass is padded to its bucket and every column runs from buffers that
never move: inputs, a dense cache per bucket and the logits. Capturing, each (bucket, column) is a CUDA graph,
captured at first use and replayed after; otherwise the same padded path runs eagerly (the CPU tests compare it with
the unpadded one).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from voxbackend.attention.dense_cache import DenseDepthCache
from voxbackend.cuda_graphs import GraphReplayer, bucket_for, pad_rows


@dataclass
class _Bucket:
    first_input: torch.Tensor  # [b, 2, hidden]: the backbone's state and codebook 0's embedding (positions 0, 1)
    next_input: torch.Tensor  # [b, 1, hidden]: the last sampled codebook's embedding
    cache: DenseDepthCache


class DepthColumns:
    def __init__(self, decoder, columns: int, project: Callable[[torch.Tensor], torch.Tensor],
                 head: Callable[[torch.Tensor, int], torch.Tensor], embed_first: Callable[[torch.Tensor], torch.Tensor],
                 embed_next: Callable[[torch.Tensor, int], torch.Tensor]):
        """project: inputs [B, t, hidden] -> [B, t, depth hidden]; head(h [B, depth hidden], k) -> float logits;
        embed_first(codebook 0 ids [B]) and embed_next(codebook k ids [B], k) -> embeddings [B, hidden]."""
        self.decoder, self.columns = decoder, columns
        self.project, self.head, self.embed_first, self.embed_next = project, head, embed_first, embed_next
        self.sizes: list[int] | None = None
        self.buckets: dict[int, _Bucket] = {}
        self.replayer: GraphReplayer | None = None

    def use_buckets(self, sizes: list[int], capture: bool) -> None:
        self.sizes, self.buckets = sizes, {}
        device = next(self.decoder.parameters()).device
        self.replayer = GraphReplayer("the depth pass", device) if capture else None

    def run(self, hidden: torch.Tensor, first: torch.Tensor, sample_column) -> torch.Tensor:
        """hidden [B, hidden], codebook 0 ids [B] -> the frame's codes [B, columns]; `sample_column(logits, k)`."""
        if self.sizes is None or len(first) > self.sizes[-1]:
            return self._eager(hidden, first, sample_column)
        return self._bucketed(hidden, first, sample_column)

    def _cache(self, batch: int, like: torch.Tensor) -> DenseDepthCache:
        cfg = self.decoder.cfg
        return DenseDepthCache(cfg.num_layers, batch, self.columns, cfg.num_kv_heads, cfg.head_dim, like)

    def _column(self, x: torch.Tensor, cache: DenseDepthCache, k: int) -> torch.Tensor:
        b, t = x.shape[:2]
        positions = torch.arange(cache.start, cache.start + t, device=x.device).repeat(b)
        h = self.decoder.forward_embeds(self.project(x).reshape(b * t, -1), positions, cache)
        cache.start += t
        return self.head(h.view(b, t, -1)[:, -1], k)

    def _eager(self, hidden: torch.Tensor, first: torch.Tensor, sample_column) -> torch.Tensor:
        cache = self._cache(len(first), hidden)
        codes = [first]
        x = torch.stack([hidden, self.embed_first(first)], dim=1)
        for k in range(1, self.columns):
            codes.append(sample_column(self._column(x, cache, k), k))
            x = self.embed_next(codes[-1], k)[:, None]
        return torch.stack(codes, dim=1)

    def _bucketed(self, hidden: torch.Tensor, first: torch.Tensor, sample_column) -> torch.Tensor:
        n = len(first)
        b = bucket_for(self.sizes, n)
        bucket = self.buckets.get(b) or self._new_bucket(b, hidden)
        bucket.first_input.copy_(torch.stack([pad_rows(hidden, b), self.embed_first(pad_rows(first, b))], dim=1))
        codes = [first]
        for k in range(1, self.columns):
            logits = self._static_column(bucket, k)  # the dummy rows' samples are dropped
            codes.append(sample_column(logits[:n], k))
            if k + 1 < self.columns:
                bucket.next_input.copy_(self.embed_next(pad_rows(codes[-1], b), k)[:, None])
        return torch.stack(codes, dim=1)

    def _new_bucket(self, b: int, like: torch.Tensor) -> _Bucket:
        width = like.shape[-1]
        bucket = _Bucket(like.new_zeros(b, 2, width), like.new_zeros(b, 1, width), self._cache(b, like))
        self.buckets[b] = bucket
        return bucket

    def _static_column(self, bucket: _Bucket, k: int) -> torch.Tensor:
        x = bucket.first_input if k == 1 else bucket.next_input

        def column() -> torch.Tensor:
            bucket.cache.start = 0 if k == 1 else k  # positions 0-1 first, then codebook k's own position
            return self._column(x, bucket.cache, k)

        return column() if self.replayer is None else self.replayer.run((len(x), k), column)
