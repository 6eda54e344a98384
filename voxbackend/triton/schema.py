"""Tensor names and types of the Triton request schema, shared by the configs and the models.

One table is the source of truth: configs.py renders config.pbtxt from it and the models read and write
tensors by these names, so the two can't drift apart.
"""
from __future__ import annotations

from dataclasses import dataclass

AUDIO_FORMATS = ("pcm16", "fp32")  # PCM16 little-endian is the default: half the bytes on the wire
DEFAULT_AUDIO_FORMAT = "pcm16"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # Triton config type without the TYPE_ prefix
    dims: tuple[int, ...] = (1,)
    optional: bool = False
    doc: str = ""


# Sampling fields: Triton name -> SamplingParams attribute.
SAMPLING_FIELDS = {
    "TEMPERATURE": "temperature",
    "TOP_P": "top_p",
    "TOP_K": "top_k",
    "MIN_P": "min_p",
    "REPETITION_PENALTY": "repetition_penalty",
    "MAX_TOKENS": "max_tokens",
    "SEED": "seed",
}

_SAMPLING_SPECS = (
    TensorSpec("TEMPERATURE", "FP32", optional=True, doc=">= 0; 0 = greedy"),
    TensorSpec("TOP_P", "FP32", optional=True, doc="(0, 1]"),
    TensorSpec("TOP_K", "INT32", optional=True, doc=">= 0; 0 = off"),
    TensorSpec("MIN_P", "FP32", optional=True, doc="[0, 1]"),
    TensorSpec("REPETITION_PENALTY", "FP32", optional=True, doc="(0, 100]; 1 = off"),
    TensorSpec("MAX_TOKENS", "INT32", optional=True, doc="LM steps, >= 1"),
    TensorSpec("SEED", "INT64", optional=True, doc="[0, 2^31-1]; random when absent"),
)
_FORMAT_SPEC = TensorSpec("AUDIO_FORMAT", "STRING", optional=True, doc='"pcm16" (default) or "fp32"')

# What a client sends to the ensemble (and may send to the engine model directly).
TEXT_INPUTS = (
    TensorSpec("TEXT", "STRING", optional=True, doc="UTF-8 text to speak; required (optional here so a missing TEXT gets our clear error)"),
    TensorSpec("VOICE", "STRING", optional=True, doc="one of the model's voices; model default when absent"),
    *_SAMPLING_SPECS,
    _FORMAT_SPEC,
)

# Preprocess -> engine: prompt ids plus every sampling field, validated and filled with the model's defaults.
PREPROCESS_OUTPUTS = (
    TensorSpec("PROMPT_IDS", "INT64", (-1,), doc="prompt token ids"),
    *(TensorSpec(s.name, s.dtype, doc=s.doc) for s in _SAMPLING_SPECS),
    TensorSpec("AUDIO_FORMAT", "STRING", doc="passed through the engine to the postprocess"),
)

# Engine inputs: prompt ids (from the preprocess) or TEXT/VOICE (direct clients), sampling fields optional.
ENGINE_INPUTS = (
    TensorSpec("PROMPT_IDS", "INT64", (-1,), optional=True, doc="prompt token ids; or send TEXT"),
    TensorSpec("TEXT", "STRING", optional=True, doc="UTF-8 text; tokenized here when PROMPT_IDS is absent"),
    TensorSpec("VOICE", "STRING", optional=True, doc="voice for TEXT"),
    *_SAMPLING_SPECS,
    _FORMAT_SPEC,
)

# Per-chunk metadata, on every response of the engine and the ensemble.
_CHUNK_META = (
    TensorSpec("SAMPLE_RATE", "INT32", doc="Hz"),
    TensorSpec("CHUNK_INDEX", "INT32", doc="0, 1, ... ; on the final response: number of audio chunks"),
    TensorSpec("FINAL", "BOOL", doc="true on the last response of the stream (its AUDIO is empty)"),
    TensorSpec("FINISH_REASON", "STRING", doc='"" on chunks; "stop", "length" or "cancelled" on the final one'),
)

ENGINE_OUTPUTS = (
    TensorSpec("AUDIO", "FP32", (-1,), doc="float32 mono samples in [-1, 1]"),
    *_CHUNK_META,
    TensorSpec("AUDIO_FORMAT", "STRING", doc="the requested encoding, for the postprocess"),
    TensorSpec("STREAM_ID", "STRING", doc="opaque id of the stream in its engine instance (the postprocess "
               "uses it to pass an ensemble client's cancellation back)"),
)

POSTPROCESS_INPUTS = ENGINE_OUTPUTS

POSTPROCESS_OUTPUTS = (
    TensorSpec("AUDIO", "STRING", doc="one element: the chunk's samples as raw little-endian bytes "
               "(int16 for pcm16, float32 for fp32)"),
    *_CHUNK_META,
)
