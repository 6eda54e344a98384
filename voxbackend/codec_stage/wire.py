"""Codec windows, codec states and decoded audio as bytes, between an engine and a codec stage.

Everything goes through torch.save and comes back with `weights_only=True`: tensors, numbers, strings, lists,
dicts, None, and nothing that runs code when loaded. A codec stage listens on a socket that any process of its
user can reach, so it must never unpickle what it is sent. Numpy arrays, tuples, torch generators and dataclasses
(the models' codec states, WindowJob) are written as tagged dicts and rebuilt here; a dataclass must be one of
voxbackend's own.
"""
from __future__ import annotations

import dataclasses
import importlib
import io
from typing import Any

import numpy as np
import torch

TAG = "__voxbackend__"


def pack(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(_encode(value), buf)
    return buf.getvalue()


def unpack(data: bytes, device: str = "cpu") -> Any:
    """`data` from pack(). What was on a GPU comes onto `device`, what was on the CPU stays there (a codec state
    keeps some tensors and its vocoder's noise generator on the CPU whatever its device), as on a colocated engine."""
    return _decode(torch.load(io.BytesIO(data), map_location=_placement(device), weights_only=True), device)


def _placement(device: str):
    if not device.startswith("cuda"):
        return "cpu"
    index = torch.device(device).index or 0
    return lambda storage, location: storage if location == "cpu" else storage.cuda(index)


def _encode(o: Any) -> Any:
    if o is None or isinstance(o, (bool, int, float, str, torch.Tensor)):
        return o.detach() if isinstance(o, torch.Tensor) else o
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return {TAG: "ndarray", "value": torch.from_numpy(np.ascontiguousarray(o))}
    if isinstance(o, torch.Generator):
        return {TAG: "generator", "cuda": o.device.type == "cuda", "state": o.get_state()}
    if isinstance(o, list):
        return [_encode(x) for x in o]
    if isinstance(o, tuple):
        return {TAG: "tuple", "items": [_encode(x) for x in o]}
    if isinstance(o, dict):
        if not all(isinstance(k, str) and k != TAG for k in o):
            raise TypeError("only dicts with string keys go over the wire")
        return {k: _encode(v) for k, v in o.items()}
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        cls = type(o)
        return {TAG: "dataclass", "type": f"{cls.__module__}:{cls.__qualname__}",
                "fields": {f.name: _encode(getattr(o, f.name)) for f in dataclasses.fields(o)}}
    raise TypeError(f"{type(o).__name__} does not go over the codec wire")


def _decode(o: Any, device: str) -> Any:
    if isinstance(o, list):
        return [_decode(x, device) for x in o]
    if not isinstance(o, dict):
        return o
    kind = o.get(TAG)
    if kind is None:
        return {k: _decode(v, device) for k, v in o.items()}
    if kind == "ndarray":
        return o["value"].cpu().numpy()
    if kind == "tuple":
        return tuple(_decode(x, device) for x in o["items"])
    if kind == "generator":  # a CPU generator stays one (the flow vocoders draw their noise on the CPU)
        generator = torch.Generator(device=device) if o["cuda"] else torch.Generator()
        generator.set_state(o["state"].cpu())
        return generator
    if kind == "dataclass":
        cls = _dataclass(o["type"])
        obj = cls.__new__(cls)
        for name, value in o["fields"].items():
            object.__setattr__(obj, name, _decode(value, device))  # frozen ones too
        return obj
    raise ValueError(f"unknown tag {kind!r} on the codec wire")


def _dataclass(name: str) -> type:
    module, _, qualname = name.partition(":")
    if not (module == "voxbackend" or module.startswith("voxbackend.")) or "." in qualname:
        raise ValueError(f"{name} is not a voxbackend dataclass")
    cls = getattr(importlib.import_module(module), qualname, None)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ValueError(f"{name} is not a voxbackend dataclass")
    return cls
