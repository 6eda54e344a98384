"""One LM step of a planned batch: flatten the chunks, plan the attention, run the backbone and sample every
column of the rows that end their sequence, all on the device (nano-vllm's model runner). It knows the model
contract and sampling; admission, KV growth, preemption and streaming are the engine's."""
from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from voxbackend.attention.base import SeqSlice
from voxbackend.attention.torch_backend import TorchPagedAttention
from voxbackend.config import EngineConfig
from voxbackend.cuda_graphs import buckets
from voxbackend.engine.decode_graphs import DecodeGraphs
from voxbackend.engine.kv_pool import KVPool
from voxbackend.engine.penalties import PenaltyRows, PenaltyTable
from voxbackend.ints import long_tensor
from voxbackend.models.base import PromptFeatures, SpeechModel
from voxbackend.request import Request
from voxbackend.sampling import SamplingBatch, mask_ids, sample

log = logging.getLogger("voxbackend.engine")


class ModelRunner:
    def __init__(self, model: SpeechModel, config: EngineConfig, pool: KVPool):
        self.model = model
        self.device = config.device
        self.attention = make_attention(config, model, pool)
        self.penalties = PenaltyTable(model.spec, config.device)
        self.graphs = make_decode_graphs(config, model, self.attention, pool)

    def run(self, plan: list[tuple[Request, int]]) -> list[tuple[Request, int | list[int]]]:
        """Run each planned request's next `n` positions (prompt chunks, a resumed prefix, or its last step's
        input) in one flattened forward; returns the requests whose chunk ended their sequence so far, each
        with its sampled step (an id, or a row of every column), on the host. A guided request's unconditioned
        row runs the same positions as a sequence of its own."""
        return self.launch(plan).collect()

    @torch.inference_mode()
    def launch(self, plan: list[tuple[Request, int]]) -> "LaunchedStep":
        """`run` up to its host transfer: on a GPU the step's kernels are queued and the host goes on (the
        engine decodes codec windows meanwhile); `collect()` waits for the sampled ids."""
        batch = FlatBatch()
        sample_rows: list[int] = []
        sampled: list[Request] = []
        guide_rows: list[int] = []  # the unconditioned rows' last positions, in `sampled` order of guided requests
        for r, n in plan:
            start = r.lm.num_cached
            last = batch.add(r.position, r.positions, start, n, r.lm.pages, r.feature_positions, r.features)
            if r.guide is not None:
                g = r.guide
                guide_last = batch.add(lambda i: g.position(r, i), lambda a, b: g.positions(r, a, b), start, n,
                                       g.pages, r.feature_positions, g.features)
            r.lm.num_cached += n
            # this chunk ends the sequence so far (or it is a decode) and the last step's input is in it: a
            # token comes out (a resumed request that waits for text has sampled from that position already)
            if not r.uncached and not r.lm.awaiting_input:
                sample_rows.append(last)
                sampled.append(r)
                if r.guide is not None:
                    guide_rows.append(guide_last)
        dev = self.device
        if self.graphs is not None and self.graphs.accepts(batch.seqs, bool(batch.feature_rows)):
            hidden = self.graphs.forward(batch.ids, batch.positions, batch.seqs)
        else:
            self.attention.plan(batch.seqs)
            extra = {}
            if batch.feature_rows:  # only batches with FEATURE rows: models without features keep their signature
                extra["features"] = PromptFeatures(torch.tensor(batch.feature_rows, device=dev),
                                                   torch.cat(batch.feature_vectors))
            hidden = self.model.forward(
                long_tensor(batch.ids, dev), long_tensor(batch.positions, dev), self.attention, **extra
            )
        if not sampled:
            return LaunchedStep([], None)
        # a pure decode step samples every row: no gather
        rows = hidden if len(sample_rows) == len(hidden) else hidden[long_tensor(sample_rows, dev)]
        codes = [len(r.codec.codes) for r in sampled]
        if guide_rows:
            logits, token_ids = self._guided_logits(rows, hidden[long_tensor(guide_rows, dev)], sampled, codes)
        else:
            logits, token_ids = self.model.candidate_logits(rows, codes)
        early = [len(r.lm.output_ids) < r.sampling.min_tokens for r in sampled]
        if any(early) and self.model.spec.stop_ids:  # no stop before min_tokens
            logits = mask_ids(logits, token_ids, torch.tensor(self.model.spec.stop_ids, device=dev),
                              torch.tensor(early, device=dev))
        logits = self.model.constrain_logits(logits, token_ids, [r.lm.track for r in sampled])
        kept = self.penalties.rows(sampled) if any(r.sampling.repetition_penalty != 1.0 for r in sampled) else None
        batch = self._sampling_batch(sampled, kept)
        steps = sample(logits, batch, token_ids)
        if self.model.spec.has_depth:  # the rest of each step's columns, all rows at once, on the device
            steps = self.model.depth_step(
                rows, steps, lambda lg, column: sample(lg, self._column_batch(batch, kept, column))
            )
        if kept is not None:
            self.penalties.append(sampled, kept, steps)
        return LaunchedStep(sampled, steps)

    def _guided_logits(self, rows: torch.Tensor, uncond_rows: torch.Tensor, sampled: list[Request],
                       codes: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Classifier-free guidance: one head call over the conditioned and unconditioned rows, then each guided
        request's logits become cond + cfg_weight * (cond - uncond)."""
        guided = [i for i, r in enumerate(sampled) if r.guide is not None]
        both, token_ids = self.model.candidate_logits(torch.cat([rows, uncond_rows]),
                                                      codes + [codes[i] for i in guided])
        logits, uncond = both[: len(rows)], both[len(rows):]
        at = long_tensor(guided, self.device)
        weight = torch.tensor([sampled[i].sampling.cfg_weight for i in guided], device=self.device)[:, None]
        cond = logits[at]
        logits = logits.index_copy(0, at, cond + weight * (cond - uncond))
        return logits, None if token_ids is None else token_ids[: len(rows)]

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
            [len(r.lm.output_ids) * columns for r in sampled],
            self.penalties.history(kept, 0),
            self._column_vocab(0),
            self.device,
            recent=[self._recent(r) for r in sampled] if ras else None,
        )

    def _recent(self, r: Request) -> list[int]:
        """What repetition-aware sampling looks at: the last generated ids (column 0)."""
        tail = r.lm.output_ids[-r.sampling.ras_window:] if r.sampling.ras_window else []
        return tail if self.model.spec.token_columns == 1 else [row[0] for row in tail]

    def _column_batch(self, batch: SamplingBatch, kept: PenaltyRows | None, column: int) -> SamplingBatch:
        history = self.penalties.history(kept, column)
        return batch.shifted(column, history=history, vocab_size=self._column_vocab(column))

    def _column_vocab(self, column: int) -> int:
        spec = self.model.spec
        return spec.column_vocab[column] if spec.column_vocab else spec.geometry.vocab_size


@dataclass
class LaunchedStep:
    """An LM step whose sampled ids may still be on their way (queued device work)."""

    sampled: list[Request]
    steps: torch.Tensor | None  # [rows] ids, or [rows, columns]

    def collect(self) -> list[tuple[Request, int | list[int]]]:
        if self.steps is None:
            return []
        return list(zip(self.sampled, self.steps.tolist()))  # the one host transfer of the step


@dataclass
class FlatBatch:
    """One LM step's positions, flattened: every planned sequence's chunk one after the other."""

    ids: list = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    seqs: list[SeqSlice] = field(default_factory=list)
    feature_rows: list[int] = field(default_factory=list)
    feature_vectors: list[torch.Tensor] = field(default_factory=list)

    def add(self, position: Callable[[int], Any], positions: Callable[[int, int], list], start: int, n: int,
            pages: list[int], feature_at: list[int], features: torch.Tensor | None) -> int:
        """A sequence's positions [start, start + n) (their inputs from `position(i)` / `positions(a, b)`);
        returns the flat index of its last one."""
        if n == 1:  # a decode (most rows of most steps): the last step's input
            self.ids.append(position(start))
            self.positions.append(start)
        else:  # a prompt chunk or a resumed prefix
            self.ids.extend(positions(start, start + n))
            self.positions.extend(range(start, start + n))
        first = len(self.ids) - n
        self.seqs.append(SeqSlice(first, n, start, pages))
        if feature_at:  # the FEATURE rows in this chunk (a recomputed prefix has them all again)
            lo, hi = bisect.bisect_left(feature_at, start), bisect.bisect_left(feature_at, start + n)
            if hi > lo:
                self.feature_rows.extend(first + p - start for p in feature_at[lo:hi])
                self.feature_vectors.append(features[lo:hi])
        return len(self.ids) - 1


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


def make_decode_graphs(config: EngineConfig, model: SpeechModel, attention, pool: KVPool) -> DecodeGraphs | None:
    """Padded decode steps (config.cuda_graphs), captured where the device and attention backend allow."""
    mode = config.cuda_graphs
    can_capture = config.device.startswith("cuda") and attention.graphable
    if mode == "graphs" and not can_capture:
        raise ValueError("cuda_graphs='graphs' needs a CUDA device and FlashInfer attention; 'padded' runs the same "
                         "path without capture")
    if mode == "off" or (mode == "auto" and not can_capture):
        return None
    capture = mode != "padded"
    max_rows = config.max_batch * (2 if model.spec.guidance else 1)  # a guided request's unconditioned row too
    # the depth pass is as long as the step's sampled rows (at most max_batch), the codec's batch detok_batch windows
    model.use_graphs(buckets(config.max_batch), buckets(config.detok_batch), capture)
    return DecodeGraphs(model, attention, pool.scratch_page, max_rows, config.device, capture)
