"""Batched sampling with per-row parameters, on the device.

Every row is processed independently, so a request's tokens do not depend on what else is in the batch: the
random draw for row r at step n is a hash of (seed_r, n), not a shared generator's next value. Order of
operations: repetition penalty, then greedy rows take argmax; others apply temperature, top-k, top-p, min-p
and draw by inverse CDF. Rows with repetition-aware sampling (ras_window > 0) then check their draw against
their last ras_window generated ids and, on a repeat, draw again from the whole temperature-scaled
distribution with a second counter-based number (step + RESAMPLE_STEP), so rows without it draw exactly as
before.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from voxbackend.sampling_params import SamplingParams

_MASK32 = 0xFFFFFFFF
RESAMPLE_STEP = 1 << 31  # the ras redraw's counter: disjoint from every step a request reaches


def uniform_from_seed(seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Counter-based uniform in [0, 1): a 32-bit integer hash of (seed, step); all products stay below 2**63."""
    x = (seed * 0x2545F491 + step * 0x5851F42D + 0x27D4EB2F) & _MASK32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _MASK32
    x = ((x ^ (x >> 15)) * 0x446CA68B) & _MASK32
    x = x ^ (x >> 16)
    return (x >> 8).to(torch.float32) / float(1 << 24)


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [B] float
    top_k: torch.Tensor  # [B] long, 0 = off
    top_p: torch.Tensor  # [B] float
    min_p: torch.Tensor  # [B] float
    penalty: torch.Tensor  # [B] float
    seed: torch.Tensor  # [B] long
    step: torch.Tensor  # [B] long: tokens generated so far
    history: torch.Tensor | None  # [B, L] long, -1 padded: tokens the repetition penalty looks at
    vocab_size: int
    all_greedy: bool = False  # known on the host, so an all-greedy batch needs no device sync to take argmax
    ras_threshold: torch.Tensor | None = None  # [B] float: ras_window * ras_tau_r, inf where ras is off
    recent: torch.Tensor | None = None  # [B, W] long, -1 padded: each row's last ras_window generated ids
    # also known on the host: work that cannot change any row of this batch is skipped
    any_greedy: bool = True
    any_top_k: bool = True
    any_min_p: bool = True

    @classmethod
    def build(
        cls, params: list[SamplingParams], steps: list[int], histories: Sequence[Sequence[int]], vocab_size: int,
        device, recent: list[list[int]] | None = None,
    ) -> "SamplingBatch":
        """`recent`: each row's generated ids so far (or at least its last ras_window), for rows with ras."""
        def t(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        history = None
        if any(p.repetition_penalty != 1.0 for p in params):
            history = padded_history(histories, max(len(h) for h in histories), device)
        ras_threshold = window = None
        if any(p.ras_window > 0 for p in params):
            if recent is None:
                raise ValueError("repetition-aware sampling needs each row's recent ids")
            tails = [r[-p.ras_window:] if p.ras_window else [] for p, r in zip(params, recent)]
            width = max(1, max(len(x) for x in tails))
            window = t([x + [-1] * (width - len(x)) for x in tails], torch.long)
            ras_threshold = t([p.ras_window * p.ras_tau_r if p.ras_window else float("inf") for p in params],
                              torch.float32)
        return cls(
            temperature=t([p.temperature for p in params], torch.float32),
            top_k=t([p.top_k for p in params], torch.long),
            top_p=t([p.top_p for p in params], torch.float32),
            min_p=t([p.min_p for p in params], torch.float32),
            penalty=t([p.repetition_penalty for p in params], torch.float32),
            seed=t([p.seed for p in params], torch.long),
            step=t(steps, torch.long),
            history=history,
            vocab_size=vocab_size,
            all_greedy=all(p.temperature == 0 for p in params),
            ras_threshold=ras_threshold,
            recent=window,
            any_greedy=any(p.temperature == 0 for p in params),
            any_top_k=any(p.top_k > 0 for p in params),
            any_min_p=any(p.min_p > 0 for p in params),
        )


def padded_history(histories: Sequence[Sequence[int]], width: int, device) -> torch.Tensor:
    """Rows of token ids (lists or arrays) -> [B, width] long, -1 padded (numpy fills rows ~5x faster than a
    nested-list tensor)."""
    rows = np.full((len(histories), width), -1, dtype=np.int64)
    for row, h in zip(rows, histories):
        row[: len(h)] = h
    return torch.from_numpy(rows).to(device)


def apply_repetition_penalty(
    logits: torch.Tensor, history: torch.Tensor, penalty: torch.Tensor, token_ids: torch.Tensor | None, vocab: int
) -> torch.Tensor:
    """Seen tokens: positive logits divided by the penalty, negative ones multiplied (the CTRL/HF/vLLM rule).

    Only the columns the history points at are penalized and written back (a few hundred per row, not the
    whole row). History entries that name no candidate (padding, ids outside the row's candidates) point at a
    spare column past the end, so every entry that points at a real column is a hit and writes the same value."""
    columns = logits.shape[1]
    valid = history >= 0
    if token_ids is None:
        pos = history.clamp(min=0)
        hit = valid
    else:  # candidates are ascending per row: find each history token among them
        pos = torch.searchsorted(token_ids, history.clamp(min=0)).clamp(max=columns - 1)
        hit = (token_ids.gather(1, pos) == history) & valid
    pos = torch.where(hit, pos, columns)
    out = torch.cat([logits, logits[:, :1]], dim=1)
    values = out.gather(1, pos)
    p = penalty[:, None]
    out.scatter_(1, pos, torch.where(values > 0, values / p, values * p))
    return out[:, :columns]


def sample(logits: torch.Tensor, batch: SamplingBatch, token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, C] float32 over candidates `token_ids` [B, C], ascending per row (None: C is the whole
    vocab) -> token ids [B]."""
    if batch.history is not None:
        logits = apply_repetition_penalty(logits, batch.history, batch.penalty, token_ids, batch.vocab_size)
    to_ids = (lambda idx: idx) if token_ids is None else (lambda idx: token_ids.gather(1, idx[:, None])[:, 0])
    if batch.all_greedy:
        return to_ids(logits.argmax(dim=-1))
    temp = torch.where(batch.temperature > 0, batch.temperature, torch.ones_like(batch.temperature))
    scaled = logits / temp[:, None]
    draw = _Draw(batch.top_k, batch.top_p, batch.min_p, uniform_from_seed(batch.seed, batch.step),
                 batch.any_top_k, batch.any_min_p)
    column = _draw_by_value(scaled, draw) if _sorts_by_value(scaled) else _draw_by_sort(scaled, draw)
    if batch.recent is not None:
        column = _repetition_aware(scaled, column, to_ids, batch)
    if not batch.any_greedy:
        return to_ids(column)
    return torch.where(batch.temperature == 0, to_ids(logits.argmax(dim=-1)), to_ids(column))


def _repetition_aware(scaled: torch.Tensor, column: torch.Tensor, to_ids, batch: SamplingBatch) -> torch.Tensor:
    """Rows whose draw occurs >= threshold times among their recent ids draw again from the whole distribution
    (inverse CDF over the candidates in their given order, with the row's second number)."""
    repeats = (batch.recent == to_ids(column)[:, None]).sum(dim=-1)
    redraw = repeats.float() >= batch.ras_threshold
    cdf = scaled.softmax(dim=-1).cumsum(dim=-1)
    u = uniform_from_seed(batch.seed, batch.step + RESAMPLE_STEP) * cdf[:, -1]
    full = torch.searchsorted(cdf, u[:, None], right=True).clamp(max=scaled.shape[-1] - 1)[:, 0]
    return torch.where(redraw, full, column)


def mask_ids(logits: torch.Tensor, token_ids: torch.Tensor | None, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Logits [B, C] with `ids` (model-space ids, e.g. the stop ids) made impossible in the rows where `rows`
    [B] bool is set; `token_ids` are the candidates' ids as in `sample` (None: the whole vocab)."""
    if token_ids is None:
        hit = torch.zeros_like(logits, dtype=torch.bool)
        hit[:, ids] = True
    else:
        hit = torch.isin(token_ids, ids)
    return logits.masked_fill(hit & rows[:, None], float("-inf"))


@dataclass
class _Draw:
    """Per-row truncation parameters and the row's uniform number, sliceable to a subset of rows."""

    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    uniform: torch.Tensor
    any_top_k: bool = True  # False: no row truncates by top-k (its mask is all False)
    any_min_p: bool = True  # False: no row truncates by min-p

    def rows(self, index: torch.Tensor) -> "_Draw":
        return _Draw(self.top_k[index], self.top_p[index], self.min_p[index], self.uniform[index], self.any_top_k,
                     self.any_min_p)


def _rank_drawn(sorted_logits: torch.Tensor, d: _Draw) -> torch.Tensor:
    """Logits sorted descending per row [B, C] -> the rank drawn in each row [B, 1]: softmax over the whole
    row, then top-k, top-p and min-p truncation and an inverse-CDF draw."""
    probs = sorted_logits.softmax(dim=-1)
    cum_before = probs.cumsum(dim=-1) - probs
    drop = cum_before >= d.top_p[:, None]  # keeps the smallest prefix whose mass reaches top_p
    if d.any_top_k:
        rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
        drop |= (d.top_k[:, None] > 0) & (rank >= d.top_k[:, None])
    if d.any_min_p:
        drop |= probs < d.min_p[:, None] * probs[:, :1]
    drop[:, 0] = False  # the most likely token always survives
    probs = probs.masked_fill(drop, 0.0)
    cdf = probs.cumsum(dim=-1)
    u = d.uniform * cdf[:, -1]
    return torch.searchsorted(cdf, u[:, None], right=True).clamp(max=probs.shape[-1] - 1)


def _draw_by_sort(scaled: torch.Tensor, d: _Draw) -> torch.Tensor:
    """The drawn column of each row, through a full sort with indices."""
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    return order.gather(1, _rank_drawn(sorted_logits, d))[:, 0]


def _sorts_by_value(scaled: torch.Tensor) -> bool:
    # torch's CPU sort drags indices through a generic comparator: several times slower than sorting values alone
    return scaled.device.type == "cpu" and scaled.dtype in (torch.float32, torch.float64)


def _numpy_sorts_with_simd() -> bool:
    """Whether np.sort runs a SIMD quicksort on float32 rows (several times faster than its scalar one): numpy 2
    has one for AVX2 and AVX-512 CPUs, numpy 1.x (what tritonclient 2.51 allows) for AVX-512 only."""
    if int(np.__version__.split(".")[0]) >= 2:
        return True
    from numpy.core._multiarray_umath import __cpu_features__

    return bool(__cpu_features__.get("AVX512_SKX"))


_NUMPY_SIMD_SORT = _numpy_sorts_with_simd()


def _order_keys(bits: np.ndarray) -> np.ndarray:
    """float32 bit patterns (as int32) <-> int32 keys in the floats' order (its own inverse): negative floats get
    their magnitude bits flipped. -0.0 lands just below +0.0, positive NaNs above +inf, negative NaNs below -inf."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _sorted_descending(scaled: torch.Tensor) -> torch.Tensor:
    """Each row's values, sorted descending. Where numpy has no SIMD sort (numpy 1.x on AVX2-only CPUs), float32
    rows are radix-sorted instead, about 2x faster: numpy's stable argsort of 16-bit keys is a radix sort, so two
    of them (the keys' low halves, then their high halves) order the int32 keys.

    One thread on purpose: torch's OpenMP workers spin-wait between ops, so a second thread sorting half the rows
    shares its core with a spinning worker (measured on 2 cores: 1.2x slower; 0.86x only with spinning turned
    off, OMP_WAIT_POLICY=PASSIVE, which made the whole engine step 7-13% slower)."""
    values = scaled.detach().numpy()
    if _NUMPY_SIMD_SORT or values.dtype != np.float32:
        return torch.from_numpy(np.sort(values, axis=-1)).flip(-1)
    keys = torch.from_numpy(_order_keys(np.ascontiguousarray(values).view(np.int32)))
    keys = keys.gather(1, torch.from_numpy(np.argsort(keys.numpy().astype(np.uint16), axis=-1, kind="stable")))
    high = (keys.numpy() >> 16).astype(np.int16)  # signed: the keys' order is (high as int16, low as uint16)
    keys = keys.gather(1, torch.from_numpy(np.argsort(high, axis=-1, kind="stable")))
    return torch.from_numpy(_order_keys(keys.numpy()).view(np.float32)).flip(-1)


def _draw_by_value(scaled: torch.Tensor, d: _Draw) -> torch.Tensor:
    """Same result as `_draw_by_sort`, sorting only the values (CPU).

    The softmax, cumulative sums and draw see exactly the sorted values `_draw_by_sort` sees (a sorted sequence
    does not depend on the algorithm; -0.0 and +0.0 may trade places, which changes no sum or comparison), so
    the drawn rank and value are the same; the drawn value then names its column. Only where that value occurs
    more than once (a tie, whose order is the sort's own choice) or the row holds a NaN does the row go through
    the full sort.
    """
    values = scaled.detach().numpy()
    sorted_logits = _sorted_descending(scaled)
    value = sorted_logits.gather(1, _rank_drawn(sorted_logits, d)).numpy()
    match = values == value  # numpy: several times faster than the same comparisons in torch on the CPU
    column = torch.from_numpy(match.argmax(axis=-1))
    ends = sorted_logits.numpy()  # NaNs sort to one end or the other: a row holds one iff an end is NaN
    unsure = np.isnan(ends[:, 0]) | np.isnan(ends[:, -1])  # (numpy: torch's fancy index of two columns is ~10x slower)
    # without NaN rows every row holds its drawn value at least once, so one match per row in all means no ties
    # anywhere (one count over the batch: a count per row costs ~10x more)
    if unsure.any() or np.count_nonzero(match) != len(match):
        unsure |= match.sum(axis=-1) != 1
    if unsure.any():
        rows = torch.from_numpy(unsure.nonzero()[0])
        column[rows] = _draw_by_sort(scaled[rows], d.rows(rows))
    return column
