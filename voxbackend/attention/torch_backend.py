"""Reference paged attention in plain torch: correct on any device, used for parity and on CPU.

Decode rows (one new token each) are attended together as one padded batch; each prefill chunk is attended
on its own with a causal mask offset by its cached context. KV entries are read from the pages every time,
so the same code path serves fresh prefills, chunked prefills and decodes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from voxbackend.attention.base import SeqSlice


@dataclass
class _Group:
    rows: torch.Tensor  # [B] or [q_len] indices into the flattened batch
    slots: torch.Tensor  # [B, max_kv] KV slot per key position
    mask: torch.Tensor  # [B, 1, q, max_kv] True where attention is allowed
    is_decode: bool


class TorchPagedAttention:
    def __init__(self, kv_cache: torch.Tensor, page_size: int, scratch_page: int, scale: float):
        # kv_cache: [layers, 2, pages, page_size, kv_heads, head_dim]
        self.kv_cache = kv_cache
        self.page_size = page_size
        self.scratch_slot = scratch_page * page_size
        self.scale = scale
        self.slot_mapping: torch.Tensor | None = None
        self.groups: list[_Group] = []

    def _slots(self, pages: list[int], n: int) -> list[int]:
        ps = self.page_size
        return [pages[i // ps] * ps + i % ps for i in range(n)]

    def plan(self, seqs: list[SeqSlice]) -> None:
        device = self.kv_cache.device
        write: list[int] = []
        decodes: list[SeqSlice] = []
        self.groups = []
        for s in seqs:
            total = s.context_len + s.q_len
            write.extend(self._slots(s.pages, total)[s.context_len:])
            if s.q_len == 1:
                decodes.append(s)
                continue
            slots = torch.tensor([self._slots(s.pages, total)], device=device)
            q_pos = torch.arange(s.context_len, total, device=device)[:, None]
            mask = (torch.arange(total, device=device)[None, :] <= q_pos)[None, None]
            rows = torch.arange(s.q_start, s.q_start + s.q_len, device=device)
            self.groups.append(_Group(rows, slots, mask, is_decode=False))
        if decodes:
            max_kv = max(s.context_len + 1 for s in decodes)
            slots = torch.full((len(decodes), max_kv), self.scratch_slot, dtype=torch.long)
            valid = torch.zeros((len(decodes), max_kv), dtype=torch.bool)
            for i, s in enumerate(decodes):
                n = s.context_len + 1
                slots[i, :n] = torch.tensor(self._slots(s.pages, n))
                valid[i, :n] = True
            rows = torch.tensor([s.q_start for s in decodes], device=device)
            self.groups.append(_Group(rows, slots.to(device), valid.to(device)[:, None, None, :], is_decode=True))
        self.slot_mapping = torch.tensor(write, dtype=torch.long, device=device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_pool = self.kv_cache[layer, 0].view(-1, *k.shape[1:])
        v_pool = self.kv_cache[layer, 1].view(-1, *v.shape[1:])
        k_pool.index_copy_(0, self.slot_mapping, k.to(k_pool.dtype))
        v_pool.index_copy_(0, self.slot_mapping, v.to(v_pool.dtype))
        out = torch.empty_like(q)
        for g in self.groups:
            keys = k_pool[g.slots].transpose(1, 2)  # [B, KVH, max_kv, D]
            values = v_pool[g.slots].transpose(1, 2)
            if g.is_decode:
                queries = q[g.rows][:, :, None, :]  # [B, H, 1, D]
            else:
                queries = q[g.rows].transpose(0, 1)[None]  # [1, H, q_len, D]
            o = F.scaled_dot_product_attention(
                queries, keys.to(q.dtype), values.to(q.dtype), attn_mask=g.mask, scale=self.scale, enable_gqa=True
            )
            out[g.rows] = o[:, :, 0, :] if g.is_decode else o[0].transpose(0, 1)
        return out
