"""The seam between backbones and attention kernels.

A backbone calls `backend.attend(layer, q, k, v)` once per layer. The backend owns the per-step metadata
(built once in `plan`) and knows how to write new keys/values into the paged KV pool and read them back.
The torch backend runs anywhere; a FlashInfer backend (CUDA) implements the same two methods.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class SeqSlice:
    """One sequence's part of a flattened LM batch."""

    q_start: int  # first row of this sequence in the flattened token batch
    q_len: int  # new tokens this step
    context_len: int  # tokens already in the KV cache before this step
    pages: list[int]  # page table


class AttentionBackend(Protocol):
    graphable: bool  # its plan lives in static buffers, so a captured CUDA graph replays with each step's plan

    def plan(self, seqs: list[SeqSlice], slots: torch.Tensor | None = None) -> None:
        """Build the step's metadata (slot mapping, gather indices, masks) once for all layers; `slots`: a static
        buffer of len(seqs) rows to hold the slot mapping (a padded decode step: engine/decode_graphs.py)."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] for the flattened batch -> output [T, H, D]; stores k/v in the pool."""
