"""Request tensors -> validated Python values. Pure numpy: unit-tested without Triton.

Every function takes `get(name) -> np.ndarray | None` (absent optional input -> None) and raises
InvalidRequest with a message that names the field.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from voxbackend.errors import InvalidRequest
from voxbackend.sampling_params import SamplingParams
from voxbackend.triton.schema import AUDIO_FORMATS, DEFAULT_AUDIO_FORMAT, SAMPLING_FIELDS

Getter = Callable[[str], "np.ndarray | None"]


def _single(name: str, value: np.ndarray) -> np.generic | bytes:
    # dims are [1] in the configs; a client sending [1, 1] or [0] gets a clear message, not an IndexError
    if value.size != 1:
        raise InvalidRequest(f"{name} must hold exactly one element, got shape {list(value.shape)}")
    return value.reshape(-1)[0]


def string_field(get: Getter, name: str, required: bool = False) -> str | None:
    value = get(name)
    if value is None:
        if required:
            raise InvalidRequest(f"{name} is required")
        return None
    item = _single(name, value)
    if isinstance(item, str):
        return item
    if not isinstance(item, (bytes, np.bytes_)):
        raise InvalidRequest(f"{name} must be a UTF-8 string (BYTES), got {value.dtype}")
    try:
        return bytes(item).decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"{name} is not valid UTF-8 ({e.reason} at byte {e.start})") from None


def text_and_voice(get: Getter) -> tuple[str, str | None]:
    text = string_field(get, "TEXT", required=True)
    if not text.strip():
        raise InvalidRequest("TEXT is empty")
    voice = string_field(get, "VOICE")
    return text, (voice or None)


def sampling(get: Getter, defaults: SamplingParams) -> SamplingParams:
    """The model's defaults overridden by whichever sampling fields the request carries, validated."""
    overrides = {}
    for tensor_name, attr in SAMPLING_FIELDS.items():
        value = get(tensor_name)
        if value is not None:
            item = _single(tensor_name, value)
            if not isinstance(item, (np.integer, np.floating, int, float)) or isinstance(item, (bool, np.bool_)):
                raise InvalidRequest(f"{tensor_name} must be a number, got {value.dtype}")
            if isinstance(item, np.float32):
                # FP32 on the wire: take the shortest decimal that rounds to it (0.6, not 0.6000000238)
                item = float(str(item))
            overrides[attr] = item.item() if hasattr(item, "item") else item
    try:
        return dataclasses.replace(defaults, **overrides).validated()
    except InvalidRequest as e:
        raise InvalidRequest(_tensor_names(str(e))) from None


def audio_format(get: Getter) -> str:
    fmt = (string_field(get, "AUDIO_FORMAT") or DEFAULT_AUDIO_FORMAT).lower()
    if fmt not in AUDIO_FORMATS:
        raise InvalidRequest(f"AUDIO_FORMAT must be one of {', '.join(AUDIO_FORMATS)}, got {fmt!r}")
    return fmt


def prompt_ids(get: Getter) -> list[int] | None:
    value = get("PROMPT_IDS")
    if value is None:
        return None
    if value.ndim != 1 or value.size == 0:
        raise InvalidRequest(f"PROMPT_IDS must be a non-empty 1-D INT64 tensor, got shape {list(value.shape)}")
    return [int(x) for x in value]


def sampling_tensors(params: SamplingParams) -> dict[str, np.ndarray]:
    """SamplingParams -> the [1]-shaped tensors of PREPROCESS_OUTPUTS (dtypes as in the schema)."""
    dtypes = {"TEMPERATURE": np.float32, "TOP_P": np.float32, "TOP_K": np.int32, "MIN_P": np.float32,
              "REPETITION_PENALTY": np.float32, "MAX_TOKENS": np.int32, "SEED": np.int64}
    return {name: np.array([getattr(params, attr)], dtype=dtypes[name]) for name, attr in SAMPLING_FIELDS.items()}


def _tensor_names(message: str) -> str:
    # SamplingParams speaks in attribute names; the client sent tensor names
    for tensor_name, attr in SAMPLING_FIELDS.items():
        if message.startswith(attr + " "):
            return tensor_name + message[len(attr):]
    return message
