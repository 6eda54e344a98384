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
from voxbackend.triton.schema import AUDIO_FORMATS, DEFAULT_AUDIO_FORMAT, SAMPLING_FIELDS, SAMPLING_TYPES, TensorSpec

Getter = Callable[[str], "np.ndarray | None"]


def _single(name: str, value: np.ndarray) -> np.generic | bytes:
    # dims are [1] in the configs; a client sending [1, 1] or [0] gets a clear message, not an IndexError
    if value.size != 1:
        raise InvalidRequest(f"{name} must hold exactly one element, got shape {list(value.shape)}",
                             field=engine_field(name))
    return value.reshape(-1)[0]


def string_field(get: Getter, name: str, required: bool = False) -> str | None:
    value = get(name)
    if value is None:
        if required:
            raise InvalidRequest(f"{name} is required", field=engine_field(name))
        return None
    item = _single(name, value)
    if isinstance(item, str):
        return item
    if not isinstance(item, (bytes, np.bytes_)):
        raise InvalidRequest(f"{name} must be a UTF-8 string (BYTES), got {value.dtype}", field=engine_field(name))
    try:
        return bytes(item).decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"{name} is not valid UTF-8 ({e.reason} at byte {e.start})",
                             field=engine_field(name)) from None


def text_field(get: Getter) -> str:
    text = string_field(get, "TEXT", required=True)
    if not text.strip():
        raise InvalidRequest("TEXT is empty", field="text")
    return text


def text_and_voice(get: Getter) -> tuple[str, str | None]:
    text = text_field(get)
    voice = string_field(get, "VOICE")
    return text, (voice or None)


def prepare_request(get: Getter, model, specs: tuple[TensorSpec, ...]) -> list:
    """TEXT and the model's own inputs (SpeechModel.request_inputs) -> model.prepare(...) -> prompt ids or rows."""
    text = text_field(get) if getattr(model, "text_required", True) else string_field(get, "TEXT")
    kwargs = prepare_kwargs(get, specs)
    try:
        return model.prepare(text, **kwargs)
    except InvalidRequest as e:
        raise for_client(e, specs) from None


def prepare_kwargs(get: Getter, specs: tuple[TensorSpec, ...]) -> dict:
    """The model's inputs as prepare() keywords; absent (or empty-string) inputs are left to the model's default.

    Inputs that share a `segment` become one list of dicts, element i of each input going to segment i;
    they must all be present with the same number of elements (a "rate" input may hold one value for all).
    """
    kwargs: dict = {}
    segments: dict[str, list[TensorSpec]] = {}
    for spec in specs:
        if spec.segment:
            segments.setdefault(spec.segment, []).append(spec)
            continue
        value = get(spec.name)
        if value is not None:
            item = _scalar(spec, value)
            if item is not None:
                kwargs[spec.arg] = item
    for segment, group in segments.items():
        parsed = _segments(get, group)
        if parsed is not None:
            kwargs[segment] = parsed
    return kwargs


def _scalar(spec: TensorSpec, value: np.ndarray):
    if spec.kind == "audio":  # an audio file's bytes, for the model to decode
        item = _single(spec.name, value)
        if not isinstance(item, (bytes, np.bytes_)):
            raise InvalidRequest(f"{spec.name} must be BYTES (an audio file), got {value.dtype}",
                                 field=engine_field(spec.name))
        return bytes(item) or None
    if spec.dtype == "STRING":
        return string_field(lambda _: value, spec.name) or None
    if spec.dtype == "BOOL":
        item = _single(spec.name, value)
        if not isinstance(item, (bool, np.bool_)):
            raise InvalidRequest(f"{spec.name} must be BOOL, got {value.dtype}", field=engine_field(spec.name))
        return bool(item)
    return _numbers(spec, np.asarray(_single(spec.name, value)).reshape(1))[0]


def _numbers(spec: TensorSpec, value: np.ndarray) -> list:
    integer = spec.dtype.startswith("INT")
    if value.dtype.kind not in ("iu" if integer else "iuf"):
        one = spec.dims == (1,)
        what = ("an integer" if one else "integers") if integer else ("a number" if one else "numbers")
        raise InvalidRequest(f"{spec.name} must be {what}, got {value.dtype}", field=engine_field(spec.name))
    return [int(v) if integer else float(v) for v in value]


def _segments(get: Getter, group: list[TensorSpec]) -> list[dict] | None:
    values = {s.name: get(s.name) for s in group}
    present = [s for s in group if values[s.name] is not None]
    if not present:
        return None
    for s in present:
        if values[s.name].ndim != 1:
            raise InvalidRequest(f"{s.name} must be a 1-D tensor (one element per segment), "
                                 f"got shape {list(values[s.name].shape)}", field=engine_field(s.name))
    parts = [s for s in group if s.kind != "rate"]
    first = next((s for s in parts if values[s.name] is not None), present[0])
    n = len(values[first.name])
    for s in parts:
        if values[s.name] is None:
            raise InvalidRequest(f"{s.name} is missing: send {', '.join(p.name for p in parts)} together, "
                                 f"one element per segment", field=engine_field(s.name))
        if len(values[s.name]) != n:
            raise InvalidRequest(f"{s.name} has {len(values[s.name])} element(s) but {first.name} has {n}: "
                                 f"send one element per segment in each", field=engine_field(s.name))
    rate = next((s for s in present if s.kind == "rate"), None)
    rates = _rates(rate, values[rate.name], n) if rate else None
    out: list[dict] = [{} for _ in range(n)]
    for s in parts:
        if s.kind == "audio":
            items = _audio(s, values[s.name], raw=rates is not None)
        elif s.dtype == "STRING":
            items = [string_field(lambda _, v=v: np.array([v], dtype=np.object_), f"{s.name}[{i}]", required=True)
                     for i, v in enumerate(values[s.name])]
        else:
            items = _numbers(s, values[s.name])
        for seg, item in zip(out, items):
            seg[s.arg] = item
    for seg, r in zip(out, rates or ()):
        seg[rate.arg] = r
    return out


def _rates(spec: TensorSpec, value: np.ndarray, n: int) -> list[int]:
    rates = _numbers(spec, value)
    if len(rates) not in (1, n):
        raise InvalidRequest(f"{spec.name} needs 1 or {n} element(s) (one per segment), got {len(rates)}",
                             field=engine_field(spec.name))
    return rates * n if len(rates) == 1 else rates


def _audio(spec: TensorSpec, value: np.ndarray, raw: bool) -> list[bytes | np.ndarray]:
    """Each element: an audio file's bytes, passed on for the model to decode; or (raw) little-endian float32
    samples, passed on as an array (the model resamples them from the rate input)."""
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, (bytes, np.bytes_)):
            raise InvalidRequest(f"{spec.name}[{i}] must be BYTES, got {type(item).__name__}",
                                 field=engine_field(f"{spec.name}[{i}]"))
        data = bytes(item)
        if raw:
            if len(data) % 4:
                raise InvalidRequest(f"{spec.name}[{i}]: raw float32 samples need a multiple of 4 bytes, "
                                     f"got {len(data)}", field=engine_field(f"{spec.name}[{i}]"))
            data = np.frombuffer(data, dtype="<f4").astype(np.float32)
        out.append(data)
    return out


def engine_field(tensor: str) -> str:
    """A tensor name (CONTEXT_AUDIO[1] included) -> the engine-side field it fills (context[1].audio)."""
    name, bracket, index = tensor.partition("[")
    index = index.rstrip("]")
    if name in SAMPLING_FIELDS:
        return SAMPLING_FIELDS[name]
    from voxbackend.models.registry import KINDS  # every served model's own inputs; the glue names none

    for spec in (s for kind in KINDS.values() for s in kind.request_inputs):
        if spec.name == name:
            if not spec.segment:
                return spec.arg
            return f"{spec.segment}[{index}].{spec.arg}" if bracket else spec.segment
    return name.lower()  # TEXT, AUDIO_FORMAT, PROMPT_IDS


def _tensor_name(field: str, specs: tuple[TensorSpec, ...]) -> str | None:
    """An engine-side field (InvalidRequest.field) -> the tensor the client sent, or None if it has none."""
    if field == "text":
        return "TEXT"
    tensor = {attr: name for name, attr in SAMPLING_FIELDS.items()}.get(field)
    if tensor:
        return tensor
    segment, bracket, rest = field.partition("[")
    index, _, arg = rest.partition("].")
    for s in specs:
        if s.kind == "rate":
            continue
        if s.segment and bracket and segment == s.segment and arg == s.arg and index.isdigit():
            return f"{s.name}[{index}]"
        if not s.segment and field == s.arg:
            return s.name
    return None


def for_client(e: InvalidRequest, specs: tuple[TensorSpec, ...] = ()) -> InvalidRequest:
    """The engine's message speaks in engine-side names (e.field); the client sent tensor names."""
    field = (e.field or "").partition(" ")[0]  # "context[0].audio sample_rate": the field, then a qualifier
    tensor = _tensor_name(field, specs) if field else None
    if tensor is None:
        return e
    message = str(e)
    message = tensor + message[len(field):] if message.startswith(field) else f"{tensor}: {message}"
    return InvalidRequest(message, field=e.field)


def sampling(get: Getter, defaults: SamplingParams) -> SamplingParams:
    """The model's defaults overridden by whichever sampling fields the request carries, validated."""
    overrides = {}
    for tensor_name, attr in SAMPLING_FIELDS.items():
        value = get(tensor_name)
        if value is not None:
            item = _single(tensor_name, value)
            if not isinstance(item, (np.integer, np.floating, int, float)) or isinstance(item, (bool, np.bool_)):
                raise InvalidRequest(f"{tensor_name} must be a number, got {value.dtype}", field=attr)
            if isinstance(item, np.float32):
                # FP32 on the wire: take the shortest decimal that rounds to it (0.6, not 0.6000000238)
                item = float(str(item))
            overrides[attr] = item.item() if hasattr(item, "item") else item
    try:
        return dataclasses.replace(defaults, **overrides).validated()
    except InvalidRequest as e:
        raise for_client(e) from None


def audio_format(get: Getter) -> str:
    fmt = (string_field(get, "AUDIO_FORMAT") or DEFAULT_AUDIO_FORMAT).lower()
    if fmt not in AUDIO_FORMATS:
        raise InvalidRequest(f"AUDIO_FORMAT must be one of {', '.join(AUDIO_FORMATS)}, got {fmt!r}",
                             field="audio_format")
    return fmt


def cancel_probes(get: Getter) -> bool:
    value = get("CANCEL_PROBES")
    return bool(value is not None and value.size and value.reshape(-1)[0])


def prompt_ids(get: Getter, columns: int = 1) -> list[int] | list[list[int]] | None:
    """Ids [L]; for multi-column models the flattened rows, returned as [L, columns]."""
    value = get("PROMPT_IDS")
    if value is None:
        return None
    if value.ndim != 1 or value.size == 0:
        raise InvalidRequest(f"PROMPT_IDS must be a non-empty 1-D INT64 tensor, got shape {list(value.shape)}",
                             field="prompt_ids")
    if columns == 1:
        return [int(x) for x in value]
    if value.size % columns:
        raise InvalidRequest(f"PROMPT_IDS must hold rows of {columns} ids (flattened), got {value.size} ids",
                             field="prompt_ids")
    return value.astype(np.int64).reshape(-1, columns).tolist()


def conditioning_tensors(prompt, specs: tuple[TensorSpec, ...]) -> dict[str, np.ndarray]:
    """A Prompt's conditioning arrays under their tensor names (the preprocess's outputs)."""
    dtypes = {"INT32": np.int32, "INT64": np.int64, "FP32": np.float32}
    return {s.name: np.ascontiguousarray(prompt.conditioning[s.arg], dtype=dtypes[s.dtype]) for s in specs
            if s.arg in prompt.conditioning}


def conditioning(get: Getter, specs: tuple[TensorSpec, ...]) -> dict[str, np.ndarray]:
    """The conditioning tensors a request carries with PROMPT_IDS, keyed by their prepare() names (checked by
    the model at submission)."""
    return {s.arg: value for s in specs if (value := get(s.name)) is not None}


def flat_prompt(ids: list[int] | list[list[int]]) -> np.ndarray:
    """prepare()'s ids or rows -> the 1-D PROMPT_IDS tensor."""
    return np.asarray(ids, dtype=np.int64).reshape(-1)


def sampling_tensors(params: SamplingParams) -> dict[str, np.ndarray]:
    """SamplingParams -> the [1]-shaped tensors of PREPROCESS_OUTPUTS (dtypes as in the schema)."""
    return {name: np.array([getattr(params, attr)], dtype=SAMPLING_TYPES[name][1])
            for name, attr in SAMPLING_FIELDS.items()}
