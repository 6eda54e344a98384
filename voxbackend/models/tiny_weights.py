"""Random weights for tiny checkpoints that a parity test can tell apart from a wrong load."""
from __future__ import annotations

import torch


def perturb_default_inits(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Default inits leave norm scales at 1, biases and attention position biases at 0 and BatchNorm statistics
    at 0/1, where a swapped or skipped weight goes unseen: draw them away from those values (in state-dict
    order, so a seed always gives the same checkpoint)."""
    for name, t in module.state_dict().items():
        if name.endswith("running_var"):
            t.copy_(0.5 + torch.rand(t.shape, generator=generator))
        elif name.endswith("running_mean"):
            t.copy_(0.1 * torch.randn(t.shape, generator=generator))
        elif t.ndim == 1 and (name.endswith("weight") or name.endswith("alpha")):
            t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=generator))
        elif t.ndim == 1 and name.endswith("bias"):
            t.copy_(0.1 * torch.randn(t.shape, generator=generator))
        elif "pos_bias" in name:
            t.copy_(0.1 * torch.randn(t.shape, generator=generator))
