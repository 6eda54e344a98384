"""The FlashInfer backend's plan (attention/paged_plan.py) on CPU: attention read through its CSR arrays, as
FlashInfer defines them, equals the torch backend on the same batches, and the slots (which both backends use)
are each row's page and offset by an independent formula. Only the
FlashInfer kernel call itself needs CUDA (tests/test_gpu.py, perf/gpu/run.sh)."""
import numpy as np
import pytest
import torch

from voxbackend.attention.base import SeqSlice
from voxbackend.attention.paged_plan import PagedPlan, paged_plan
from voxbackend.attention.torch_backend import TorchPagedAttention

PS, PAGES, KVH, H, D = 4, 64, 2, 4, 8


def batch(shape: list[tuple[int, int]], rng: np.random.Generator) -> list[SeqSlice]:
    """(context, new rows) per sequence, each on its own shuffled pages."""
    free = rng.permutation(PAGES).tolist()
    seqs, start = [], 0
    for context, q_len in shape:
        n = -(-(context + q_len) // PS) + int(rng.integers(0, 2))  # sometimes a spare page past the end
        seqs.append(SeqSlice(start, q_len, context, [free.pop() for _ in range(n)]))
        start += q_len
    return seqs


def attend_through_plan(plan: PagedPlan, cache: torch.Tensor, q, k, v) -> torch.Tensor:
    """FlashInfer's semantics in plain torch: sequence b's keys are its pages kv_indices[kv_indptr[b]:...] read
    whole but the last, which holds last_page_len[b]; its queries align to the end of its keys (causal)."""
    k_pages, v_pages = cache[0, 0], cache[0, 1]
    k_pages.view(-1, KVH, D)[torch.from_numpy(plan.slot_mapping)] = k
    v_pages.view(-1, KVH, D)[torch.from_numpy(plan.slot_mapping)] = v
    out = torch.empty_like(q)
    for b in range(len(plan.last_page_len)):
        pages = torch.from_numpy(plan.kv_indices[plan.kv_indptr[b]:plan.kv_indptr[b + 1]].astype(np.int64))
        n_keys = (len(pages) - 1) * PS + int(plan.last_page_len[b])
        keys, values = (p[pages].reshape(-1, KVH, D)[:n_keys] for p in (k_pages, v_pages))
        rows = slice(int(plan.qo_indptr[b]), int(plan.qo_indptr[b + 1]))
        n_q = rows.stop - rows.start
        allowed = torch.arange(n_keys)[None, :] <= torch.arange(n_keys - n_q, n_keys)[:, None]
        out[rows] = torch.nn.functional.scaled_dot_product_attention(
            q[rows].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=allowed,
            enable_gqa=True).transpose(0, 1)
    return out


@pytest.mark.parametrize("shape", [
    [(0, 7), (5, 1), (12, 1), (3, 9)],  # mixed prefill chunks and decodes
    [(3, 1), (4, 1), (15, 1), (0, 1)],  # all decodes, at and across page ends
    [(0, 4), (8, 8)],  # chunks ending exactly on a page
])
def test_attention_through_the_plan_equals_the_torch_backend(shape):
    rng = np.random.default_rng(len(shape))
    seqs = batch(shape, rng)
    rows = sum(q for _, q in shape)
    torch.manual_seed(0)
    cache = torch.randn(1, 2, PAGES + 1, PS, KVH, D)
    q, k, v = torch.randn(rows, H, D), torch.randn(rows, KVH, D), torch.randn(rows, KVH, D)
    torch_backend = TorchPagedAttention(cache.clone(), PS, PAGES, D ** -0.5)
    torch_backend.plan(seqs)
    expected = torch_backend.attend(0, q, k, v)
    plan = paged_plan(seqs, PS)
    # each new row's slot: its position's page in the sequence's page table, and the offset in that page
    slots = [s.pages[p // PS] * PS + p % PS for s in seqs for p in range(s.context_len, s.context_len + s.q_len)]
    assert plan.slot_mapping.tolist() == slots
    assert np.array_equal(plan.slot_mapping, torch_backend.slot_mapping.numpy())
    assert plan.all_decode == all(q_len == 1 for _, q_len in shape)
    assert plan.qo_indptr.dtype == plan.kv_indptr.dtype == plan.kv_indices.dtype == np.int32
    assert ((1 <= plan.last_page_len) & (plan.last_page_len <= PS)).all()
    torch.testing.assert_close(attend_through_plan(plan, cache.clone(), q, k, v), expected, rtol=1e-5, atol=1e-5)


def test_rows_out_of_order_are_refused():
    with pytest.raises(ValueError, match="in order"):
        paged_plan([SeqSlice(3, 1, 0, [0]), SeqSlice(0, 3, 0, [1])], PS)
