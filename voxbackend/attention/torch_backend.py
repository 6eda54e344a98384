"""Reference paged attention in plain torch: correct on any device, used for parity and on CPU.

Decode rows (one new token each) are attended together as one padded batch; each prefill chunk is attended
on its own with a causal mask offset by its cached context. KV entries are read from the pages every time,
so the same code path serves fresh prefills, chunked prefills and decodes. Keys are gathered whole pages at a
time (`index_select` over the page table): a page is one contiguous block of the pool, so this copies a few
large blocks instead of one small row per key position.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from voxbackend.attention.base import SeqSlice
from voxbackend.attention.paged_plan import slot_mapping
from voxbackend.ints import long_tensor


@dataclass
class _Group:
    rows: torch.Tensor  # [B] or [q_len] indices into the flattened batch
    pages: torch.Tensor  # [B * pages_per_row] page table, flattened; short rows padded with the scratch page
    mask: torch.Tensor  # [B, 1, q, pages_per_row * page_size] True where attention is allowed
    is_decode: bool


class TorchPagedAttention:
    graphable = False  # its decode metadata changes shape with the longest row: eager only (padded or not)

    def __init__(self, kv_cache: torch.Tensor, page_size: int, scratch_page: int, scale: float):
        # kv_cache: [layers, 2, pages, page_size, kv_heads, head_dim]
        self.kv_cache = kv_cache
        self.page_size = page_size
        self.scratch_page = scratch_page
        self.scale = scale
        self.slot_mapping: torch.Tensor | None = None
        self.groups: list[_Group] = []

    def plan(self, seqs: list[SeqSlice], slots: torch.Tensor | None = None) -> None:
        device = self.kv_cache.device
        ps = self.page_size
        decodes: list[SeqSlice] = []
        self.groups = []
        for s in seqs:
            if s.q_len == 1:
                decodes.append(s)
                continue
            total = s.context_len + s.q_len
            used = -(-total // ps)
            q_pos = torch.arange(s.context_len, total, device=device)[:, None]
            mask = (torch.arange(used * ps, device=device)[None, :] <= q_pos)[None, None]
            rows = torch.arange(s.q_start, s.q_start + s.q_len, device=device)
            pages = long_tensor(s.pages[:used], device)
            self.groups.append(_Group(rows, pages, mask, is_decode=False))
        if decodes:
            keys = np.array([s.context_len + 1 for s in decodes])
            width = -(-int(keys.max()) // ps)
            # one flat array of every row's pages, spread into the scratch-padded table in one numpy step
            used = -(-keys // ps)
            flat = np.fromiter(itertools.chain.from_iterable(s.pages[:u] for s, u in zip(decodes, used.tolist())),
                               np.int64)
            table = np.full((len(decodes), width), self.scratch_page, dtype=np.int64)
            table[np.arange(width)[None, :] < used[:, None]] = flat
            valid = np.arange(width * ps)[None, :] < keys[:, None]
            rows = long_tensor([s.q_start for s in decodes], device)
            self.groups.append(_Group(rows, torch.from_numpy(table).view(-1).to(device),
                                      torch.from_numpy(valid).to(device)[:, None, None, :], is_decode=True))
        write = torch.from_numpy(slot_mapping(seqs, ps))  # the FlashInfer backend's slots, too
        # a static buffer (engine/decode_graphs.py) when given
        self.slot_mapping = write.to(device) if slots is None else slots.copy_(write)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_pages, v_pages = self.kv_cache[layer, 0], self.kv_cache[layer, 1]
        k_pages.view(-1, *k.shape[1:]).index_copy_(0, self.slot_mapping, k.to(k_pages.dtype))
        v_pages.view(-1, *v.shape[1:]).index_copy_(0, self.slot_mapping, v.to(v_pages.dtype))
        out = torch.empty_like(q)
        for g in self.groups:
            batch = len(g.rows) if g.is_decode else 1
            # [B * pages, page_size, KVH, D] -> [B, KVH, pages * page_size, D]
            keys = k_pages.index_select(0, g.pages).view(batch, -1, *k.shape[1:]).transpose(1, 2)
            values = v_pages.index_select(0, g.pages).view(batch, -1, *v.shape[1:]).transpose(1, 2)
            if g.is_decode:
                queries = q[g.rows][:, :, None, :]  # [B, H, 1, D]
            else:
                queries = q[g.rows].transpose(0, 1)[None]  # [1, H, q_len, D]
            o = F.scaled_dot_product_attention(
                queries, keys.to(q.dtype), values.to(q.dtype), attn_mask=g.mask, scale=self.scale, enable_gqa=True
            )
            out[g.rows] = o[:, :, 0, :] if g.is_decode else o[0].transpose(0, 1)
        return out
