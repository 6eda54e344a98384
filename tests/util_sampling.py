"""Reference helpers for the sampling tests: one row's inverse-CDF draw in plain Python, and a row's number."""
import torch

from voxbackend.sampling import uniform_from_seed


def inverse_cdf(weights: list[float], u: float) -> int:
    """The first index whose cumulative weight exceeds u * total (never a zero weight)."""
    total, acc = sum(weights), 0.0
    for i, w in enumerate(weights):
        acc += w
        if acc > u * total:
            return i
    return max(i for i, w in enumerate(weights) if w > 0)


def uniform(seed: int, step: int) -> float:
    return float(uniform_from_seed(torch.tensor([seed]), torch.tensor([step]))[0])
