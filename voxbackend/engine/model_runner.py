"""One LM step of a planned batch: flatten the chunks, plan the attention, run the backbone and sample every
column of the rows that end their sequence, all on the device (nano-vllm's model runner). It knows the model
contract and sampling; admission, KV growth, preemption and streaming are the engine's."""
from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

import torch

from voxbackend.attention.base import SeqSlice
from voxbackend.attention.torch_backend import TorchPagedAttention
from voxbackend.config import EngineConfig
from voxbackend.engine.kv_pool import KVPool
from voxbackend.ints import long_tensor
from voxbackend.models.base import ModelSpec, PromptFeatures, SpeechModel
from voxbackend.request import Request
from voxbackend.sampling import SamplingBatch, mask_ids, sample

log = logging.getLogger("voxbackend.engine")


class ModelRunner:
    def __init__(self, model: SpeechModel, config: EngineConfig, pool: KVPool):
        self.model = model
        self.device = config.device
        self.attention = make_attention(config, model, pool)
        self.penalties = PenaltyTable(model.spec, config.device)

    @torch.inference_mode()
    def run(self, plan: list[tuple[Request, int]]) -> list[tuple[Request, int | list[int]]]:
        """Run each planned request's next `n` positions (prompt chunks, a resumed prefix, or its last step's
        input) in one flattened forward; returns the requests whose chunk ended their sequence so far, each
        with its sampled step (an id, or a row of every column), on the host."""
        ids: list[int] = []
        positions: list[int] = []
        seqs: list[SeqSlice] = []
        sample_rows: list[int] = []
        sampled: list[Request] = []
        feature_rows: list[int] = []
        feature_vectors: list[torch.Tensor] = []
        for r, n in plan:
            start = r.num_cached
            if n == 1:  # a decode (most rows of most steps): the last step's input
                ids.append(r.position(start))
                positions.append(start)
            else:  # a prompt chunk or a resumed prefix
                ids.extend(r.positions(start, start + n))
                positions.extend(range(start, start + n))
            seqs.append(SeqSlice(len(ids) - n, n, start, r.pages))
            if r.feature_positions:  # the FEATURE rows in this chunk (a recomputed prefix has them all again)
                at = r.feature_positions
                lo, hi = bisect.bisect_left(at, start), bisect.bisect_left(at, start + n)
                if hi > lo:
                    feature_rows.extend(len(ids) - n + p - start for p in at[lo:hi])
                    feature_vectors.append(r.features[lo:hi])
            r.num_cached += n
            # this chunk ends the sequence so far (or it is a decode) and the last step's input is in it: a
            # token comes out (a resumed request that waits for text has sampled from that position already)
            if not r.uncached and not r.awaiting_input:
                sample_rows.append(len(ids) - 1)
                sampled.append(r)
        self.attention.plan(seqs)
        dev = self.device
        extra = {}
        if feature_rows:  # only batches with FEATURE rows: models without prompt features keep their signature
            extra["features"] = PromptFeatures(torch.tensor(feature_rows, device=dev), torch.cat(feature_vectors))
        hidden = self.model.forward(
            long_tensor(ids, dev), long_tensor(positions, dev), self.attention, **extra
        )
        if not sampled:
            return []
        # a pure decode step samples every row: no gather
        rows = hidden if len(sample_rows) == len(hidden) else hidden[long_tensor(sample_rows, dev)]
        logits, token_ids = self.model.candidate_logits(rows, [len(r.codes) for r in sampled])
        early = [len(r.output_ids) < r.sampling.min_tokens for r in sampled]
        if any(early) and self.model.spec.stop_ids:  # no stop before min_tokens
            logits = mask_ids(logits, token_ids, torch.tensor(self.model.spec.stop_ids, device=dev),
                              torch.tensor(early, device=dev))
        logits = self.model.constrain_logits(logits, token_ids, [r.track for r in sampled])
        kept = self.penalties.rows(sampled) if any(r.sampling.repetition_penalty != 1.0 for r in sampled) else None
        batch = self._sampling_batch(sampled, kept)
        steps = sample(logits, batch, token_ids)
        if self.model.spec.has_depth:  # the rest of each step's columns, all rows at once, on the device
            steps = self.model.depth_step(
                rows, steps, lambda lg, column: sample(lg, self._column_batch(batch, kept, column))
            )
        if kept is not None:
            self.penalties.append(sampled, kept, steps)
        return list(zip(sampled, steps.tolist()))  # the one host transfer of the step

    def release(self, r: Request) -> None:
        """The request samples no more (finished or ended): its penalty slot is free."""
        self.penalties.release(r)

    def _sampling_batch(self, sampled: list[Request], kept: PenaltyRows | None) -> SamplingBatch:
        """Column 0 of this step. Step counters advance by token_columns per LM step, so every (step, column) of
        a request draws its own number from its seed, whatever else is in the batch."""
        columns = self.model.spec.token_columns
        ras = any(r.sampling.ras_window > 0 for r in sampled)
        return SamplingBatch.build(
            [r.sampling for r in sampled],
            [len(r.output_ids) * columns for r in sampled],
            self.penalties.history(kept, 0),
            self._column_vocab(0),
            self.device,
            recent=[self._recent(r) for r in sampled] if ras else None,
        )

    def _recent(self, r: Request) -> list[int]:
        """What repetition-aware sampling looks at: the last generated ids (column 0)."""
        tail = r.output_ids[-r.sampling.ras_window:] if r.sampling.ras_window else []
        return tail if self.model.spec.token_columns == 1 else [row[0] for row in tail]

    def _column_batch(self, batch: SamplingBatch, kept: PenaltyRows | None, column: int) -> SamplingBatch:
        history = self.penalties.history(kept, column)
        return batch.shifted(column, history=history, vocab_size=self._column_vocab(column))

    def _column_vocab(self, column: int) -> int:
        spec = self.model.spec
        return spec.column_vocab[column] if spec.column_vocab else spec.geometry.vocab_size


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
        lengths = [self._prefix(r) + len(r.output_ids) for r in requests]
        width = max(lengths)
        self._grow(sum(1 for r in requests if r.penalty_slot is None), width + 1)
        for r, n in zip(requests, lengths):
            if r.penalty_slot is None:
                r.penalty_slot, r.penalty_len = self.free.pop(), 0
                self.table[r.penalty_slot].fill_(-1)  # what a request before it left there
            if r.penalty_len < n:
                self._write(r, n)
        slots, ends = long_tensor([[r.penalty_slot for r in requests], lengths], self.table.device)
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
            r.penalty_len += 1

    def release(self, r: Request) -> None:
        if r.penalty_slot is not None:
            self.free.append(r.penalty_slot)
            r.penalty_slot = None

    def _prefix(self, r: Request) -> int:
        return len(r.prompt_ids) if self.spec.penalty_on_prompt else 0

    def _write(self, r: Request, n: int) -> None:
        start, prompt = r.penalty_len, (r.prompt_ids if self.spec.penalty_on_prompt else [])
        entries = prompt[start:] + r.output_ids[max(0, start - len(prompt)) : n - len(prompt)]
        self.table[r.penalty_slot, :, start:n] = long_tensor(entries, self.table.device).view(len(entries), -1).T
        r.penalty_len = n

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


def make_attention(config: EngineConfig, model: SpeechModel, pool: KVPool):
    """torch on CPU or when asked; FlashInfer on CUDA when it imports ("auto") or when asked."""
    g = model.spec.geometry
    scale = g.head_dim**-0.5
    on_cuda = config.device.startswith("cuda")
    if config.attention == "flashinfer" and not on_cuda:
        raise ValueError("attention='flashinfer' needs a CUDA device")
    if on_cuda and config.attention in ("auto", "flashinfer"):
        try:
            from voxbackend.attention.flashinfer_backend import FlashInferPagedAttention

            return FlashInferPagedAttention(pool.cache, pool.page_size, pool.scratch_page, scale, g)
        except ImportError:
            if config.attention == "flashinfer":
                raise
            log.warning("flashinfer is not installed; using the torch attention backend")
    return TorchPagedAttention(pool.cache, pool.page_size, pool.scratch_page, scale)
