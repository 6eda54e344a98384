"""One LM step of a planned batch: flatten the chunks, plan the attention, run the backbone and sample every
column of the rows that end their sequence, all on the device (nano-vllm's model runner). It knows the model
contract and sampling; admission, KV growth, preemption and streaming are the engine's."""
from __future__ import annotations

import bisect
import dataclasses
import logging

import numpy as np
import torch

from voxbackend.attention.base import SeqSlice
from voxbackend.attention.torch_backend import TorchPagedAttention
from voxbackend.config import EngineConfig
from voxbackend.engine.kv_pool import KVPool
from voxbackend.models.base import PromptFeatures, SpeechModel
from voxbackend.request import Request
from voxbackend.sampling import SamplingBatch, mask_ids, padded_history, sample

log = logging.getLogger("voxbackend.engine")


class ModelRunner:
    def __init__(self, model: SpeechModel, config: EngineConfig, pool: KVPool):
        self.model = model
        self.device = config.device
        self.attention = make_attention(config, model, pool)

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
            ids.extend(r.positions(start, start + n))  # prompt or resumed prefix chunk, or the last step
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
            torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), self.attention, **extra
        )
        if not sampled:
            return []
        # a pure decode step samples every row: no gather
        rows = hidden if len(sample_rows) == len(hidden) else hidden[torch.tensor(sample_rows, device=dev)]
        logits, token_ids = self.model.candidate_logits(rows, [len(r.codes) for r in sampled])
        early = [len(r.output_ids) < r.sampling.min_tokens for r in sampled]
        if any(early) and self.model.spec.stop_ids:  # no stop before min_tokens
            logits = mask_ids(logits, token_ids, torch.tensor(self.model.spec.stop_ids, device=dev),
                              torch.tensor(early, device=dev))
        logits = self.model.constrain_logits(logits, token_ids, [r.track for r in sampled])
        batch = self._sampling_batch(sampled)
        steps = sample(logits, batch, token_ids)
        if self.model.spec.has_depth:  # the rest of each step's columns, all rows at once, on the device
            steps = self.model.depth_step(
                rows, steps, lambda lg, column: sample(lg, self._column_batch(sampled, batch, column))
            )
        return list(zip(sampled, steps.tolist()))  # the one host transfer of the step

    def _sampling_batch(self, sampled: list[Request]) -> SamplingBatch:
        """Column 0 of this step. Step counters advance by token_columns per LM step, so every (step, column) of
        a request draws its own number from its seed, whatever else is in the batch."""
        columns = self.model.spec.token_columns
        penalized = any(r.sampling.repetition_penalty != 1.0 for r in sampled)
        ras = any(r.sampling.ras_window > 0 for r in sampled)
        return SamplingBatch.build(
            [r.sampling for r in sampled],
            [len(r.output_ids) * columns for r in sampled],
            [self._history(r, 0) for r in sampled] if penalized else [_NO_IDS for _ in sampled],
            self._column_vocab(0),
            self.device,
            recent=[self._recent(r) for r in sampled] if ras else None,
        )

    def _recent(self, r: Request) -> list[int]:
        """What repetition-aware sampling looks at: the last generated ids (column 0)."""
        tail = r.output_ids[-r.sampling.ras_window:] if r.sampling.ras_window else []
        return tail if self.model.spec.token_columns == 1 else [row[0] for row in tail]

    def _column_batch(self, sampled: list[Request], batch: SamplingBatch, column: int) -> SamplingBatch:
        history = batch.history
        if history is not None:
            hist = [self._history(r, column) for r in sampled]
            history = padded_history(hist, max(1, max(len(h) for h in hist)), self.device)
        return dataclasses.replace(batch, step=batch.step + column, history=history,
                                   vocab_size=self._column_vocab(column))

    def _history(self, r: Request, column: int) -> np.ndarray:
        """What the repetition penalty looks at: the prompt (unless the spec says generated only) and generated
        ids of that column; nothing for a column the spec leaves unpenalized."""
        spec = self.model.spec
        if spec.penalty_columns is not None and column not in spec.penalty_columns:
            return _NO_IDS
        if r.penalty_history is None:
            r.penalty_history = PenaltyHistory(r.prompt_ids if spec.penalty_on_prompt else [], spec.token_columns)
        return r.penalty_history.ids(column, r.output_ids)

    def _column_vocab(self, column: int) -> int:
        spec = self.model.spec
        return spec.column_vocab[column] if spec.column_vocab else spec.geometry.vocab_size


_NO_IDS = np.empty(0, dtype=np.int64)


class PenaltyHistory:
    """A request's penalized ids per column (prompt, then generated steps), grown by the steps generated since
    the last call instead of rebuilt from Python lists every step (the sampling batch of 32 requests with
    300-600 ids each took 0.8 ms to build that way, 0.2 ms now). A one-column model keeps every entry (the
    penalty skips those below 0); other models leave out absent (-1) entries."""

    def __init__(self, prompt: list, columns: int):
        self.columns = columns
        self.steps = 0  # generated steps already appended
        self.data = [np.empty(max(64, 2 * len(prompt)), dtype=np.int64) for _ in range(columns)]
        self.size = [0] * columns
        if prompt:
            self._append(np.asarray(prompt, dtype=np.int64))

    def ids(self, column: int, output_ids: list) -> np.ndarray:
        if len(output_ids) > self.steps:
            new = output_ids[self.steps:]  # one column: the list goes in as it is (a decode step adds one id)
            self._append(new if self.columns == 1 else np.asarray(new, dtype=np.int64))
            self.steps = len(output_ids)
        return self.data[column][: self.size[column]]

    def _append(self, rows) -> None:
        if self.columns > 1:
            rows = rows.reshape(len(rows), self.columns)
        for c in range(self.columns):
            new = rows if self.columns == 1 else rows[:, c][rows[:, c] >= 0]
            end = self.size[c] + len(new)
            if end > len(self.data[c]):
                grown = np.empty(2 * end, dtype=np.int64)
                grown[: self.size[c]] = self.data[c][: self.size[c]]
                self.data[c] = grown
            self.data[c][self.size[c] : end] = new
            self.size[c] = end


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
