"""Counting the places where a step waits for the device: the calls that copy a device tensor to the host or
whose result's shape depends on its values. On a GPU each one stalls the host until the queued kernels finish, so
a decode step should have one (its sampled ids). Counted on any device, CPU tensors included, so CI holds the
number without a GPU.

    with HostSyncs() as syncs:
        engine.step()
    syncs.count, syncs.sites   # how many, and where (file:line of the caller in voxbackend)

Not seen: `.to("cpu")` / `copy_` into a host tensor (on CPU they cannot be told from a move to the configured
device), and syncs inside compiled or C++ code."""
from __future__ import annotations

import collections
import traceback

import torch
from torch.overrides import TorchFunctionMode

_COPIES = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.__bool__,
           torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}
_VALUE_SHAPED = {torch.Tensor.nonzero, torch.nonzero, torch.Tensor.unique, torch.unique, torch.Tensor.masked_select,
                 torch.masked_select, torch.Tensor.argwhere, torch.argwhere}
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put, torch.Tensor.index_put_}


def _bool_index(args) -> bool:
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/voxbackend/" in frame.filename and not frame.filename.endswith("host_syncs.py"):
            return f"{frame.filename.rsplit('/voxbackend/', 1)[1]}:{frame.lineno}"
    return "?"


class HostSyncs(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter[str] = collections.Counter()

    @property
    def count(self) -> int:
        return sum(self.sites.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _COPIES or func in _VALUE_SHAPED or (func in _INDEXING and _bool_index(args)):
            self.sites[f"{_caller()} {func.__name__}"] += 1
        return func(*args, **(kwargs or {}))
