"""Tensor names and types of the Triton request schema, shared by the configs and the models.

One table is the source of truth: configs.py renders config.pbtxt from it and the models read and write
tensors by these names, so the two can't drift apart. Inputs common to every SpeechLM (TEXT, sampling,
AUDIO_FORMAT) are fixed here; each model class declares its own extra inputs (`SpeechModel.request_inputs`)
with the `prepare()` keyword each one fills, so the glue parses them without knowing the model.
"""
from __future__ import annotations

import numpy as np

from voxbackend.tensor_spec import TensorSpec

AUDIO_FORMATS = ("pcm16", "fp32")  # PCM16 little-endian is the default: half the bytes on the wire
DEFAULT_AUDIO_FORMAT = "pcm16"

# Sampling fields: Triton name -> SamplingParams attribute.
SAMPLING_FIELDS = {
    "TEMPERATURE": "temperature",
    "TOP_P": "top_p",
    "TOP_K": "top_k",
    "MIN_P": "min_p",
    "REPETITION_PENALTY": "repetition_penalty",
    "MAX_TOKENS": "max_tokens",
    "MIN_TOKENS": "min_tokens",
    "SEED": "seed",
    "CFG_WEIGHT": "cfg_weight",
}

_SAMPLING_SPECS = (
    TensorSpec("TEMPERATURE", "FP32", optional=True, doc=">= 0; 0 = greedy"),
    TensorSpec("TOP_P", "FP32", optional=True, doc="(0, 1]"),
    TensorSpec("TOP_K", "INT32", optional=True, doc=">= 0; 0 = off"),
    TensorSpec("MIN_P", "FP32", optional=True, doc="[0, 1]"),
    TensorSpec("REPETITION_PENALTY", "FP32", optional=True, doc="(0, 100]; 1 = off"),
    TensorSpec("MAX_TOKENS", "INT32", optional=True, doc="LM steps, >= 1"),
    TensorSpec("MIN_TOKENS", "INT32", optional=True, doc="LM steps before the model may stop, >= 0"),
    TensorSpec("SEED", "INT64", optional=True, doc="[0, 2^31-1]; random when absent"),
    TensorSpec("CFG_WEIGHT", "FP32", optional=True,
               doc="classifier-free guidance weight in [0, 10]; 0 = off; only models with guidance (Chatterbox) "
                   "take a non-zero one"),
)
_FORMAT_SPEC = TensorSpec("AUDIO_FORMAT", "STRING", optional=True, doc='"pcm16" (default) or "fp32"')

_TEXT_SPEC = TensorSpec("TEXT", "STRING", optional=True,
                        doc="UTF-8 text to speak; required (optional here so a missing TEXT gets our clear error)")
_TURN_TEXT_SPEC = TensorSpec("TEXT", "STRING", optional=True,
                             doc="UTF-8: the user's turn in text; send TEXT, the model's audio input or both")

# Set by the preprocess, so only streams of a caller that chains it to the engine by BLS get probes
# (see cancel_channel).
_PROBE_DOC = ("true: while the stream has nothing to send (e.g. queued), the engine sends a probe response now "
              "and then, so a BLS caller learns the stream's STREAM_ID (to pass a cancellation on); it drops "
              "every probe")


def client_inputs(model_inputs: tuple[TensorSpec, ...], text_required: bool = True) -> tuple[TensorSpec, ...]:
    """What a client sends to the front model (and may send to the engine model directly); `model_inputs` are the
    served model's own (`SpeechModel.request_inputs`); text_required False: a model that may take audio instead."""
    return (_TEXT_SPEC if text_required else _TURN_TEXT_SPEC, *model_inputs, *_SAMPLING_SPECS, _FORMAT_SPEC)


def engine_inputs(model_inputs: tuple[TensorSpec, ...],
                  conditioning: tuple[TensorSpec, ...] = ()) -> tuple[TensorSpec, ...]:
    """Engine inputs: prompt ids and the model's conditioning arrays (from the preprocess) or TEXT and the model's
    inputs (direct clients)."""
    return (
        TensorSpec("PROMPT_IDS", "INT64", (-1,), optional=True, doc="prompt token ids; or send TEXT"),
        *(TensorSpec(s.name, s.dtype, s.dims, optional=True, doc=f"with PROMPT_IDS: {s.doc}") for s in conditioning),
        TensorSpec("TEXT", "STRING", optional=True, doc="UTF-8 text; prepared here when PROMPT_IDS is absent"),
        *model_inputs,
        *_SAMPLING_SPECS,
        _FORMAT_SPEC,
        TensorSpec("CANCEL_PROBES", "BOOL", optional=True, doc=_PROBE_DOC),
    )


def preprocess_outputs(conditioning: tuple[TensorSpec, ...] = ()) -> tuple[TensorSpec, ...]:
    """PREPROCESS_OUTPUTS, then the model's conditioning arrays (SpeechModel.conditioning)."""
    return (*PREPROCESS_OUTPUTS, *(TensorSpec(s.name, s.dtype, s.dims, doc=s.doc) for s in conditioning))


# Preprocess -> engine: prompt ids plus every sampling field, validated and filled with the model's defaults
# (and within the request's length rules).
PREPROCESS_OUTPUTS = (
    TensorSpec("PROMPT_IDS", "INT64", (-1,),
               doc="prompt token ids; multi-column models: rows of token_columns ids, flattened"),
    *(TensorSpec(s.name, s.dtype, doc=s.doc) for s in _SAMPLING_SPECS),
    TensorSpec("AUDIO_FORMAT", "STRING", doc="passed through the engine to its caller, which encodes"),
    TensorSpec("CANCEL_PROBES", "BOOL", doc=_PROBE_DOC),
)

# Per-chunk metadata, on every response of the engine and the front model.
CHUNK_META = (
    TensorSpec("SAMPLE_RATE", "INT32", doc="Hz"),
    TensorSpec("CHUNK_INDEX", "INT32", doc="0, 1, ... ; on the final response: number of audio chunks"),
    TensorSpec("FINAL", "BOOL", doc="true on the last response of the stream (its AUDIO is empty)"),
    TensorSpec("FINISH_REASON", "STRING",
               doc='"" on chunks; "stop", "length", "cancelled" or "shutdown" on the final one'),
    TensorSpec("SEED_USED", "INT64", doc="the request's sampling seed (its SEED, or the one the server drew): "
               "sent back as SEED it reproduces the audio"),
)

ENGINE_OUTPUTS = (
    TensorSpec("AUDIO", "FP32", (-1,), doc="float32 mono samples in [-1, 1]"),
    *CHUNK_META,
    TensorSpec("AUDIO_FORMAT", "STRING", doc="the requested encoding, for a caller that encodes"),
    TensorSpec("STREAM_ID", "STRING", doc="opaque id of the stream in its engine instance (a BLS caller "
               "uses it to pass its client's cancellation on)"),
)

CLIENT_OUTPUTS = (
    TensorSpec("AUDIO", "STRING", doc="one element: the chunk's samples as raw little-endian bytes "
               "(int16 for pcm16, float32 for fp32)"),
    *CHUNK_META,
)

# A model that answers in text and speech (SpeechModel.text_output) sends its reply's text in responses of their
# own, in order with the audio chunks: AUDIO empty, CHUNK_INDEX the index the next audio chunk will have.
TEXT_OUT = TensorSpec("TEXT_OUT", "STRING", doc="UTF-8: the reply's text since the previous text response (whole "
                      "characters); empty on audio chunks and the final response")


def engine_outputs(text_output: bool = False) -> tuple[TensorSpec, ...]:
    return (*ENGINE_OUTPUTS, TEXT_OUT) if text_output else ENGINE_OUTPUTS


def client_outputs(text_output: bool = False) -> tuple[TensorSpec, ...]:
    return (*CLIENT_OUTPUTS, TEXT_OUT) if text_output else CLIENT_OUTPUTS


_NUMPY_TYPES = {"FP32": np.float32, "INT32": np.int32, "INT64": np.int64}
# Sampling fields: Triton name -> (Triton type, numpy dtype), for whoever builds these tensors (client, preprocess)
SAMPLING_TYPES = {s.name: (s.dtype, _NUMPY_TYPES[s.dtype]) for s in _SAMPLING_SPECS}
