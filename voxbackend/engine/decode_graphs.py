"""Decode steps through static buffers, replayed as CUDA graphs: one graph per batch-size bucket.

A decode step of a few rows launches hundreds of small kernels; on a GPU their launch cost, not the math, sets the
step time. A step whose rows are all decodes (no prompt chunk, no prompt features) is padded up to its bucket
(1, 2, 4, 8, then multiples of 8) with dummy rows: each a one-token sequence on the scratch page, whose key and
value land in that page and whose output is dropped. Its ids, positions and KV slots are copied into buffers that
never move, the attention is planned for the padded batch, and the bucket's graph, captured at its first use,
replays the backbone (voxbackend/cuda_graphs.py; a capture that fails leaves the steps eager).

mode "padded" runs the same padded, static-buffer path eagerly on any device (the CPU tests check it equals the
unpadded path); "graphs" also captures and replays (CUDA, with an attention backend whose plan lives in static
buffers: FlashInfer).
"""
from __future__ import annotations

import numpy as np
import torch

from voxbackend.attention.base import SeqSlice
from voxbackend.cuda_graphs import GraphReplayer, bucket_for, buckets, pad_rows


class DecodeGraphs:
    def __init__(self, model, attention, scratch_page: int, max_rows: int, device: str, capture: bool):
        self.model = model
        self.attention = attention
        self.scratch_page = scratch_page
        self.sizes = buckets(max_rows)
        self.device = device
        self.ids: torch.Tensor | None = None  # [max_rows, *id shape], made at the first step (the id shape)
        self.positions = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.slots = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.replayer = GraphReplayer("the decode step", device) if capture else None

    def accepts(self, seqs: list[SeqSlice], has_features: bool) -> bool:
        return not has_features and len(seqs) <= self.sizes[-1] and all(s.q_len == 1 for s in seqs)

    def forward(self, ids: list, positions: list[int], seqs: list[SeqSlice]) -> torch.Tensor:
        """The backbone's hidden states of a decode step's rows [n, hidden], through the padded bucket."""
        n = len(seqs)
        b = bucket_for(self.sizes, n)
        rows = torch.from_numpy(np.asarray(ids, dtype=np.int64))
        if self.ids is None:
            self.ids = torch.zeros((self.sizes[-1], *rows.shape[1:]), dtype=torch.long, device=self.device)
        # dummy rows repeat the first row's input (valid for every model's embedding) at position 0
        self.ids[:b].copy_(pad_rows(rows, b))
        self.positions[:b].copy_(torch.from_numpy(np.asarray(positions + [0] * (b - n), dtype=np.int64)))
        dummies = [SeqSlice(q_start=i, q_len=1, context_len=0, pages=[self.scratch_page]) for i in range(n, b)]
        self.attention.plan(seqs + dummies, slots=self.slots[:b])

        def run() -> torch.Tensor:
            return self.model.forward(self.ids[:b], self.positions[:b], self.attention)

        return (run() if self.replayer is None else self.replayer.run(b, run))[:n]
