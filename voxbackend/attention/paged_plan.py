"""One step's paged-KV layout in FlashInfer's CSR form, built on the host (numpy for the CSR arrays; the slots by one
comprehension, which both backends share): the FlashInfer backend hands these arrays to its wrappers' plan(), and
the CPU tests check them against the torch backend's view of the same batch (tests/test_paged_plan.py), so only the
kernel call is CUDA-only."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from voxbackend.attention.base import SeqSlice


@dataclass(frozen=True)
class PagedPlan:
    qo_indptr: np.ndarray  # [B + 1] int32: sequence b's query rows are qo_indptr[b]:qo_indptr[b + 1]
    kv_indptr: np.ndarray  # [B + 1] int32: its pages are kv_indices[kv_indptr[b]:kv_indptr[b + 1]]
    kv_indices: np.ndarray  # [pages in use] int32
    last_page_len: np.ndarray  # [B] int32, 1..page_size: keys in its last page (this step's included)
    slot_mapping: np.ndarray  # [rows] int64: the pool slot (page * page_size + offset) each new row's k/v goes to

    @property
    def all_decode(self) -> bool:
        return bool((np.diff(self.qo_indptr) == 1).all())


def slot_mapping(seqs: list[SeqSlice], page_size: int) -> np.ndarray:
    """[rows] int64: the pool slot of each new row's key and value, the page its position falls in (from the
    sequence's page table) times page_size plus the offset in that page. Both backends write through it; one short
    comprehension is faster here than numpy's index arithmetic for the few rows of a decode step (5 vs 40 us at 32)."""
    return np.array([s.pages[p // page_size] * page_size + p % page_size
                     for s in seqs for p in range(s.context_len, s.context_len + s.q_len)], dtype=np.int64)


def paged_plan(seqs: list[SeqSlice], page_size: int) -> PagedPlan:
    """The plan of a flattened batch whose sequences lie in order (FlashInfer's indptr layout requires it)."""
    q_len = np.array([s.q_len for s in seqs], dtype=np.int64)
    context = np.array([s.context_len for s in seqs], dtype=np.int64)
    total = context + q_len
    used = -(-total // page_size)
    qo_indptr = np.concatenate([[0], np.cumsum(q_len)])
    if not np.array_equal(qo_indptr[:-1], [s.q_start for s in seqs]):
        raise ValueError("the sequences' rows must follow one another in order (q_start)")
    kv_indptr = np.concatenate([[0], np.cumsum(used)])
    kv_indices = np.fromiter(itertools.chain.from_iterable(s.pages[:u] for s, u in zip(seqs, used.tolist())),
                             np.int64, count=int(kv_indptr[-1]))
    return PagedPlan(qo_indptr.astype(np.int32), kv_indptr.astype(np.int32), kv_indices.astype(np.int32),
                     (total - (used - 1) * page_size).astype(np.int32), slot_mapping(seqs, page_size))
