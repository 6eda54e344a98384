"""voxbackend: a streaming engine for speech language models, served through NVIDIA Triton."""
from __future__ import annotations

from pathlib import Path

from voxbackend.config import EngineConfig
from voxbackend.errors import EngineDead, EngineOverloaded, InvalidRequest
from voxbackend.events import Event, EventKind
from voxbackend.sampling_params import SamplingParams


def load(model_dir: str | Path, codec_dir: str | Path | None = None, model: str | None = None, **engine_options):
    """Load a checkpoint folder (config.json + safetensors + tokenizer.json) and build an engine (not started).

    `model` forces the model kind (a voxbackend.models.registry.KINDS name: "orpheus", "csm", "qwen3_tts",
    "cosyvoice2", "chatterbox", "chatterbox_turbo", "step_audio2", "token_lm"); by default config.json decides.
    Other keyword arguments are EngineConfig fields.
    """
    from voxbackend.engine.engine import Engine
    from voxbackend.models.registry import load_model

    config = EngineConfig.from_options(engine_options)
    speech_model = load_model(model_dir, codec_dir, config.device, config.torch_dtype, kind=model)
    return Engine(speech_model, config)


__all__ = ["load", "EngineConfig", "SamplingParams", "Event", "EventKind", "InvalidRequest", "EngineOverloaded",
           "EngineDead"]
