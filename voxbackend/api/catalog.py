"""What the Triton server serves, read from it: its repository index and each model's config (gRPC).

A speech model, for this API, is a ready front model (voxbackend.triton.front_model) that takes TEXT and
returns AUDIO; its `engine_model` parameter names the model whose engine serves it (the front model itself; its
Prometheus gauges carry that model name),
its `preprocess_model` the preprocess, whose config parameters say where the model's front end lives. Voices live in
the front end (the model class decides
them), so they are asked of it in one short-lived child interpreter (frontend_info): this process never loads
a tokenizer, torch or weights.

A conversation model (a spoken-dialogue model such as Step-Audio 2, /v1/chat/completions) is a speech model that
also answers in text: its config lists a TEXT_OUT output. Its other inputs (INPUT_AUDIO, SYSTEM_PROMPT, HISTORY_*,
SPEAK) say which parts of a chat request it can take. Nothing here goes by a model's name.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field

from voxbackend.api.errors import unavailable

VOICE_INPUTS = ("VOICE", "SPEAKER")  # named voices, or integer speaker ids (CSM)


@dataclass
class SpeechModel:
    name: str  # the front model clients call
    engine: str  # the engine model it calls
    preprocess: str | None
    inputs: tuple[str, ...]
    outputs: tuple[str, ...] = ("AUDIO",)
    parameters: dict[str, str] = field(default_factory=dict)  # the preprocess step's (front end location)
    voices: tuple[str, ...] = ()  # named voices; a request without one gets the model's default (maybe unnamed)
    sample_rate: int | None = None
    guidance: bool = False  # takes a non-zero cfg_weight (classifier-free guidance)
    info_error: str | None = None  # why the front end could not be asked

    @property
    def voice_input(self) -> str | None:
        return next((name for name in VOICE_INPUTS if name in self.inputs), None)

    @property
    def conversation(self) -> bool:
        """Answers in text too (TEXT_OUT): a chat model, served by /v1/chat/completions."""
        return "TEXT_OUT" in self.outputs

    def describe(self) -> dict:
        return {"id": self.name, "object": "model", "created": 0, "owned_by": "voxbackend", "engine": self.engine,
                "voices": list(self.voices), "voice_kind": {"VOICE": "name", "SPEAKER": "speaker_id"}.get(
                    self.voice_input), "sample_rate": self.sample_rate, "guidance": self.guidance,
                "inputs": list(self.inputs), "conversation": self.conversation,
                **({"info_error": self.info_error} if self.info_error else {})}


def _names(tensors: list[dict]) -> tuple[str, ...]:
    return tuple(t["name"] for t in tensors)


def _parameters(config: dict) -> dict[str, str]:
    return {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}


def read_models(url: str, timeout: float = 10.0) -> list[SpeechModel]:
    """The ready speech models of the server at `url` (blocking)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    try:
        index = client.get_model_repository_index(as_json=True, client_timeout=timeout).get("models", [])
        ready = sorted({m["name"] for m in index if m.get("state") == "READY"})
        configs = {name: client.get_model_config(name, as_json=True, client_timeout=timeout)["config"]
                   for name in ready}
    finally:
        client.close()
    models = []
    for name, cfg in configs.items():
        inputs, outputs = _names(cfg.get("input", [])), _names(cfg.get("output", []))
        parts = _parameters(cfg)
        engine, preprocess = parts.get("engine_model"), parts.get("preprocess_model") or None
        if engine not in configs or "TEXT" not in inputs or "AUDIO" not in outputs:
            continue
        models.append(SpeechModel(name, engine, preprocess, inputs, outputs,
                                  _parameters(configs.get(preprocess, {})) if preprocess else {}))
    return models


def ask_frontends(parameters: dict[str, dict[str, str]], timeout: float = 600.0) -> dict[str, dict]:
    """Model name -> {"voices", "sample_rate", "guidance"} (or {"error"}), from each front end, in a child
    interpreter."""
    done = subprocess.run([sys.executable, "-m", "voxbackend.api.frontend_info"], input=json.dumps(parameters),
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        message = f"front end query failed (exit {done.returncode}): {done.stderr[-1000:]}"
        return {name: {"error": message} for name in parameters}
    return json.loads(done.stdout.strip().splitlines()[-1])


class Catalog:
    """The served models, re-read from Triton at most every `ttl_s`; front end answers kept per model config."""

    def __init__(self, url: str, ttl_s: float = 5.0):
        self.url = url
        self.ttl_s = ttl_s
        self._models: dict[str, SpeechModel] = {}
        self._read_at = -float("inf")
        self._info: dict[str, dict] = {}  # key: model name + its preprocess parameters
        self._lock = asyncio.Lock()
        self._background: asyncio.Task | None = None  # the running re-read (a reference keeps it alive)
        self._info_lock = asyncio.Lock()

    async def models(self) -> dict[str, SpeechModel]:
        """Name -> model (without waiting for voices); ApiError 503 when Triton does not answer.

        Once read, a stale list is answered at once and re-read in the background: no request waits for it."""
        if not self._models:
            await self._refresh()
        elif time.monotonic() - self._read_at > self.ttl_s and not self._lock.locked():
            self._background = asyncio.create_task(self._refresh(quiet=True))
        return dict(self._models)

    async def _refresh(self, quiet: bool = False) -> None:
        async with self._lock:
            if self._models and time.monotonic() - self._read_at <= self.ttl_s:
                return  # another caller just read it
            try:
                found = await asyncio.to_thread(read_models, self.url)
            except Exception as e:  # tritonclient's InferenceServerException: down or not reachable
                if quiet:  # keep the last list; the request itself will find Triton down
                    return
                raise unavailable(f"the inference server at {self.url} does not answer: {e}") from None
            self._models = {m.name: m for m in found}
            self._read_at = time.monotonic()
            for m in found:
                self._apply(m)

    async def models_with_voices(self) -> dict[str, SpeechModel]:
        models = await self.models()
        missing = {m.name: m.parameters for m in models.values() if self._key(m) not in self._info and m.parameters}
        if missing:
            async with self._info_lock:
                missing = {n: p for n, p in missing.items() if self._key(models[n]) not in self._info}
                if missing:
                    answers = await asyncio.to_thread(ask_frontends, missing)
                    for name, answer in answers.items():
                        self._info[self._key(models[name])] = answer
        for m in models.values():
            self._apply(m)
        return models

    @staticmethod
    def _key(m: SpeechModel) -> str:
        return m.name + json.dumps(m.parameters, sort_keys=True)

    def _apply(self, m: SpeechModel) -> None:
        info = self._info.get(self._key(m))
        if info:
            m.voices = tuple(info.get("voices", ()))
            m.sample_rate = info.get("sample_rate")
            m.guidance = bool(info.get("guidance", False))
            m.info_error = info.get("error")
