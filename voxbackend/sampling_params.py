"""Per-request sampling parameters and their validation (runs before any device work)."""
from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

from voxbackend.errors import InvalidRequest

MAX_SEED = 2**31 - 1
MAX_CFG_WEIGHT = 10.0  # far past any useful guidance; larger weights only amplify the unconditioned row's noise


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # in (0, 1]
    min_p: float = 0.0  # in [0, 1]
    repetition_penalty: float = 1.0  # > 0; 1 disables
    max_tokens: int = 1200  # LM steps
    seed: int | None = None  # None: drawn at submission
    min_tokens: int = 0  # LM steps before a stop id may be sampled (its logits are masked until then)
    # repetition-aware sampling (CosyVoice2's ras): when the top-k/top-p draw already occurs
    # >= ras_window * ras_tau_r times among the last ras_window generated ids, draw again from the whole
    # (temperature-scaled, untruncated) distribution. 0 disables.
    ras_window: int = 0
    ras_tau_r: float = 0.1
    # classifier-free guidance (models whose spec has guidance, e.g. Chatterbox): each step runs a second,
    # unconditioned row and samples from cond + cfg_weight * (cond - uncond). 0: one row, no guidance.
    cfg_weight: float = 0.0

    def validated(self) -> "SamplingParams":
        """Return a copy with checked types and ranges and a concrete seed; raise InvalidRequest otherwise."""
        p = dataclasses.replace(self)
        p.temperature = _number("temperature", p.temperature, float)
        p.top_p = _number("top_p", p.top_p, float)
        p.min_p = _number("min_p", p.min_p, float)
        p.repetition_penalty = _number("repetition_penalty", p.repetition_penalty, float)
        p.top_k = _number("top_k", p.top_k, int)
        p.max_tokens = _number("max_tokens", p.max_tokens, int)
        p.min_tokens = _number("min_tokens", p.min_tokens, int)
        p.ras_window = _number("ras_window", p.ras_window, int)
        p.ras_tau_r = _number("ras_tau_r", p.ras_tau_r, float)
        p.cfg_weight = _number("cfg_weight", p.cfg_weight, float)
        _check("temperature", p.temperature >= 0, f"must be >= 0 (0 = greedy), got {p.temperature}")
        _check("top_p", 0 < p.top_p <= 1, f"must be in (0, 1], got {p.top_p}")
        _check("min_p", 0 <= p.min_p <= 1, f"must be in [0, 1], got {p.min_p}")
        _check("top_k", p.top_k >= 0, f"must be >= 0 (0 = disabled), got {p.top_k}")
        _check("repetition_penalty", 0 < p.repetition_penalty <= 100,
               f"must be in (0, 100], got {p.repetition_penalty}")
        _check("max_tokens", p.max_tokens >= 1, f"must be >= 1, got {p.max_tokens}")
        _check("min_tokens", p.min_tokens >= 0, f"must be >= 0, got {p.min_tokens}")
        _check("ras_window", 0 <= p.ras_window <= 1000, f"must be in [0, 1000] (0 = off), got {p.ras_window}")
        _check("ras_tau_r", 0 <= p.ras_tau_r <= 1, f"must be in [0, 1], got {p.ras_tau_r}")
        _check("cfg_weight", 0 <= p.cfg_weight <= MAX_CFG_WEIGHT,
               f"must be in [0, {MAX_CFG_WEIGHT:g}] (0 = no guidance), got {p.cfg_weight}")
        if p.seed is None:
            p.seed = random.randint(0, MAX_SEED)
        else:
            p.seed = _number("seed", p.seed, int)
            _check("seed", 0 <= p.seed <= MAX_SEED, f"must be in [0, {MAX_SEED}], got {p.seed}")
        return p


def _check(name: str, ok: bool, problem: str) -> None:
    if not ok:
        raise InvalidRequest(f"{name} {problem}", field=name)


def _number(name: str, value, kind: type):
    # bool is an int subclass; a flag passed as a number is a client bug
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "item"):
        raise InvalidRequest(f"{name} must be a number, got {type(value).__name__}", field=name)
    if hasattr(value, "item"):
        value = value.item()
    if kind is int:
        if isinstance(value, float) and not value.is_integer():
            raise InvalidRequest(f"{name} must be an integer, got {value}", field=name)
        return int(value)
    value = float(value)
    if math.isnan(value):
        raise InvalidRequest(f"{name} must not be NaN", field=name)
    if math.isinf(value):  # inf passes range checks such as temperature >= 0
        raise InvalidRequest(f"{name} must be finite, got {value}", field=name)
    return value
