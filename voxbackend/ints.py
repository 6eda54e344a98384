"""Between host and device: host lists of integers to device tensors, built through numpy (a 32-id list converts
~3x faster than with torch.tensor, which parses the list element by element; a few are made every LM step), and
device results to the host in one copy."""
from __future__ import annotations

import numpy as np
import torch


def long_tensor(values, device) -> torch.Tensor:
    """A list (or nested rows) of ints -> an int64 tensor on `device`."""
    return torch.from_numpy(np.asarray(values, dtype=np.int64)).to(device)


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors, as float32, on the CPU in one device-to-host copy: each copy waits for the device's queued
    work, so a codec step that returns one chunk per stream waits once, not once per stream."""
    if not tensors:
        return []
    flat = torch.cat([t.reshape(-1).float() for t in tensors]).cpu()
    return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]
