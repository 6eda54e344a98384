"""The repetition penalty's history on the device (PenaltyTable); the model runner fills and reads it."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from voxbackend.ints import long_tensor
from voxbackend.models.base import ModelSpec
from voxbackend.request import Request


@dataclass
class PenaltyRows:
    """A step's requests in the penalty table: their slots and the longest history among them."""

    slots: torch.Tensor  # [B] long, on the device
    ends: torch.Tensor  # [B] long: each one's entries so far, where this step's goes
    width: int


class PenaltyTable:
    """What the repetition penalty looks at, kept on the device: a request that samples with a penalty owns a
    slot, a row of a [slots, token_columns, width] table of ids (-1 past its end; the penalty skips negative
    ids), holding its prompt (if the spec penalizes prompts) and then every generated step, appended in place
    right after it is sampled. A step's history is one gather, where host arrays of every request were padded
    and copied over at every step before (32 requests: 0.6 ms of a CPU step)."""

    def __init__(self, spec: ModelSpec, device):
        self.spec = spec
        self.table = torch.full((0, spec.token_columns, 0), -1, dtype=torch.long, device=device)
        self.free: list[int] = []

    def rows(self, requests: list[Request]) -> PenaltyRows:
        """Slots for these requests, each holding all its entries so far (a new slot, or a request that sampled
        without a penalty for a while, is written from the host), with room for this step's."""
        lengths = [self._prefix(r) + len(r.lm.output_ids) for r in requests]
        width = max(lengths)
        self._grow(sum(1 for r in requests if r.penalty.slot is None), width + 1)
        for r, n in zip(requests, lengths):
            if r.penalty.slot is None:
                r.penalty.slot, r.penalty.length = self.free.pop(), 0
                self.table[r.penalty.slot].fill_(-1)  # what a request before it left there
            if r.penalty.length < n:
                self._write(r, n)
        slots, ends = long_tensor([[r.penalty.slot for r in requests], lengths], self.table.device)
        return PenaltyRows(slots, ends, max(1, width))

    def history(self, kept: PenaltyRows | None, column: int) -> torch.Tensor | None:
        """[B, width] ids of `column` for these rows; None where the penalty does not look at that column."""
        columns = self.spec.penalty_columns
        if kept is None or columns is not None and column not in columns:
            return None
        return self.table[:, column, : kept.width].index_select(0, kept.slots)

    def append(self, requests: list[Request], kept: PenaltyRows, steps: torch.Tensor) -> None:
        """This step's sampled ids [B] (or rows [B, token_columns]), still on the device."""
        self.table[kept.slots, :, kept.ends] = steps.view(len(requests), -1)
        for r in requests:
            r.penalty.length += 1

    def release(self, r: Request) -> None:
        if r.penalty.slot is not None:
            self.free.append(r.penalty.slot)
            r.penalty.slot = None

    def _prefix(self, r: Request) -> int:
        return len(r.prompt_ids) if self.spec.penalty_on_prompt else 0

    def _write(self, r: Request, n: int) -> None:
        start, prompt = r.penalty.length, (r.prompt_ids if self.spec.penalty_on_prompt else [])
        entries = prompt[start:] + r.lm.output_ids[max(0, start - len(prompt)) : n - len(prompt)]
        self.table[r.penalty.slot, :, start:n] = long_tensor(entries, self.table.device).view(len(entries), -1).T
        r.penalty.length = n

    def _grow(self, new_slots: int, width: int) -> None:
        slots, columns, have = self.table.shape
        more = max(0, new_slots - len(self.free))
        if not more and width <= have:
            return
        grown = torch.full((slots + max(more, slots, 8) if more else slots, columns, max(width, 2 * have)), -1,
                           dtype=torch.long, device=self.table.device)
        grown[:slots, :, :have] = self.table
        self.free.extend(range(slots, len(grown)))
        self.table = grown
