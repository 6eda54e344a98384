"""The request bodies: OpenAI's /v1/audio/speech fields plus our sampling extras (chat_request.py takes them too),
and the WebSocket's start."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from voxbackend.api.audio_out import RESPONSE_FORMATS
from voxbackend.api.catalog import SpeechModel
from voxbackend.api.errors import ApiError, bad_request, unknown_model

# what the request tensors can hold; the engine checks the real ranges
Int32 = Annotated[int, Field(ge=-2**31, lt=2**31)]
Int64 = Annotated[int, Field(ge=-2**63, lt=2**63)]

# API field -> request tensor; the engine validates the ranges and its errors name the tensor (errors.py).
SAMPLING_TENSORS = {"temperature": "TEMPERATURE", "top_p": "TOP_P", "top_k": "TOP_K", "min_p": "MIN_P",
                    "repetition_penalty": "REPETITION_PENALTY", "max_tokens": "MAX_TOKENS", "seed": "SEED",
                    "cfg_weight": "CFG_WEIGHT"}
# API field -> a model's own FP32 input (Chatterbox's EXAGGERATION): sent to the models that take it (their config
# lists it), refused for the others
MODEL_TENSORS = {"exaggeration": "EXAGGERATION"}


class VoiceRef(BaseModel):
    """OpenAI's custom-voice form of `voice`: {"id": "..."}."""

    id: str


class SamplingFields(BaseModel):
    """How to sample: our extras on every endpoint (the speech body, the WebSocket's start, a chat request)."""

    model_config = ConfigDict(extra="forbid")

    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: Int32 | None = None
    seed: Int64 | None = None
    cfg_weight: float | None = None  # classifier-free guidance (Chatterbox); other models take only 0

    def sampling(self) -> dict[str, float | int]:
        return {tensor: getattr(self, field) for field, tensor in SAMPLING_TENSORS.items()
                if getattr(self, field) is not None}


class SynthesisOptions(SamplingFields):
    """Which model and voice, and how to sample: shared by the HTTP body and the WebSocket's start message."""

    model: str | None = None  # required over HTTP (OpenAI); the WebSocket defaults to the first served model
    voice: str | int | VoiceRef | None = None
    exaggeration: float | None = None  # a model input (MODEL_TENSORS)

    def model_inputs(self, model: SpeechModel) -> dict[str, float]:
        """The model's own inputs given (tensor -> value); one the model does not take is a 400 naming the field."""
        given = {field: getattr(self, field) for field in MODEL_TENSORS if getattr(self, field) is not None}
        for field in given:
            if MODEL_TENSORS[field] not in model.inputs:
                raise bad_request(f"model {model.name!r} takes no {field}", field, "unsupported_value")
        return {MODEL_TENSORS[field]: value for field, value in given.items()}

    def resolve(self, models: dict[str, SpeechModel]) -> tuple[SpeechModel, str | int | None]:
        """The served model and the value for its voice input (a name, a speaker id, or None: the model's default
        voice, which may have no name: Chatterbox's built-in one). Fields the model does not take fail here."""
        if self.model is None:
            if not models:
                raise unknown_model("(default)", [])
            model = models[sorted(models)[0]]
        elif self.model not in models:
            raise unknown_model(self.model, sorted(models))
        else:
            model = models[self.model]
        self.model_inputs(model)
        voice = self.voice.id if isinstance(self.voice, VoiceRef) else self.voice
        if voice is None or voice == "":
            return model, None
        if model.voice_input is None:
            raise bad_request(f"model {model.name!r} takes no voice", "voice")
        if model.voice_input == "SPEAKER":
            if isinstance(voice, str) and not voice.strip().isdigit():
                raise bad_request(f"model {model.name!r} takes a speaker id (an integer) as voice, got {voice!r}",
                                  "voice")
            return model, int(voice)
        return model, str(voice)


class SpeechRequest(SynthesisOptions):
    """POST /v1/audio/speech."""

    model: str
    input: str
    response_format: Literal[RESPONSE_FORMATS] = "wav"  # type: ignore[valid-type]
    speed: float = 1.0
    instructions: str | None = None
    stream_format: Literal["audio", "sse"] | None = None

    def check_unsupported(self) -> None:
        if self.speed != 1.0:
            raise bad_request(f"speed {self.speed} is not supported: the models speak at their own pace (1.0 only)",
                              "speed", "unsupported_value")
        if self.instructions:
            raise bad_request("instructions are not supported by these models", "instructions", "unsupported_value")
        if self.stream_format == "sse":
            raise bad_request("stream_format 'sse' is not supported; audio streams as raw bytes ('audio')",
                              "stream_format", "unsupported_value")


def validation_error(e: ValidationError | list[dict], nested: bool = False) -> ApiError:
    """pydantic's (or FastAPI's) first error -> a 400 naming the field: its top-level name, or with `nested` its
    path as OpenAI writes it (`audio.format`, `messages[2].role`): for models without unions only, as pydantic puts
    a union member's type name into the path."""
    errors = e.errors() if isinstance(e, ValidationError) else e
    first = errors[0]
    loc = [p for p in first.get("loc", ()) if p != "body"]
    if nested:
        param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
    else:
        param = str(loc[0]) if loc else None
    if first.get("type") == "extra_forbidden":
        return bad_request(f"unknown field {param!r}", param, "unknown_parameter")
    if first.get("type") == "missing":
        return bad_request(f"{param} is required", param, "missing_required_parameter")
    return bad_request(f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid body"),
                       param)
