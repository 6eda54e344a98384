"""Every model kind in one table: how its config.json is recognised, its classes, where its codec is, and its tiny
checkpoint. Adding a model is its model file (+ a codec file if new) and one entry here; the engine, the Triton
glue, the repository generator and the CLI read this table and name no model."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from voxbackend.models import token_lm
from voxbackend.models.base import SpeechModel
from voxbackend.models.checkpoint import read_config
from voxbackend.models.chatterbox import model as chatterbox
from voxbackend.models.chatterbox import turbo as chatterbox_turbo
from voxbackend.models.cosyvoice2 import model as cosyvoice2
from voxbackend.models.glm4_voice import model as glm4_voice
from voxbackend.models.csm import model as csm
from voxbackend.models.orpheus import model as orpheus
from voxbackend.models.qwen3_tts import frontend as qwen3_tts_frontend
from voxbackend.models.qwen3_tts import model as qwen3_tts_model
from voxbackend.models.step_audio2 import model as step_audio2
from voxbackend.tensor_spec import TensorSpec

if TYPE_CHECKING:
    import torch


def codec_as_given(model_dir: Path, codec_dir: str | Path | None) -> Path | None:
    """A model whose codec weights sit inside its checkpoint (or that has none): codec_dir only overrides."""
    return Path(codec_dir) if codec_dir else None


@dataclass(frozen=True)
class ModelKind:
    name: str
    detect: Callable[[dict], bool]  # config.json -> whether a checkpoint is of this kind
    model: type[SpeechModel]  # model(model_dir, codec_dir, device, dtype)
    # frontend(model_dir, codec_dir): prepare/default_sampling/spec without LM weights, so several CPU preprocess
    # instances never hold copies of a 1B-3B model; None: the model itself, on CPU
    frontend: type[SpeechModel] | None = None
    codec: Callable[[Path, str | Path | None], Path | None] = codec_as_given  # the codec folder the classes get
    tiny_checkpoint: str = ""  # "module:function(root=None) -> (model_dir, codec_dir)", built once and reused
    served: str = ""  # description of its Triton ensemble; empty: not served through Triton
    # a checkpoint folder without a Hugging Face config.json at its top (CosyVoice2's official layout): whether
    # the folder is of this kind; tried before config.json is read
    detect_folder: Callable[[Path], bool] | None = None

    @property
    def request_inputs(self) -> tuple[TensorSpec, ...]:
        return (self.frontend or self.model).request_inputs

    @property
    def conditioning(self) -> tuple[TensorSpec, ...]:
        return (self.frontend or self.model).conditioning


# Detection tries the kinds in this order; token_lm (any plain Llama / Qwen2 / Qwen3 causal LM) comes last.
KINDS: dict[str, ModelKind] = {k.name: k for k in (
    ModelKind(
        name="orpheus", detect=orpheus.is_orpheus_config, model=orpheus.Orpheus, frontend=orpheus.OrpheusFrontend,
        codec=orpheus.find_codec, tiny_checkpoint="voxbackend.models.orpheus.tiny:ensure_default_checkpoint",
        served="Orpheus TTS (Llama backbone, SNAC 24 kHz codec)",
    ),
    ModelKind(
        # frontend: loads only the Mimi encoder, and only for context audio; no codec_dir: Mimi inside the checkpoint
        name="csm", detect=csm.is_csm_config, model=csm.Csm, frontend=csm.CsmFrontend,
        tiny_checkpoint="voxbackend.models.csm.tiny:ensure_default_csm",
        served="CSM-1B (Llama backbone + depth decoder, Mimi 24 kHz codec)",
    ),
    ModelKind(
        # frontend: tokenizer, prompt rows and the text track; the codec is the checkpoint's speech_tokenizer/
        name="qwen3_tts", detect=qwen3_tts_frontend.is_qwen3_tts_config, model=qwen3_tts_model.Qwen3TTS,
        frontend=qwen3_tts_frontend.Qwen3TTSFrontend, codec=qwen3_tts_frontend.find_speech_tokenizer,
        tiny_checkpoint="voxbackend.models.qwen3_tts.tiny:ensure_default_qwen3_tts",
        served="Qwen3-TTS-12Hz (Qwen3 talker + code predictor, 12 Hz codec at 24 kHz)",
    ),
    ModelKind(
        # frontend: tokenizer, voices and (on the first clip) the cloning networks; codec: flow + HiFT in the folder
        name="cosyvoice2", detect=lambda hf: False, detect_folder=cosyvoice2.is_cosyvoice2_folder,
        model=cosyvoice2.CosyVoice2, frontend=cosyvoice2.CosyVoice2Frontend,
        tiny_checkpoint="voxbackend.models.cosyvoice2.tiny:ensure_default_cosyvoice2",
        served="CosyVoice2-0.5B (Qwen2 LM, flow matching + HiFT 24 kHz, zero-shot voice cloning)",
    ),
    ModelKind(
        # frontend: tokenizer, voices and (on the first clip) the voice encoder, S3 tokenizer and CAMPPlus
        name="chatterbox", detect=lambda hf: False, detect_folder=chatterbox.is_chatterbox_folder,
        model=chatterbox.Chatterbox, frontend=chatterbox.ChatterboxFrontend,
        tiny_checkpoint="voxbackend.models.chatterbox.tiny:ensure_default_chatterbox",
        served="Chatterbox (Llama T3 LM with classifier-free guidance, S3Gen flow matching + HiFT 24 kHz, voice "
               "cloning)",
    ),
    ModelKind(
        # frontend: GPT-2 tokenizer, voices and (on the first clip) the voice encoder, S3 tokenizer and CAMPPlus
        name="chatterbox_turbo", detect=lambda hf: False, detect_folder=chatterbox_turbo.is_chatterbox_turbo_folder,
        model=chatterbox_turbo.ChatterboxTurbo, frontend=chatterbox_turbo.ChatterboxTurboFrontend,
        tiny_checkpoint="voxbackend.models.chatterbox.tiny_turbo:ensure_default_chatterbox_turbo",
        served="Chatterbox-Turbo (GPT-2 medium T3 LM, S3Gen meanflow + HiFT 24 kHz, voice cloning)",
    ),
    ModelKind(
        # frontend: chat template, voices and spectrograms; the audio encoder runs in the engine (engine_features)
        name="step_audio2", detect=step_audio2.is_step_audio2_config, model=step_audio2.StepAudio2,
        frontend=step_audio2.StepAudio2Frontend,
        tiny_checkpoint="voxbackend.models.step_audio2.tiny:ensure_default_step_audio2",
        served="Step-Audio 2 mini (Whisper-style audio encoder, Qwen2.5 LM answering in text and speech, DiT flow + "
               "HiFT 24 kHz)",
    ),
    ModelKind(
        # frontend: chat template and clips; the speech tokenizer runs in the engine (engine_features); codec: the
        # glm-4-voice-decoder folder inside the checkpoint (codec_dir overrides); before token_lm, which would take
        # its chatglm LM for a plain one
        name="glm4_voice", detect=lambda hf: False, detect_folder=glm4_voice.is_glm4_voice_folder,
        model=glm4_voice.GLM4Voice, frontend=glm4_voice.GLM4VoiceFrontend,
        tiny_checkpoint="voxbackend.models.glm4_voice.tiny:ensure_default_glm4_voice",
        served="GLM-4-Voice-9B (Whisper-VQ speech tokenizer, GLM-4 LM answering in text and speech, CosyVoice flow + "
               "HiFT 22.05 kHz)",
    ),
    ModelKind(name="token_lm", detect=token_lm.is_token_lm_config, model=token_lm.TokenLM),
)}


def get_kind(name: str) -> ModelKind:
    if name not in KINDS:
        raise ValueError(f"unknown model kind {name!r} (known: {', '.join(KINDS)})")
    return KINDS[name]


def detect_kind(model_dir: str | Path) -> ModelKind:
    for kind in KINDS.values():
        if kind.detect_folder is not None and kind.detect_folder(Path(model_dir)):
            return kind
    hf = read_config(model_dir)
    for kind in KINDS.values():
        if kind.detect(hf):
            return kind
    raise ValueError(f"unsupported architecture {hf.get('architectures')} (model_type {hf.get('model_type')!r}) "
                     f"in {model_dir}; known kinds: {', '.join(KINDS)}")


def load_frontend(model_dir: str | Path, codec_dir: str | Path | None = None) -> SpeechModel:
    """What preprocessing needs (prepare, default_sampling, voices, spec): without LM weights where the model
    allows."""
    model_dir = Path(model_dir)
    kind = detect_kind(model_dir)
    if kind.frontend is None:
        import torch

        return load_model(model_dir, codec_dir, "cpu", torch.float32, kind.name)
    return kind.frontend(model_dir, kind.codec(model_dir, codec_dir))


def load_model(
    model_dir: str | Path, codec_dir: str | Path | None, device: str, dtype: "torch.dtype", kind: str | None = None,
    lm: bool = True,
) -> SpeechModel:
    """`kind` forces a registry entry; by default config.json decides. `lm=False`: the codec and what its windows
    need, without the LM's weights (a codec stage's copy, whose only job is detokenize)."""
    model_dir = Path(model_dir)
    entry = get_kind(kind) if kind is not None else detect_kind(model_dir)
    if not lm:
        return entry.model(model_dir, entry.codec(model_dir, codec_dir), device, dtype, lm=False)
    return entry.model(model_dir, entry.codec(model_dir, codec_dir), device, dtype)
