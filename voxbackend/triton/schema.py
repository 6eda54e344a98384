"""Tensor names and types of the Triton request schema, shared by the configs and the models.

One table is the source of truth: configs.py renders config.pbtxt from it and the models read and write
tensors by these names, so the two can't drift apart. Inputs common to every SpeechLM (TEXT, sampling,
AUDIO_FORMAT) are fixed here; each model declares its own extra inputs in MODEL_INPUTS (VOICE for Orpheus;
SPEAKER and context segments for CSM) with the `prepare()` keyword each one fills, so the glue parses them
without knowing the model.
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
    # --- model-specific inputs only (MODEL_INPUTS): how fields.prepare_kwargs hands them to model.prepare ---
    arg: str = ""  # the prepare() keyword (or segment key) this input fills
    segment: str = ""  # set: one element per segment; prepare(<segment>=[{arg: value, ...}, ...])
    kind: str = ""  # "audio": BYTES audio files, or raw float32 when the segment's "rate" input is present


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

_TEXT_SPEC = TensorSpec("TEXT", "STRING", optional=True,
                        doc="UTF-8 text to speak; required (optional here so a missing TEXT gets our clear error)")

# Set by the preprocess, so only streams behind an ensemble get probes (see cancel_channel).
_PROBE_DOC = ("true: while the stream has nothing to send (e.g. queued), the engine sends a probe response now "
              "and then; audio_postprocess relays a cancelled ensemble's probe to the engine and drops every probe")

# Each model's own inputs, by request-schema name (ServedModel.inputs; the `request_inputs` config parameter).
MODEL_INPUTS: dict[str, tuple[TensorSpec, ...]] = {
    "voice": (
        TensorSpec("VOICE", "STRING", optional=True, doc="one of the model's voices; model default when absent",
                   arg="voice"),
    ),
    "speaker_context": (
        TensorSpec("SPEAKER", "INT32", optional=True, doc="speaker id of TEXT, in [0, 10); 0 when absent",
                   arg="speaker"),
        TensorSpec("CONTEXT_TEXT", "STRING", (-1,), optional=True,
                   doc="context segments (earlier turns that set the voice): one UTF-8 text per segment",
                   arg="text", segment="context"),
        TensorSpec("CONTEXT_SPEAKER", "INT32", (-1,), optional=True, doc="speaker id per context segment",
                   arg="speaker", segment="context"),
        TensorSpec("CONTEXT_AUDIO", "STRING", (-1,), optional=True,
                   doc="audio per context segment: a WAV/FLAC/OGG file's bytes (any rate: resampled), or raw "
                       "little-endian float32 mono samples when CONTEXT_SAMPLE_RATE is sent",
                   arg="audio", segment="context", kind="audio"),
        TensorSpec("CONTEXT_SAMPLE_RATE", "INT32", (-1,), optional=True,
                   doc="Hz of raw float32 CONTEXT_AUDIO: one value for all segments or one per segment",
                   arg="sample_rate", segment="context", kind="rate"),
    ),
}


def client_inputs(model_inputs: tuple[TensorSpec, ...] = MODEL_INPUTS["voice"]) -> tuple[TensorSpec, ...]:
    """What a client sends to the ensemble (and may send to the engine model directly)."""
    return (_TEXT_SPEC, *model_inputs, *_SAMPLING_SPECS, _FORMAT_SPEC)


def engine_inputs(model_inputs: tuple[TensorSpec, ...] = MODEL_INPUTS["voice"]) -> tuple[TensorSpec, ...]:
    """Engine inputs: prompt ids (from the preprocess) or TEXT and the model's inputs (direct clients)."""
    return (
        TensorSpec("PROMPT_IDS", "INT64", (-1,), optional=True, doc="prompt token ids; or send TEXT"),
        TensorSpec("TEXT", "STRING", optional=True, doc="UTF-8 text; prepared here when PROMPT_IDS is absent"),
        *model_inputs,
        *_SAMPLING_SPECS,
        _FORMAT_SPEC,
        TensorSpec("CANCEL_PROBES", "BOOL", optional=True, doc=_PROBE_DOC),
    )


TEXT_INPUTS = client_inputs()  # Orpheus' (kept for perf/naive_triton.py)
ENGINE_INPUTS = engine_inputs()

# Preprocess -> engine: prompt ids plus every sampling field, validated and filled with the model's defaults.
PREPROCESS_OUTPUTS = (
    TensorSpec("PROMPT_IDS", "INT64", (-1,),
               doc="prompt token ids; multi-column models (CSM): rows of token_columns ids, flattened"),
    *(TensorSpec(s.name, s.dtype, doc=s.doc) for s in _SAMPLING_SPECS),
    TensorSpec("AUDIO_FORMAT", "STRING", doc="passed through the engine to the postprocess"),
    TensorSpec("CANCEL_PROBES", "BOOL", doc=_PROBE_DOC),
)

# Per-chunk metadata, on every response of the engine and the ensemble.
_CHUNK_META = (
    TensorSpec("SAMPLE_RATE", "INT32", doc="Hz"),
    TensorSpec("CHUNK_INDEX", "INT32", doc="0, 1, ... ; on the final response: number of audio chunks"),
    TensorSpec("FINAL", "BOOL", doc="true on the last response of the stream (its AUDIO is empty)"),
    TensorSpec("FINISH_REASON", "STRING", doc='"" on chunks; "stop", "length" or "cancelled" on the final one'),
    TensorSpec("SEED_USED", "INT64", doc="the request's sampling seed (its SEED, or the one the server drew): "
               "sent back as SEED it reproduces the audio (an ensemble cannot have an output named like an input)"),
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
