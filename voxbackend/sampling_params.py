"""Per-request sampling parameters and their validation (runs before any device work)."""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from voxbackend.errors import InvalidRequest

MAX_SEED = 2**31 - 1


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # in (0, 1]
    min_p: float = 0.0  # in [0, 1]
    repetition_penalty: float = 1.0  # > 0; 1 disables
    max_tokens: int = 1200  # LM steps
    seed: int | None = None  # None: drawn at submission

    def validated(self) -> "SamplingParams":
        """Return a copy with checked types and ranges and a concrete seed; raise InvalidRequest otherwise."""
        p = dataclasses.replace(self)
        p.temperature = _number("temperature", p.temperature, float)
        p.top_p = _number("top_p", p.top_p, float)
        p.min_p = _number("min_p", p.min_p, float)
        p.repetition_penalty = _number("repetition_penalty", p.repetition_penalty, float)
        p.top_k = _number("top_k", p.top_k, int)
        p.max_tokens = _number("max_tokens", p.max_tokens, int)
        if p.temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0 (0 = greedy), got {p.temperature}")
        if not 0 < p.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {p.top_p}")
        if not 0 <= p.min_p <= 1:
            raise InvalidRequest(f"min_p must be in [0, 1], got {p.min_p}")
        if p.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (0 = disabled), got {p.top_k}")
        if not 0 < p.repetition_penalty <= 100:
            raise InvalidRequest(f"repetition_penalty must be in (0, 100], got {p.repetition_penalty}")
        if p.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be >= 1, got {p.max_tokens}")
        if p.seed is None:
            p.seed = random.randint(0, MAX_SEED)
        else:
            p.seed = _number("seed", p.seed, int)
            if not 0 <= p.seed <= MAX_SEED:
                raise InvalidRequest(f"seed must be in [0, {MAX_SEED}], got {p.seed}")
        return p


def _number(name: str, value, kind: type):
    # bool is an int subclass; a flag passed as a number is a client bug
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "item"):
        raise InvalidRequest(f"{name} must be a number, got {type(value).__name__}")
    if hasattr(value, "item"):
        value = value.item()
    if kind is int:
        if isinstance(value, float) and not value.is_integer():
            raise InvalidRequest(f"{name} must be an integer, got {value}")
        return int(value)
    value = float(value)
    if value != value:
        raise InvalidRequest(f"{name} must not be NaN")
    return value
