"""Batch-size buckets, and capturing a step that reads and writes fixed buffers as a CUDA graph and replaying it:
shared by the engine's decode step (engine/decode_graphs.py), the depth pass (models/depth_columns.py) and SNAC.
A batch of n rows runs as the smallest bucket that holds it, padded with dummy rows that repeat its first.

A capture that fails (an op that cannot be captured, a copy from host memory) is logged once and that replayer runs
its steps eagerly from then on: the same results, without the speed-up, and no request pays for it.
"""
from __future__ import annotations

import bisect
import logging
from typing import Callable, Hashable

import torch

log = logging.getLogger("voxbackend.engine")


def buckets(max_rows: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to max_rows (always included)."""
    sizes = [b for b in (1, 2, 4) if b < max_rows] + list(range(8, max_rows, 8))
    return sizes + [max_rows]


def bucket_for(sizes: list[int], n: int) -> int:
    """The smallest bucket that holds n rows (n <= sizes[-1])."""
    return sizes[bisect.bisect_left(sizes, n)]


def pad_rows(rows: torch.Tensor, b: int) -> torch.Tensor:
    """rows [n, ...] -> [b, ...]: dummy rows repeat the first (a valid input anywhere; their outputs are dropped)."""
    n = len(rows)
    return torch.cat([rows, rows[:1].expand(b - n, *rows.shape[1:])]) if b > n else rows


class GraphReplayer:
    def __init__(self, name: str, device: str | torch.device):
        self.name = name  # for the log
        self.device = device
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None  # one memory pool for every graph of this replayer (made at the first capture)
        self.failed = False

    def run(self, key: Hashable, step: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`step()`'s output: replayed from the graph captured for `key` (captured now at its first use)."""
        if self.failed:
            return step()
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(step)
            except Exception as exc:  # noqa: BLE001 - eager is correct, only slower
                log.warning("CUDA graph capture of %s (%s) failed, running it eagerly from now on: %s",
                            self.name, key, exc)
                self.failed = True
                return step()
        graph, out = self.graphs[key]
        graph.replay()
        return out

    def _capture(self, step: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        # a warm-up run first, on a side stream as capture requires (lazy initialisations must not be captured); it
        # writes what the replay will write
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()
        return graph, out
