"""Paged attention through FlashInfer's batch wrappers (CUDA only), behind the torch backend's interface.

One plan per step serves every layer. Steps where every row is a decode use the decode wrapper; steps with any
prefill chunk use the prefill wrapper, whose causal mask aligns each sequence's queries to the end of its keys
(query i of a chunk of n sees keys up to context + i), which covers decode rows in the same batch too.
Keys/values are written with the same slot mapping as the torch backend, so both share one KV pool layout:
per layer (k, v) each [pages, page_size, kv_heads, head_dim] ("NHD"). The plan's arrays come from
attention/paged_plan.py, which the CPU tests check; only the wrappers' calls need CUDA.
"""
from __future__ import annotations

import torch

from voxbackend.attention.base import SeqSlice
from voxbackend.attention.paged_plan import paged_plan
from voxbackend.models.base import LMGeometry

WORKSPACE_BYTES = 256 * 1024 * 1024


class FlashInferPagedAttention:
    graphable = True  # its decode plan lives in static buffers (one CUDA-graph wrapper per bucket)

    def __init__(self, kv_cache: torch.Tensor, page_size: int, scratch_page: int, scale: float, geometry: LMGeometry):
        import flashinfer  # imported here so CPU installs never need it

        self.kv_cache = kv_cache
        self.page_size = page_size
        self.scale = scale
        self.geometry = geometry
        device = kv_cache.device
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=True)
        self.graph_decode: dict[int, object] = {}  # rows -> a decode wrapper whose plan lives in static buffers
        self.slot_mapping: torch.Tensor | None = None
        self.wrapper = None

    def plan(self, seqs: list[SeqSlice], slots: torch.Tensor | None = None) -> None:
        p, ps, g = paged_plan(seqs, self.page_size), self.page_size, self.geometry
        if slots is None:
            self.slot_mapping = torch.from_numpy(p.slot_mapping).to(self.kv_cache.device)
        else:  # a padded decode step (engine/decode_graphs.py): the captured graph reads these buffers
            self.slot_mapping = slots.copy_(torch.from_numpy(p.slot_mapping))
        # the plan's arrays go in as host tensors: plan() reads the indptrs on the host, and device ones would be
        # copied back, waiting for the device, every step
        host = torch.from_numpy
        if p.all_decode:
            decode = self.decode if slots is None else self._graph_decode(len(seqs))
            decode.plan(
                host(p.kv_indptr), host(p.kv_indices), host(p.last_page_len), g.num_heads, g.num_kv_heads,
                g.head_dim, ps, sm_scale=self.scale, q_data_type=self.kv_cache.dtype, kv_data_type=self.kv_cache.dtype,
            )
            self.wrapper = decode
        else:
            self.prefill.plan(
                host(p.qo_indptr), host(p.kv_indptr), host(p.kv_indices), host(p.last_page_len), g.num_heads,
                g.num_kv_heads, g.head_dim, ps, causal=True, sm_scale=self.scale, q_data_type=self.kv_cache.dtype,
                kv_data_type=self.kv_cache.dtype,
            )
            self.wrapper = self.prefill

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.kv_cache[layer, 0], self.kv_cache[layer, 1]
        k_cache.view(-1, *k.shape[1:]).index_copy_(0, self.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, *v.shape[1:]).index_copy_(0, self.slot_mapping, v.to(v_cache.dtype))
        return self.wrapper.run(q.to(k_cache.dtype), (k_cache, v_cache)).to(q.dtype)

    def _graph_decode(self, rows: int):
        """The decode wrapper of a `rows`-row bucket, in FlashInfer's CUDA-graph mode (fixed-size plan buffers,
        filled in place by each plan); one per bucket, sharing the workspace (one step runs at a time)."""
        if rows not in self.graph_decode:
            import flashinfer

            device, int32 = self.kv_cache.device, torch.int32
            pages = self.kv_cache.shape[2] + rows  # every page of the pool, and each dummy row's scratch page
            self.graph_decode[rows] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=torch.empty(rows + 1, dtype=int32, device=device),
                paged_kv_indices_buffer=torch.empty(pages, dtype=int32, device=device),
                paged_kv_last_page_len_buffer=torch.empty(rows, dtype=int32, device=device),
            )
        return self.graph_decode[rows]
