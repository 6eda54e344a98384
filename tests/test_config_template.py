"""The committed model repository is exactly what the template renders, and the front model wires its parts by name."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from voxbackend.deploy import configs
from voxbackend.triton import schema


def test_committed_configs_equal_rendered():
    stale = configs.stale_configs(configs.DEFAULT_REPOSITORY)
    assert not stale, f"regenerate with `python -m voxbackend.deploy.configs`: {stale}"


def test_every_model_folder_has_a_config_and_model_file():
    rendered = configs.render_all()
    for name in rendered:
        folder = configs.DEFAULT_REPOSITORY / name
        assert (folder / "config.pbtxt").is_file()
        if 'platform: "ensemble"' not in rendered[name]:
            text = (folder / "1" / "model.py").read_text()
            assert "TritonPythonModel" in text and "voxbackend.triton" in text
            assert len(text.splitlines()) <= 5, "model.py files only import the glue"


def test_overrides_render_into_engine_parameters_only(tmp_path: Path):
    repo = configs.write_repository(tmp_path / "repo", {"checkpoint": "/ckpt/orpheus", "kv_pages": 4096},
                                    models=["orpheus"])
    engine = (repo / "orpheus_engine" / "config.pbtxt").read_text()
    assert 'key: "checkpoint" value: { string_value: "/ckpt/orpheus" }' in engine
    assert 'key: "kv_pages" value: { string_value: "4096" }' in engine
    pre = (repo / "orpheus_preprocess" / "config.pbtxt").read_text()
    assert 'string_value: "/ckpt/orpheus"' in pre and "kv_pages" not in pre
    assert (repo / "orpheus_engine" / "1" / "model.py").is_file()
    assert (repo / "orpheus" / "1").is_dir()


def test_replicas_place_every_engine_hosting_model_and_stay_out_of_the_parameters():
    one = configs.render_all(models=["qwen3_tts"])
    assert all("instance_group [ { count: 1 kind: KIND_CPU } ]" in text for text in one.values())
    many = configs.render_all({"instances": "2"}, models=["qwen3_tts"])
    for name in ("qwen3_tts", "qwen3_tts_engine", "qwen3_tts_text_stream"):  # each hosts an engine
        assert "instance_group [ { count: 2 kind: KIND_CPU } ]" in many[name], name
    assert "instance_group [ { count: 1 kind: KIND_CPU } ]" in many["qwen3_tts_preprocess"]
    gpus = configs.render_all({"instances": "1", "gpus": "0,1", "device": "auto"}, models=["orpheus"])
    assert "instance_group [ { count: 1 kind: KIND_GPU gpus: [ 0, 1 ] } ]" in gpus["orpheus_engine"]
    assert all('key: "instances"' not in t and 'key: "gpus"' not in t for t in (*many.values(), *gpus.values()))
    with pytest.raises(ValueError, match="at least 1"):
        configs.render_all({"instances": "0"}, models=["orpheus"])


def test_a_codec_stage_is_its_own_model_on_its_own_gpus_and_every_engine_names_it(tmp_path: Path):
    assert not any(name.endswith("_codec") for name in configs.render_all())  # colocated by default
    settings = {"gpus": "0", "codec_instances": "2", "codec_gpus": "1", "cosyvoice2.dtype": "bfloat16"}
    staged = configs.render_all(settings, models=["cosyvoice2", "qwen3_tts"])
    for model in ("cosyvoice2", "qwen3_tts"):
        stage = staged[f"{model}_codec"]
        assert "instance_group [ { count: 2 kind: KIND_GPU gpus: [ 1 ] } ]" in stage
        assert "input [" not in stage and "output [" not in stage and "decoupled" not in stage
        assert f'key: "model_kind" value: {{ string_value: "{model}" }}' in stage
        assert 'key: "codec_instances"' not in stage and 'key: "kv_pages"' not in stage
        for host in (model, f"{model}_engine"):
            assert f'key: "codec_model" value: {{ string_value: "{model}_codec" }}' in staged[host], host
            assert "kind: KIND_GPU gpus: [ 0 ]" in staged[host]
        assert 'key: "codec_model"' not in staged[f"{model}_preprocess"]
    assert 'string_value: "bfloat16"' in staged["cosyvoice2_codec"] and "bfloat16" not in staged["qwen3_tts_codec"]
    assert 'key: "codec_model"' in staged["qwen3_tts_text_stream"]
    repo = configs.write_repository(tmp_path / "repo", {"codec_instances": "1"}, models=["orpheus"])
    assert "import CodecModel as TritonPythonModel" in (repo / "orpheus_codec" / "1" / "model.py").read_text()
    with pytest.raises(ValueError, match="codec_instances must be 0"):
        configs.render_all({"codec_instances": "-1"}, models=["orpheus"])


def test_unknown_override_is_rejected():
    with pytest.raises(ValueError, match="unknown engine parameter"):
        configs.render_all({"kv_pagez": "1"})
    with pytest.raises(ValueError, match="names no served model"):
        configs.render_all({"nomodel.kv_pages": "1"})


def test_a_checkpoint_override_belongs_to_one_model(tmp_path: Path):
    with pytest.raises(ValueError, match="checkpoint is one model's"):
        configs.render_all({"checkpoint": "/ckpt/orpheus"})
    rendered = configs.render_all({"orpheus.checkpoint": "/ckpt/orpheus", "kv_pages": "64"})
    assert 'string_value: "/ckpt/orpheus"' in rendered["orpheus_engine"]
    assert 'string_value: "/ckpt/orpheus"' not in rendered["csm_engine"]
    assert all('key: "kv_pages" value: { string_value: "64" }' in rendered[f"{m.name}_engine"]
               for m in configs.SERVED_MODELS)
    repo = configs.write_repository(tmp_path / "repo", {"checkpoint": "/ckpt/csm"}, models=["csm"])
    assert sorted(p.name for p in repo.iterdir()) == sorted(["csm", "csm_engine", "csm_preprocess"])


def _tensor_names(config: str, kind: str) -> set[str]:
    block = config.split(f"\n{kind} [")[1].split("\n]")[0]
    return set(re.findall(r'name: "(\w+)"', block))


@pytest.mark.parametrize("model", configs.SERVED_MODELS, ids=lambda m: m.name)
def test_the_front_model_hosts_the_engine_its_engine_model_parameter_names(model):
    """The front model takes the client inputs, runs the engine's settings (its own engine) and sends encoded audio;
    the preprocess's outputs still fit the engine's inputs by name (for a caller that chains them)."""
    rendered = configs.render_all()
    front = rendered[model.name]
    assert 'backend: "python"' in front and "model_transaction_policy { decoupled: true }" in front
    assert f'key: "preprocess_model" value: {{ string_value: "{model.preprocess}" }}' in front
    assert f'key: "engine_model" value: {{ string_value: "{model.name}" }}' in front
    engine_params = set(re.findall(r'key: "(\w+)"', rendered[model.engine]))
    assert engine_params <= set(re.findall(r'key: "(\w+)"', front))
    assert _tensor_names(front, "input") == _tensor_names(rendered[model.preprocess], "input") == {
        s.name for s in schema.client_inputs(model.input_specs)}
    assert _tensor_names(rendered[model.preprocess], "output") <= _tensor_names(rendered[model.engine], "input")
    assert _tensor_names(front, "output") == {s.name for s in schema.client_outputs(model.text_output)}
    assert {"AUDIO", "AUDIO_FORMAT", "STREAM_ID", *(s.name for s in schema.CHUNK_META)} <= _tensor_names(
        rendered[model.engine], "output")


def test_engine_and_front_are_decoupled_and_every_tensor_is_documented():
    rendered = configs.render_all()
    for name in ("orpheus_engine", "orpheus"):
        assert "model_transaction_policy { decoupled: true }" in rendered[name], name
    assert "decoupled" not in rendered["orpheus_preprocess"]
    model_inputs = [s for m in configs.SERVED_MODELS
                    for s in (*schema.client_inputs(m.input_specs, m.text_required),
                              *schema.engine_inputs(m.input_specs))]
    for spec in (*schema.engine_outputs(True), *schema.client_outputs(True), *model_inputs):
        assert spec.doc, f"{spec.name} needs a doc line (it is the schema documentation in config.pbtxt)"


@pytest.mark.parametrize("model", configs.SERVED_MODELS, ids=lambda m: m.name)
def test_each_model_declares_its_own_inputs_and_the_runtime_finds_them(model):
    from voxbackend.triton.loading import request_inputs

    rendered = configs.render_all()
    own = {s.name for s in model.input_specs}
    for name in (model.preprocess, model.engine, model.name):
        declared = set(re.findall(r'name: "(\w+)"\n    data_type', rendered[name].split("output [")[0]))
        assert own <= declared, f"{name} lacks {own - declared}"
    engine_inputs = set(re.findall(r'name: "(\w+)"\n    data_type', rendered[model.engine].split("output [")[0]))
    for other in configs.SERVED_MODELS:  # no other model's own inputs leak into this one's configs
        leaked = ({s.name for s in other.input_specs} - own) & engine_inputs
        assert not leaked, f"{model.engine} declares {other.name}'s inputs {leaked}"
    for name in (model.preprocess, model.engine):
        params = dict(re.findall(r'key: "(\w+)" value: \{ string_value: "([^"]*)" \}', rendered[name]))
        assert request_inputs(params) == model.input_specs
    for spec in model.input_specs:
        assert spec.arg, f"{spec.name}: which prepare() argument does it fill?"


def test_every_engine_parameter_is_an_engine_config_field():
    from dataclasses import fields

    from voxbackend.config import EngineConfig
    from voxbackend.triton.loading import GLUE_PARAMS

    engine_options = set(configs.ENGINE_PARAMS) - set(GLUE_PARAMS)
    assert engine_options <= {f.name for f in fields(EngineConfig)}


def test_every_engine_option_is_a_config_parameter():
    from dataclasses import fields

    from voxbackend.config import EngineConfig
    from voxbackend.deploy.configs import ENGINE_PARAMS

    assert {f.name for f in fields(EngineConfig)} <= set(ENGINE_PARAMS)
    assert EngineConfig.from_options({k: ENGINE_PARAMS[k] for k in (f.name for f in fields(EngineConfig))
                                      if k != "device"})


def test_the_whole_repository_is_generated(tmp_path: Path):
    """Every committed file under model_repository/ is what the generator writes from scratch, and no more."""
    import subprocess

    repo = configs.write_repository(tmp_path / "repo")
    written = sorted(str(p.relative_to(repo)) for p in repo.rglob("*") if p.is_file())
    committed = subprocess.run(["git", "ls-files", "model_repository"], cwd=configs.REPO_ROOT, check=True,
                               capture_output=True, text=True).stdout.split()
    assert written == sorted(str(Path(p).relative_to("model_repository")) for p in committed)
    for name in written:
        assert (repo / name).read_text() == (configs.DEFAULT_REPOSITORY / name).read_text(), name


def test_stale_shims_and_stray_folders_are_detected(tmp_path: Path):
    repo = configs.write_repository(tmp_path / "repo")
    assert configs.stale_configs(repo) == []
    model = configs.SERVED_MODELS[0]
    (repo / model.engine / "1" / "model.py").write_text("from somewhere import TritonPythonModel\n")
    (repo / f"{model.name}_old_engine").mkdir()
    assert configs.stale_configs(repo) == [model.engine, f"{model.name}_old_engine"]
    assert configs.main(["--repository", str(repo), "--check"]) == 1


def test_served_models_come_from_the_registry():
    from voxbackend.models import registry

    served = {k.name for k in registry.KINDS.values() if k.served}
    assert {m.name for m in configs.SERVED_MODELS} == served
    for m in configs.SERVED_MODELS:
        kind = registry.get_kind(m.name)
        assert m.input_specs == (kind.frontend or kind.model).request_inputs
        assert m.default_checkpoint == kind.tiny_checkpoint


def test_text_stream_models_are_rendered_for_text_streaming_kinds_only():
    from voxbackend.models import registry

    rendered = configs.render_all()
    for m in configs.SERVED_MODELS:
        assert m.text_streaming == bool(getattr(registry.get_kind(m.name).model, "text_streaming", False))
        assert (m.text_stream in rendered) == m.text_streaming
        assert (f"{m.text_stream}/1/model.py" in configs.render_files()) == m.text_streaming


def test_a_text_stream_config_is_a_sequence_batched_decoupled_engine():
    import dataclasses

    m = dataclasses.replace(configs.SERVED_MODELS[0], text_streaming=True)
    text = configs.render_text_stream(m, m.params({"max_batch": "7"}))
    # one slot per stream the engine batches
    assert f'name: "{m.text_stream}"' in text and "max_batch_size: 7\n" in text
    assert ("model_transaction_policy { decoupled: true }" in text
            and "direct { max_queue_delay_microseconds: 0 }" in text)
    assert f"max_sequence_idle_microseconds: {configs.TEXT_STREAM_IDLE_US}\n" in text
    for name, kind in [("START", "CONTROL_SEQUENCE_START"), ("END", "CONTROL_SEQUENCE_END"),
                       ("READY", "CONTROL_SEQUENCE_READY"), ("CORRID", "CONTROL_SEQUENCE_CORRID")]:
        assert re.search(rf'name: "{name}" control \[ {{ kind: {kind} ', text), name
    inputs = re.findall(r'name: "(\w+)"', text.split("\ninput [")[1].split("output [")[0])
    assert inputs == [s.name for s in schema.client_inputs(m.input_specs)]
    outputs = re.findall(r'name: "(\w+)"', text.split("output [")[1].split("instance_group")[0])
    assert outputs == [s.name for s in schema.CLIENT_OUTPUTS]
    assert 'key: "model_kind" value: { string_value: "orpheus" }' in text and "frontend_loader" not in text
    files = configs.text_stream_files(m)
    assert "text_stream_model import TextStreamModel as TritonPythonModel" in files[f"{m.text_stream}/1/model.py"]
