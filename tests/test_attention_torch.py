"""The torch paged attention: each sequence over exactly its own keys, read as a pool view or gathered pages.

Checked against a float64 dense reference, against the padded-batch implementation it replaced
(`PaddedBatchAttention`, kept here as it was), and view against gather on the same keys.
"""
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from voxbackend.attention.base import SeqSlice
from voxbackend.attention.torch_backend import TorchPagedAttention

LAYERS, PAGES, PS, KVH, H, D = 2, 64, 4, 2, 4, 8
SCALE = D**-0.5


@dataclass
class _Group:
    rows: torch.Tensor  # [B] or [q_len] indices into the flattened batch
    slots: torch.Tensor  # [B, max_kv] KV slot per key position
    mask: torch.Tensor  # [B, 1, q, max_kv] True where attention is allowed
    is_decode: bool


class PaddedBatchAttention:
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


def _steps(scattered: bool):
    """Page tables and two steps of a mixed batch: fresh prefill, chunked prefill with context, decodes."""
    order = torch.randperm(PAGES - 1, generator=torch.Generator().manual_seed(1)).tolist() if scattered \
        else list(range(PAGES - 1))
    tables = [order[i * 10 : (i + 1) * 10] for i in range(5)]
    # (q_start, q_len, context): seq 0 fresh prefill of 7, seq 1 chunk of 5 after 6 cached, seqs 2-4 decodes
    first = [(0, 7, 0), (7, 5, 6), (12, 1, 0), (13, 1, 9), (14, 1, 22)]
    second = [(0, 1, 7), (1, 1, 11), (2, 1, 1), (3, 3, 10), (6, 1, 23)]  # seq 3: a chunk after decodes
    return [[SeqSlice(a, n, c, tables[i]) for i, (a, n, c) in enumerate(step)] for step in (first, second)]


def _pool_with_history(seqs: list[SeqSlice], g: torch.Generator) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A pool whose cached context of each sequence holds known keys/values; returns it and those per sequence."""
    pool = torch.randn(LAYERS, 2, PAGES, PS, KVH, D, generator=g)  # stale contents everywhere else
    history = []
    for s in seqs:
        kv = torch.randn(LAYERS, 2, s.context_len, KVH, D, generator=g)
        for i in range(s.context_len):
            pool[:, :, s.pages[i // PS], i % PS] = kv[:, :, i]
        history.append(kv)
    return pool, history


def _dense(q, keys, values, context_len):
    """float64 attention of one sequence's queries [q_len, H, D] over keys [n, KVH, D] (causal by position)."""
    q_len, n = q.shape[0], keys.shape[0]
    rep = H // KVH
    k = keys.double().repeat_interleave(rep, dim=1)
    v = values.double().repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * SCALE
    allowed = torch.arange(n)[None, :] <= torch.arange(context_len, context_len + q_len)[:, None]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


@pytest.mark.parametrize("scattered", [False, True])
def test_mixed_batch_matches_dense_attention_and_the_padded_batch(scattered):
    g = torch.Generator().manual_seed(0)
    steps = _steps(scattered)
    pool, history = _pool_with_history(steps[0], g)
    new = TorchPagedAttention(pool.clone(), PS, PAGES - 1, SCALE)
    old = PaddedBatchAttention(pool.clone(), PS, PAGES - 1, SCALE)
    for seqs in steps:
        t = sum(s.q_len for s in seqs)
        new.plan(seqs)
        old.plan(seqs)
        for layer in range(LAYERS):
            q, k, v = torch.randn(t, H, D, generator=g), torch.randn(t, KVH, D, generator=g), torch.randn(t, KVH, D, generator=g)
            got = new.attend(layer, q, k, v)
            assert torch.allclose(got, old.attend(layer, q, k, v), rtol=0, atol=1e-6)
            for i, s in enumerate(seqs):
                rows = slice(s.q_start, s.q_start + s.q_len)
                keys = torch.cat([history[i][layer, 0], k[rows]])
                values = torch.cat([history[i][layer, 1], v[rows]])
                want = _dense(q[rows], keys, values, s.context_len)
                assert torch.allclose(got[rows].double(), want, rtol=0, atol=1e-5), (layer, i)
        for i, s in enumerate(seqs):  # this step's keys joined the history for the next step
            history[i] = torch.cat([history[i], new.kv_cache[:, :, [s.pages[p // PS] for p in range(s.context_len, s.context_len + s.q_len)],
                                                             [p % PS for p in range(s.context_len, s.context_len + s.q_len)]]], dim=2)
        assert torch.equal(new.kv_cache, old.kv_cache)  # both wrote the same slots


def test_pool_view_and_page_gather_give_the_same_output():
    g = torch.Generator().manual_seed(2)
    contiguous, scattered = (_steps(False)[0], _steps(True)[0])
    ctx = torch.randn(5, LAYERS, 2, 40, KVH, D, generator=g)
    pools = []
    for seqs in (contiguous, scattered):  # the same keys at two page layouts
        pool = torch.randn(LAYERS, 2, PAGES, PS, KVH, D, generator=g)
        for i, s in enumerate(seqs):
            for p in range(40):
                pool[:, :, s.pages[p // PS], p % PS] = ctx[i, :, :, p]
        pools.append(pool)
    view, gather = (TorchPagedAttention(pool, PS, 0, SCALE) for pool in pools)
    view.plan(contiguous)
    gather.plan(scattered)
    assert all(s.first_slot is not None for s in view.seqs)
    assert [s.first_slot is None for s in gather.seqs] == [True, True, False, True, True]  # seq 2: one page
    t = sum(s.q_len for s in contiguous)
    q, k, v = torch.randn(t, H, D, generator=g), torch.randn(t, KVH, D, generator=g), torch.randn(t, KVH, D, generator=g)
    assert torch.equal(view.attend(1, q, k, v), gather.attend(1, q, k, v))
