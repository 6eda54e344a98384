"""POST /v1/chat/completions' body: OpenAI's chat request for audio models, its fields checked, and what to ask the
conversation model for (its front model's TEXT, SPEAK, VOICE and sampling tensors; the messages are chat_turns.py's).

Every refusal names the field as a path into the body, as OpenAI's errors do: `audio.format`, `modalities`,
`max_completion_tokens`. The models hold no unions: pydantic would put the union's member names into the path.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from voxbackend.api.catalog import SpeechModel
from voxbackend.api.errors import TENSOR_PARAMS, bad_request, unknown_model
from voxbackend.api.requests import Int32, SAMPLING_TENSORS, SamplingFields

# audio.format -> the speech endpoint's encoder (audio_out.py); a streamed reply is pcm16 only
AUDIO_FORMATS = {"wav": "wav", "pcm16": "pcm", "flac": "flac", "mp3": "mp3", "opus": "opus"}
STREAM_FORMAT = "pcm16"
MODALITIES = ("text", "audio")
DEFAULT_VOICE = "default"  # always the model's own default voice, whatever its name


class ChatAudio(BaseModel):
    """`audio`: the spoken reply's voice and format."""

    model_config = ConfigDict(extra="forbid")

    voice: Any = None  # a name, or {"id": name}; checked in voice()
    format: str | None = None


class ChatRequest(SamplingFields):
    model: str
    messages: list[Any]  # OpenAI's message forms: read by chat_turns.conversation, each refusal naming its path
    modalities: list[str] | None = None
    audio: ChatAudio | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None  # accepted; usage is not counted (no tokenizer here)
    max_completion_tokens: Int32 | None = None  # OpenAI's newer name for max_tokens
    user: str | None = None  # accepted, unused
    # OpenAI fields these models cannot honour: accepted at their neutral value only (check_unsupported)
    n: int | None = None
    stop: Any = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    logprobs: bool | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None

    def check_unsupported(self) -> None:
        refused = {"n": self.n not in (None, 1), "stop": self.stop not in (None, "", []),
                   "tools": bool(self.tools), "tool_choice": self.tool_choice not in (None, "none"),
                   "logprobs": bool(self.logprobs), "frequency_penalty": self.frequency_penalty not in (None, 0),
                   "presence_penalty": self.presence_penalty not in (None, 0)}
        for name, bad in refused.items():
            if bad:
                raise bad_request(f"{name} is not supported by these models (one reply, no tools, no logprobs, no "
                                  "stop sequences, no frequency or presence penalty)", name, "unsupported_value")
        if self.max_tokens is not None and self.max_completion_tokens is not None and \
                self.max_tokens != self.max_completion_tokens:
            raise bad_request("give max_completion_tokens or max_tokens, not both", "max_completion_tokens")

    def resolve(self, models: dict[str, SpeechModel]) -> SpeechModel:
        """The served conversation model; a speech-only model is a 400 naming `model`."""
        if self.model not in models:
            raise unknown_model(self.model, sorted(models))
        model = models[self.model]
        if not model.conversation:
            talkers = sorted(m.name for m in models.values() if m.conversation)
            raise bad_request(f"model {self.model!r} is a text-to-speech model: it speaks text given to it "
                              f"(/v1/audio/speech) and does not converse; conversation models here: "
                              f"{', '.join(talkers) or 'none'}", "model", "model_not_supported")
        return model

    def speaks(self, model: SpeechModel) -> bool:
        """A spoken reply (modalities with "audio"; without modalities: when `audio` is given, OpenAI's pairing)."""
        modalities = self.modalities if self.modalities is not None else ["text", "audio"] if self.audio else ["text"]
        unknown = [m for m in modalities if m not in MODALITIES]
        if unknown or not modalities:
            raise bad_request(f"modalities must be [\"text\"] or [\"text\", \"audio\"], got {modalities}",
                              "modalities")
        if "audio" not in modalities and "SPEAK" not in model.inputs:
            raise bad_request(f"model {model.name!r} always speaks: it takes no text-only reply", "modalities",
                              "unsupported_value")
        return "audio" in modalities

    def audio_format(self) -> str:
        """audio.format: wav by default, pcm16 (only) when streamed."""
        given = self.audio.format if self.audio else None
        if given is None:
            return STREAM_FORMAT if self.stream else "wav"
        if given not in AUDIO_FORMATS:
            raise bad_request(f"audio.format {given!r} is not supported; choose one of {', '.join(AUDIO_FORMATS)}"
                              + (" (aac: no maintained offline encoder)" if given == "aac" else ""), "audio.format",
                              "unsupported_value")
        if self.stream and given != STREAM_FORMAT:
            raise bad_request(f"a streamed reply's audio is {STREAM_FORMAT} (base64 PCM16 pieces, as OpenAI streams "
                              f"audio), got audio.format {given!r}", "audio.format", "unsupported_value")
        return given

    def voice(self, model: SpeechModel) -> str | None:
        """The VOICE to send; None: the model's default ("default", or no audio.voice)."""
        voice = self.audio.voice if self.audio else None
        if isinstance(voice, dict) and set(voice) == {"id"}:
            voice = voice["id"]
        if voice is not None and not isinstance(voice, str):
            raise bad_request("audio.voice must be a voice name or {\"id\": name}", "audio.voice")
        if voice is None or voice in ("", DEFAULT_VOICE):
            return None
        if model.voice_input != "VOICE":
            raise bad_request(f"model {model.name!r} has no named voices; leave audio.voice out or give "
                              f"{DEFAULT_VOICE!r}", "audio.voice")
        if model.voices and voice not in model.voices:  # known once the front end was asked; else Triton checks
            names = [*model.voices, *([] if DEFAULT_VOICE in model.voices else [DEFAULT_VOICE])]
            raise bad_request(f"unknown voice {voice!r}; choose one of {', '.join(names)}", "audio.voice")
        return voice

    def sampling(self) -> dict[str, float | int]:
        tensors = super().sampling()
        if self.max_completion_tokens is not None:
            tensors["MAX_TOKENS"] = self.max_completion_tokens
        return tensors

    def params(self) -> dict[str, str]:
        """What Triton's errors name -> this request's fields (errors.from_triton), but for the messages'."""
        names = {t: f for t, f in TENSOR_PARAMS.items() if f in SAMPLING_TENSORS}
        if self.max_completion_tokens is not None:
            names["MAX_TOKENS"] = "max_completion_tokens"
        return {**names, "VOICE": "audio.voice", "voice": "audio.voice", "AUDIO_FORMAT": "audio.format",
                "SPEAK": "modalities"}
