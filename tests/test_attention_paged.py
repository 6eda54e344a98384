"""The torch paged attention equals plain causal attention over each sequence's own keys: decodes and prefill
chunks with cached context in one step, pages scattered over the pool, rows of different lengths."""
import math

import torch

from voxbackend.attention.base import SeqSlice
from voxbackend.attention.torch_backend import TorchPagedAttention

LAYERS, PAGES, PS, KVH, H, D = 2, 40, 4, 2, 4, 8


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, context: int) -> torch.Tensor:
    """q [n, H, D] at positions context.., keys/values [context + n, KVH, D] -> [n, H, D], causal, GQA."""
    rep = H // KVH
    k, v = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
    pos = torch.arange(context, context + len(q))[:, None]
    scores = scores.masked_fill(torch.arange(len(keys))[None, :] > pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_paged_batch_equals_per_sequence_attention():
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(LAYERS, 2, PAGES + 1, PS, KVH, D, generator=g)  # stale data everywhere, scratch too
    attention = TorchPagedAttention(cache, PS, PAGES, 1 / math.sqrt(D))
    order = torch.randperm(PAGES, generator=g).tolist()
    # (cached context, new tokens): decodes of different lengths, a fresh prefill, a chunk after a cached prefix
    shapes = [(9, 1), (0, 6), (3, 1), (13, 1), (5, 7), (0, 1)]
    seqs, history, start = [], [], 0
    for context, n in shapes:
        pages = [order.pop() for _ in range(-(-(context + n) // PS) + 1)]  # one page more than needed
        seqs.append(SeqSlice(start, n, context, pages))
        start += n
    total = start
    k_all = torch.randn(LAYERS, total, KVH, D, generator=g)
    v_all = torch.randn(LAYERS, total, KVH, D, generator=g)
    q_all = torch.randn(LAYERS, total, H, D, generator=g)
    for s in seqs:  # what earlier steps left in the pool: the cached context of each sequence
        slots = [s.pages[i // PS] * PS + i % PS for i in range(s.context_len)]
        past_k = torch.randn(LAYERS, s.context_len, KVH, D, generator=g)
        past_v = torch.randn(LAYERS, s.context_len, KVH, D, generator=g)
        cache[:, 0].view(LAYERS, -1, KVH, D)[:, slots] = past_k
        cache[:, 1].view(LAYERS, -1, KVH, D)[:, slots] = past_v
        history.append((past_k, past_v))
    attention.plan(seqs)
    for layer in range(LAYERS):
        out = attention.attend(layer, q_all[layer], k_all[layer], v_all[layer])
        for s, (past_k, past_v) in zip(seqs, history):
            rows = slice(s.q_start, s.q_start + s.q_len)
            keys = torch.cat([past_k[layer], k_all[layer, rows]])
            values = torch.cat([past_v[layer], v_all[layer, rows]])
            want = reference(q_all[layer, rows], keys, values, s.context_len)
            torch.testing.assert_close(out[rows], want, rtol=1e-5, atol=1e-5)
