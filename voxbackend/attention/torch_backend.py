"""Reference paged attention in plain torch: correct on any device, used for parity and on CPU.

Every sequence of the step is attended on its own, over exactly its keys: a decode row sees every cached key (no
mask), a prefill chunk gets a causal mask offset by its cached context, so the same code path serves fresh
prefills, chunked prefills and decodes. A sequence whose pages are consecutive in the pool reads its keys as a
view of the pool; any other gathers its pages, once per layer. (One padded batch for all decode rows copied every
key of every row into a fresh tensor per layer: 8-20x slower on CPU at 32 streams than these per-sequence calls.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from voxbackend.attention.base import SeqSlice


@dataclass
class _Seq:
    rows: slice  # this sequence's rows of the flattened batch
    keys: int  # keys it attends: cached context + this step's tokens
    first_slot: int | None  # its pages are consecutive: its keys are pool slots first_slot .. first_slot + keys
    pages: torch.Tensor | None  # otherwise the pages holding its keys, in order
    mask: torch.Tensor | None  # [1, 1, q_len, keys] causal mask of a prefill chunk; None: a decode row sees all


class TorchPagedAttention:
    def __init__(self, kv_cache: torch.Tensor, page_size: int, scratch_page: int, scale: float):
        # kv_cache: [layers, 2, pages, page_size, kv_heads, head_dim]; no padding, so the scratch page is unused
        self.kv_cache = kv_cache
        self.page_size = page_size
        self.scale = scale
        self.slot_mapping: torch.Tensor | None = None
        self.seqs: list[_Seq] = []

    def plan(self, seqs: list[SeqSlice]) -> None:
        device = self.kv_cache.device
        ps = self.page_size
        write: list[int] = []
        self.seqs = []
        for s in seqs:
            total = s.context_len + s.q_len
            used = s.pages[: (total + ps - 1) // ps]
            write.extend(used[i // ps] * ps + i % ps for i in range(s.context_len, total))
            consecutive = used == list(range(used[0], used[0] + len(used)))
            mask = None
            if s.q_len > 1:
                q_pos = torch.arange(s.context_len, total, device=device)[:, None]
                mask = (torch.arange(total, device=device)[None, :] <= q_pos)[None, None]
            self.seqs.append(_Seq(
                rows=slice(s.q_start, s.q_start + s.q_len),
                keys=total,
                first_slot=used[0] * ps if consecutive else None,
                pages=None if consecutive else torch.tensor(used, dtype=torch.long, device=device),
                mask=mask,
            ))
        self.slot_mapping = torch.tensor(write, dtype=torch.long, device=device)

    @staticmethod
    def _read(pages: torch.Tensor, s: _Seq) -> torch.Tensor:
        """One layer's k or v pages [pages, page_size, KVH, D] -> this sequence's keys as [1, KVH, keys, D]."""
        if s.first_slot is not None:
            keys = pages.view(-1, *pages.shape[2:])[s.first_slot : s.first_slot + s.keys]
        else:
            keys = pages.index_select(0, s.pages).view(-1, *pages.shape[2:])[: s.keys]
        return keys.transpose(0, 1)[None]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_pages, v_pages = self.kv_cache[layer, 0], self.kv_cache[layer, 1]
        k_pages.view(-1, *k.shape[1:]).index_copy_(0, self.slot_mapping, k.to(k_pages.dtype))
        v_pages.view(-1, *v.shape[1:]).index_copy_(0, self.slot_mapping, v.to(v_pages.dtype))
        out = torch.empty_like(q)
        for s in self.seqs:
            o = F.scaled_dot_product_attention(
                q[s.rows].transpose(0, 1)[None],  # [1, H, q_len, D]
                self._read(k_pages, s).to(q.dtype),
                self._read(v_pages, s).to(q.dtype),
                attn_mask=s.mask,
                scale=self.scale,
                enable_gqa=True,
            )
            out[s.rows] = o[0].transpose(0, 1)
        return out
