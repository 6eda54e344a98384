"""Paged KV pool: one preallocated tensor of pages, a free list, and page tables per request.

A request's pages grow with its sequence: before each LM step it gets the pages the step's positions need, so the
pool holds as many streams as really fit. When it runs dry the engine preempts a request (gives its pages back
here) rather than fail. The last page is scratch: padding rows write there.
"""
from __future__ import annotations

import math

import torch

from voxbackend.models.base import LMGeometry


class KVPool:
    def __init__(self, geometry: LMGeometry, num_pages: int, page_size: int, device: str, dtype: torch.dtype):
        self.page_size = page_size
        self.num_pages = num_pages
        self.scratch_page = num_pages
        shape = (geometry.num_layers, 2, num_pages + 1, page_size, geometry.num_kv_heads, geometry.head_dim)
        self.cache = torch.zeros(shape, device=device, dtype=dtype)
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low pages first
        self._owner: dict[str, list[int]] = {}

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def missing(self, request_id: str, num_tokens: int) -> int:
        """Pages a request lacks to hold num_tokens positions."""
        return max(0, self.pages_for(num_tokens) - len(self._owner.get(request_id, ())))

    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow a request's page table to hold num_tokens positions; returns the whole table (never shrinks)."""
        n = self.missing(request_id, num_tokens)
        if n > len(self._free):
            raise RuntimeError(f"KV pool has {len(self._free)} free pages, {n} needed")
        if n:
            self._owner.setdefault(request_id, []).extend(self._free.pop() for _ in range(n))
        return list(self._owner.get(request_id, ()))

    def release(self, request_id: str) -> None:
        """Give a request's pages back; releasing twice or for a request without pages is harmless."""
        self._free.extend(reversed(self._owner.pop(request_id, [])))

    def holders(self) -> list[str]:
        return list(self._owner)
