"""Render the model repository (every config.pbtxt and 1/model.py) from one source: the model registry.

Each registry kind with a `served` description is served as three models: `<name>`, the decoupled front model
clients call, which hosts its own engine and sends encoded audio; `<name>_engine`, the engine with float audio out
for direct callers; `<name>_preprocess`, text and voice to prompt ids. Request inputs are the ones the model class
declares.
A kind whose model takes text in pieces (`text_streaming`) also gets `<name>_text_stream`, a sequence-batched
engine model (docs/text_streaming.md). Adding a model is its registry entry; nothing here changes.

    python -m voxbackend.deploy.configs            # rewrite model_repository/ (configs and model.py files)
    python -m voxbackend.deploy.configs --check    # exit 1 if a committed file differs or a folder is stray
"""
from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from voxbackend.models import registry
from voxbackend.triton import schema
from voxbackend.triton.schema import TensorSpec

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_REPOSITORY = REPO_ROOT / "model_repository"

# Engine parameters every model shares; values are strings as config.pbtxt stores them.
# Empty checkpoint: the engine model builds or reuses the tiny default checkpoint (default_checkpoint).
ENGINE_PARAMS = {
    "checkpoint": "",  # Hugging Face layout folder of the SpeechLM
    "codec": "",  # codec folder; empty: the model's own default place
    "device": "auto",  # auto = cuda (the instance's GPU) when available, else cpu
    "dtype": "float32",
    "policy": "online",  # online (streaming-aware) | fcfs | offline | voxserve (VoxServe's rules, for ablation)
    "max_batch": "32",
    "kv_pages": "1024",
    "page_size": "16",
    "prefill_budget": "512",
    "max_queue": "256",  # requests waiting beyond this get an "overloaded" error
    "detok_batch": "16",  # codec windows per detokenizer call
    "first_chunk_s": "0",  # hold each stream's first audio until it is this long (seconds)
    "playback_margin_s": "1.0",  # online policy: buffer below last chunk + this margin = pressing
    "detok_margin_s": "0.15",  # online policy: a stream's windows are decoded once its buffer is below this
    "detok_pace_floor": "auto",  # online policy: near the limit (streams made below this x real time) act as offline
    "attention": "auto",  # auto | torch | flashinfer
    "cuda_graphs": "auto",  # decode steps as CUDA graphs: auto (on CUDA with FlashInfer) | graphs | padded | off
    "overlap_codec": "auto",  # codec windows on their own CUDA stream beside the LM step: auto (on CUDA) | on | off
    "drain_grace_s": "15",  # on SIGTERM, open streams may run this long (docs/triton.md, "Stopping")
    "max_tokens_limit": "0",  # largest max_tokens a request may ask; 0 = the model's official maximum
    "engine_loader": "voxbackend:load",  # module:function(model_dir, codec_dir=..., **options) -> engine
    "frontend_loader": "voxbackend.triton.loading:default_frontend",  # module:function(model_dir, codec_dir) -> model
}


# A text stream silent this long (no piece, no END) loses its sequence slot and is cancelled, its pages freed.
TEXT_STREAM_IDLE_US = 10_000_000
TEXT_STREAM_CONTROLS = (  # Triton's sequence controls, as the inputs text_stream_model.py reads
    ("START", "CONTROL_SEQUENCE_START"), ("END", "CONTROL_SEQUENCE_END"), ("READY", "CONTROL_SEQUENCE_READY"))


@dataclass(frozen=True)
class ServedModel:
    name: str  # the front model's name = registry kind; engine and preprocess models are named after it
    description: str
    default_checkpoint: str  # module:function() -> (model_dir, codec_dir), used when checkpoint is empty
    # one: the front model prepares its own requests, so this serves only clients that chain it to the engine
    # themselves; each instance is a Python process with its own copy of the front end (raise it for such load)
    preprocess_instances: int = 1
    text_streaming: bool = False  # the model takes text in pieces: serve <name>_text_stream too

    @property
    def input_specs(self) -> tuple[TensorSpec, ...]:
        """The model's own request inputs beyond TEXT and sampling, as its class declares them."""
        return registry.get_kind(self.name).request_inputs

    @property
    def conditioning(self) -> tuple[TensorSpec, ...]:
        """Arrays its preprocess hands its engine beside the prompt ids, as its class declares them."""
        return registry.get_kind(self.name).conditioning

    @property
    def text_required(self) -> bool:
        """False: the model may take its turn as audio instead of TEXT (a spoken-dialogue model)."""
        return registry.get_kind(self.name).model.text_required

    @property
    def text_output(self) -> bool:
        """The model answers in text and speech: its engine and front model send TEXT_OUT too."""
        return bool(getattr(registry.get_kind(self.name).model, "text_output", False))

    @property
    def engine(self) -> str:
        return f"{self.name}_engine"

    @property
    def preprocess(self) -> str:
        return f"{self.name}_preprocess"

    @property
    def text_stream(self) -> str:
        return f"{self.name}_text_stream"

    @property
    def codec_stage(self) -> str:
        return codec_stage_name(self.name)

    def params(self, overrides: dict[str, str] | None = None) -> dict[str, str]:
        """Parameters with overrides: `key` applies to every model, `<model name>.key` to this one only."""
        merged = {**ENGINE_PARAMS, **PLACEMENT, **CODEC_PLACEMENT, "default_checkpoint": self.default_checkpoint,
                  "model_kind": self.name}
        for key, value in (overrides or {}).items():
            model, _, name = key.rpartition(".")
            if model and model != self.name:
                continue
            if name not in merged:
                raise ValueError(f"unknown engine parameter {name!r}; known: {sorted(merged)}")
            merged[name] = str(value)
        return merged


# Where the models that host an engine (the front model, <model>_engine, <model>_text_stream) run: `instances`
# engines per model, each its own process with its own KV pool, and with `gpus` (e.g. "0,1") that many on each
# listed GPU (KIND_GPU); without, on the CPU kind, where device=auto takes the first GPU if there is one. Triton
# spreads requests over the instances; its sequence batcher keeps each text sequence on one. Not config.pbtxt
# parameters: they become its instance_group.
PLACEMENT = {"instances": "1", "gpus": ""}
# The codec as its own model, `<model>_codec` (codec_model.py), with `codec_instances` instances (0: none, each
# engine runs its own codec, the default), on the GPUs of `codec_gpus` when given. Every engine of the model then
# sends its windows there.
CODEC_PLACEMENT = {"codec_instances": "0", "codec_gpus": ""}
CODEC_STAGE_PARAMS = ("checkpoint", "codec", "default_checkpoint", "model_kind", "device", "dtype", "detok_batch",
                      "drain_grace_s")


def instance_group(count: int, gpus: str = "") -> str:
    """The instance_group line: `count` instances on the CPU kind, or on each GPU of `gpus` ("0,1")."""
    if count < 1:
        raise ValueError(f"instances must be at least 1, got {count}")
    gpus = [int(g) for g in gpus.split(",") if g.strip()]
    where = f"kind: KIND_GPU gpus: [ {', '.join(map(str, gpus))} ]" if gpus else "kind: KIND_CPU"
    return f"instance_group [ {{ count: {count} {where} }} ]\n"


def engine_placement(params: dict[str, str]) -> str:
    """The instance_group of a model that hosts an engine, from its PLACEMENT parameters."""
    return instance_group(int(params["instances"]), params["gpus"])


def engine_parameters(params: dict[str, str]) -> dict[str, str]:
    """What an engine-hosting model's config.pbtxt lists as parameters: all but the front end's loader and the
    placement; with a codec stage, its model's name."""
    listed = {k: v for k, v in params.items()
              if k != "frontend_loader" and k not in PLACEMENT and k not in CODEC_PLACEMENT}
    if codec_instances(params):
        listed["codec_model"] = codec_stage_name(params["model_kind"])
    return listed


def codec_stage_name(model: str) -> str:
    return f"{model}_codec"


def codec_instances(params: dict[str, str]) -> int:
    count = int(params["codec_instances"])
    if count < 0:
        raise ValueError(f"codec_instances must be 0 (no codec stage) or more, got {count}")
    return count


def render_codec_stage(m: ServedModel, params: dict[str, str]) -> str:
    """`<model>_codec`: takes no requests (the engines send it windows over its socket); Triton places and loads
    it."""
    return _python_model(
        m.codec_stage, f"{m.description}: its codec as a stage of its own; the engines of this server send it their "
        "windows.", (), (), instances=instance_group(codec_instances(params), params["codec_gpus"]),
        params={k: params[k] for k in CODEC_STAGE_PARAMS})


SERVED_MODELS: tuple[ServedModel, ...] = tuple(
    ServedModel(kind.name, kind.served, kind.tiny_checkpoint,
                text_streaming=bool(getattr(kind.model, "text_streaming", False)))
    for kind in registry.KINDS.values() if kind.served
)

HEADER = "# Generated by `python -m voxbackend.deploy.configs` from voxbackend/deploy/configs.py; do not edit.\n"


def _tensor_block(kind: str, specs: tuple[TensorSpec, ...]) -> str:
    if not specs:
        return ""
    items = []
    for s in specs:
        lines = [f"  # {s.name}: {s.doc}" if s.doc else None, "  {", f'    name: "{s.name}"',
                 f"    data_type: TYPE_{s.dtype}", f"    dims: [ {', '.join(map(str, s.dims))} ]"]
        if s.optional:
            lines.append("    optional: true")
        lines.append("  }")
        items.append("\n".join(line for line in lines if line is not None))
    return f"{kind} [\n" + ",\n".join(items) + "\n]\n"


def _parameters(params: dict[str, str]) -> str:
    return "".join(
        f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in params.items()
    )


def _python_model(name: str, doc: str, inputs, outputs, *, instances: str, decoupled: bool = False,
                  params: dict[str, str] | None = None) -> str:
    """instances: the model's instance_group line."""
    text = HEADER + f"# {doc}\n" + f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
    if decoupled:
        text += "model_transaction_policy { decoupled: true }\n"
    text += _tensor_block("input", inputs) + _tensor_block("output", outputs) + instances
    return text + _parameters(params or {})


def render_text_stream(m: ServedModel, params: dict[str, str]) -> str:
    """The sequence-batched engine model: direct strategy, one slot per concurrent utterance (max_batch of them
    per instance, the engine's batch), each piece delivered at once (no queue delay)."""
    controls = [f'    {{ name: "{name}" control [ {{ kind: {kind} int32_false_true: [ 0, 1 ] }} ] }}'
                for name, kind in TEXT_STREAM_CONTROLS]
    controls.append('    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }')
    text = (HEADER + f"# {m.description}: text in pieces (one Triton sequence per utterance), its audio on the "
            "first piece's stream.\n" + f'name: "{m.text_stream}"\nbackend: "python"\n'
            f'max_batch_size: {int(params["max_batch"])}\nmodel_transaction_policy {{ decoupled: true }}\n'
            f"sequence_batching {{\n  max_sequence_idle_microseconds: {TEXT_STREAM_IDLE_US}\n"
            "  direct { max_queue_delay_microseconds: 0 }\n  control_input [\n" + ",\n".join(controls) + "\n  ]\n}\n")
    text += _tensor_block("input", schema.client_inputs(m.input_specs, m.text_required))
    text += _tensor_block("output", schema.CLIENT_OUTPUTS)
    text += engine_placement(params)
    return text + _parameters(engine_parameters(params))


def render_front(m: ServedModel, params: dict[str, str]) -> str:
    """The model clients call: a decoupled Python model hosting its own engine, which prepares prompts in-process
    and sends encoded audio (front_model.py says why not an ensemble, nor BLS). `engine_model` names the model
    whose engine gauges its streams show in (itself), `preprocess_model` where its front end's settings live."""
    return _python_model(
        m.name, f"{m.description}: " + ("a turn (text and/or audio) in, the reply's text and encoded audio chunks "
                                        "out" if m.text_output else "text in, a stream of encoded audio chunks out")
        + " (its own engine).",
        schema.client_inputs(m.input_specs, m.text_required), schema.client_outputs(m.text_output),
        instances=engine_placement(params), decoupled=True,
        params={**engine_parameters(params), "preprocess_model": m.preprocess, "engine_model": m.name})


def select(models: list[str] | None = None) -> tuple[ServedModel, ...]:
    """The served models by name (all when None)."""
    if models is None:
        return SERVED_MODELS
    known = {m.name: m for m in SERVED_MODELS}
    unknown = [name for name in models if name not in known]
    if unknown:
        raise ValueError(f"unknown served model(s) {unknown}; known: {sorted(known)}")
    return tuple(known[name] for name in models)


def render_all(overrides: dict[str, str] | None = None, models: list[str] | None = None) -> dict[str, str]:
    """Model folder name -> config.pbtxt text, for the served models (default all) plus the shared postprocess.

    A checkpoint or codec belongs to one model: with several models, give it as `<model name>.checkpoint`.
    """
    served = select(models)
    for key in overrides or {}:
        model, _, name = key.rpartition(".")
        if model and model not in {m.name for m in SERVED_MODELS}:
            raise ValueError(f"override {key!r} names no served model; known: {[m.name for m in SERVED_MODELS]}")
        if not model and name in ("checkpoint", "codec") and len(served) > 1:
            raise ValueError(f"{name} is one model's, and {len(served)} models are rendered "
                             f"({', '.join(m.name for m in served)}): say <model>.{name}, or render only that model")
    configs = {}
    for m in served:
        params = m.params(overrides)
        if codec_instances(params) and not registry.get_kind(m.name).model.codec_stage:
            raise ValueError(f"{m.name} cannot have a codec stage (codec_instances): its codec state does not go "
                             "over the codec wire")
        configs[m.preprocess] = _python_model(
            m.preprocess, f"{m.description}: text, {', '.join(s.name for s in m.input_specs)}, sampling -> "
            "validated prompt ids and sampling fields.",
            schema.client_inputs(m.input_specs, m.text_required), schema.preprocess_outputs(m.conditioning),
            instances=instance_group(m.preprocess_instances),
            params={k: params[k] for k in ("checkpoint", "codec", "default_checkpoint", "frontend_loader",
                                           "model_kind")})
        configs[m.engine] = _python_model(
            m.engine, f"{m.description}: the engine, one per instance; streams float audio chunks.",
            schema.engine_inputs(m.input_specs, m.conditioning), schema.engine_outputs(m.text_output),
            instances=engine_placement(params), decoupled=True, params=engine_parameters(params))
        configs[m.name] = render_front(m, params)
        if m.text_streaming:
            configs[m.text_stream] = render_text_stream(m, params)
        if codec_instances(params):
            configs[m.codec_stage] = render_codec_stage(m, params)
    return configs


_SHIM = '"""{doc}"""\nfrom voxbackend.triton.{module} import {cls} as TritonPythonModel  # noqa: F401\n'
VERSION = "1"


def render_files(models: list[str] | None = None, overrides: dict[str, str] | None = None) -> dict[str, str]:
    """Each version folder's files (path under the repository -> text): every Python model's three-line
    1/model.py."""
    files = {}
    for m in select(models):
        if codec_instances(m.params(overrides)):
            files[f"{m.codec_stage}/{VERSION}/model.py"] = _SHIM.format(
                doc=f"{m.codec_stage}: {m.name}'s codec, decoding the windows of its engines.",
                module="codec_model", cls="CodecModel")
        files[f"{m.preprocess}/{VERSION}/model.py"] = _SHIM.format(
            doc=f"{m.preprocess}: TEXT, {m.name}'s own inputs, sampling fields -> prompt ids, validated sampling.",
            module="preprocess_model", cls="PreprocessModel")
        files[f"{m.engine}/{VERSION}/model.py"] = _SHIM.format(
            doc=f"{m.engine}: one voxbackend engine per instance (settings: config.pbtxt parameters).",
            module="engine_model", cls="EngineModel")
        files[f"{m.name}/{VERSION}/model.py"] = _SHIM.format(
            doc=f"{m.name}: what clients call; hosts its own engine and sends encoded audio.",
            module="front_model", cls="FrontModel")
        if m.text_streaming:
            files.update(text_stream_files(m))
    return files


def text_stream_files(m: ServedModel) -> dict[str, str]:
    return {f"{m.text_stream}/{VERSION}/model.py": _SHIM.format(
        doc=f"{m.text_stream}: {m.name}'s text in pieces (a Triton sequence), its audio on one stream.",
        module="text_stream_model", cls="TextStreamModel")}


def write_repository(dest: Path, overrides: dict[str, str] | None = None, source: Path | None = None,
                     models: list[str] | None = None) -> Path:
    """Write the configs and version folders into dest. `source`: a repository whose version folders are
    copied over the generated ones (a user's own files next to model.py)."""
    dest = Path(dest)
    for name, text in render_all(overrides, models).items():
        (dest / name).mkdir(parents=True, exist_ok=True)
        (dest / name / "config.pbtxt").write_text(text)
    for path, text in render_files(models, overrides).items():
        (dest / path).parent.mkdir(parents=True, exist_ok=True)
        (dest / path).write_text(text)
    if source is not None and Path(source).resolve() != dest.resolve():
        for name in render_all(overrides, models):
            if (Path(source) / name / VERSION).is_dir():
                shutil.copytree(Path(source) / name / VERSION, dest / name / VERSION, dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def stale_configs(repository: Path = DEFAULT_REPOSITORY) -> list[str]:
    """Model folders whose committed config.pbtxt or version files differ from the rendered ones, and folders
    no served model renders (a model removed from the registry)."""
    repository = Path(repository)
    rendered = render_all()
    stale = [name for name, text in rendered.items()
             if not (repository / name / "config.pbtxt").is_file()
             or (repository / name / "config.pbtxt").read_text() != text]
    for path, text in render_files().items():
        name = path.split("/")[0]
        if name not in stale and (not (repository / path).is_file() or (repository / path).read_text() != text):
            stale.append(name)
    for folder in sorted(p for p in repository.iterdir() if p.is_dir()):
        if folder.name not in rendered:
            stale.append(folder.name)
    return stale


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY)
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 when a config is stale")
    args = ap.parse_args(argv)
    if args.check:
        stale = stale_configs(args.repository)
        print("stale: " + ", ".join(stale) if stale else "configs up to date")
        return 1 if stale else 0
    write_repository(args.repository)
    print(f"wrote {len(render_all())} model folders under {args.repository}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
