"""From config.pbtxt `parameters` to an engine (or just the model front end) for one model instance."""
from __future__ import annotations

import fcntl
import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable

from voxbackend.config import EngineConfig

# Parameters the glue itself consumes; every other non-empty one is an engine option. engine_model and
# preprocess_model are a front model's, for the API; codec_model names the codec stage the engine sends windows to.
GLUE_PARAMS = ("checkpoint", "codec", "codec_model", "default_checkpoint", "engine_loader", "frontend_loader",
               "model_kind", "drain_grace_s", "engine_model", "preprocess_model")
DEFAULT_DRAIN_GRACE_S = 15.0  # + a text sequence's idle timeout (10 s) + unloading < --exit-timeout-secs (30)


@dataclass
class InstanceSettings:
    checkpoint: str
    codec: str | None
    engine_loader: str
    engine_options: dict[str, str]


def model_parameters(model_config: dict | str) -> dict[str, str]:
    """config.pbtxt `parameters` as a plain dict of strings."""
    if isinstance(model_config, str):
        model_config = json.loads(model_config)
    return {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}


def resolve_device(device: str, instance_kind: str = "CPU", device_id: int = 0) -> str:
    """`auto`: the instance's GPU when Triton placed it on one, else cuda when present, else cpu."""
    if device != "auto":
        return device
    import torch

    if instance_kind == "GPU":
        return f"cuda:{device_id}"
    return "cuda" if torch.cuda.is_available() else "cpu"


def import_object(spec: str) -> Callable[..., Any]:
    """'package.module:function' -> the function."""
    module, _, name = spec.partition(":")
    if not name:
        raise ValueError(f"expected 'module:function', got {spec!r}")
    return getattr(importlib.import_module(module), name)


def resolve_checkpoint(params: dict[str, str], in_process: bool = False) -> tuple[str, str | None]:
    """The configured checkpoint, or the model's default one (built once; a lock serialises parallel loads).

    in_process: build or find it in this interpreter (not a Triton stub), without the lock: build_once locks the
    cache folder itself, and a short-lived process (the API's front end query) must not queue behind every stub
    of every server on the machine."""
    if params.get("checkpoint"):
        return params["checkpoint"], params.get("codec") or None
    if in_process:
        model_dir, codec_dir = import_object(params["default_checkpoint"])()
        return str(model_dir), params.get("codec") or (str(codec_dir) if codec_dir else None)
    # Triton loads instances and models in parallel; only one of them may build the default checkpoint.
    spec = params["default_checkpoint"]
    lock_path = Path(tempfile.gettempdir()) / f"voxbackend-default-checkpoint-{os.getuid()}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            found = built_before(spec)
            model_dir, codec_dir = found or call_in_child(spec)
            if found is None:
                remember_built(spec, model_dir, codec_dir)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return model_dir, params.get("codec") or codec_dir


def _built_record(spec: str) -> Path:
    """Where a default checkpoint's folders are noted once built, for this user and cache (VOXBACKEND_CACHE)."""
    key = hashlib.sha1(f"{spec}|{os.environ.get('VOXBACKEND_CACHE', '')}".encode()).hexdigest()[:20]
    return Path(tempfile.gettempdir()) / f"voxbackend-default-checkpoints-{os.getuid()}" / f"{key}.json"


def built_before(spec: str) -> tuple[str, str | None] | None:
    """The folders an earlier call_in_child(spec) returned, if they still exist: every stub of every server would
    otherwise start a child interpreter (about 1.8 s of a core, one at a time under the lock) to find them."""
    try:
        model_dir, codec_dir = json.loads(_built_record(spec).read_text())
    except (OSError, ValueError):
        return None
    if not Path(model_dir).is_dir() or (codec_dir and not Path(codec_dir).is_dir()):
        return None
    return model_dir, codec_dir


def remember_built(spec: str, model_dir: str, codec_dir: str | None) -> None:
    record = _built_record(spec)
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps([model_dir, codec_dir]))


def call_in_child(spec: str) -> tuple[str, str | None]:
    """Run 'module:function' -> (model_dir, codec_dir) in a child interpreter.

    Building a checkpoint needs transformers, which needs ssl; the Python embedded in the wheel's backend stub
    cannot load this machine's _ssl extension. A child `python3` (the venv's, first on PATH) can, and keeps
    those imports out of the serving process.
    """
    module, _, name = spec.partition(":")
    code = (f"import json\nfrom {module} import {name} as make\nm, c = make()\n"
            "print(json.dumps([str(m), str(c) if c else None]))")
    python = Path(sys.prefix) / "bin" / "python3"  # in the stub, sys.prefix is the venv (docs/triton.md)
    python = str(python) if python.is_file() else shutil.which("python3") or sys.executable
    done = subprocess.run([python, "-c", code], capture_output=True)  # bytes: the stub's locale may be ASCII
    stdout, stderr = (done.stdout.decode("utf-8", "replace"), done.stderr.decode("utf-8", "replace"))
    if done.returncode != 0:
        raise RuntimeError(f"{spec} failed (exit {done.returncode}):\n{stderr[-3000:]}")
    model_dir, codec_dir = json.loads(stdout.strip().splitlines()[-1])
    return model_dir, codec_dir


def instance_settings(params: dict[str, str], instance_kind: str = "CPU", device_id: int = 0) -> InstanceSettings:
    known = {f.name for f in fields(EngineConfig)}
    options = {k: v for k, v in params.items() if k not in GLUE_PARAMS and v != ""}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown engine parameters {unknown} in config.pbtxt; "
                         f"known: {sorted(known | set(GLUE_PARAMS))}")
    if "device" in options:
        options["device"] = resolve_device(options["device"], instance_kind, device_id)
    checkpoint, codec = resolve_checkpoint(params)
    return InstanceSettings(checkpoint, codec, params.get("engine_loader") or "voxbackend:load", options)


def default_frontend(model_dir: str, codec_dir: str | None = None):
    """The model object the preprocess needs (prepare, default_sampling, voices, spec), on CPU: the registry's
    weights-free front end where the model has one."""
    from voxbackend.models.registry import load_frontend

    return load_frontend(model_dir, codec_dir)


def request_inputs(params: dict[str, str]) -> tuple:
    """The model's own request inputs, declared by its class; `model_kind` names its registry entry."""
    from voxbackend.models.registry import get_kind

    if not params.get("model_kind"):
        raise ValueError("config.pbtxt has no model_kind parameter (a voxbackend.models.registry.KINDS name)")
    return get_kind(params["model_kind"]).request_inputs


def conditioning_specs(params: dict[str, str]) -> tuple:
    """The arrays the model's preprocess hands its engine beside the prompt ids (SpeechModel.conditioning)."""
    from voxbackend.models.registry import get_kind

    return get_kind(params["model_kind"]).conditioning if params.get("model_kind") else ()


def load_frontend(params: dict[str, str], in_process: bool = False):
    model_dir, codec_dir = resolve_checkpoint(params, in_process)
    loader = import_object(params.get("frontend_loader") or "voxbackend.triton.loading:default_frontend")
    return loader(model_dir, codec_dir)


def load_engine(settings: InstanceSettings):
    """Load (not start) the engine for one instance."""
    loader = import_object(settings.engine_loader)
    return loader(settings.checkpoint, codec_dir=settings.codec, **settings.engine_options)
