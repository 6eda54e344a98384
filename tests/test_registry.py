"""The model registry is the one table that names models: each entry's classes, inputs and tiny checkpoint agree."""
import inspect

import pytest

from voxbackend.models import registry
from voxbackend.triton.loading import import_object

SERVED = [k for k in registry.KINDS.values() if k.served]


@pytest.mark.parametrize("kind", registry.KINDS.values(), ids=lambda k: k.name)
def test_each_declared_input_fills_a_prepare_argument(kind):
    prepare = inspect.signature((kind.frontend or kind.model).prepare).parameters
    for spec in kind.request_inputs:
        assert spec.doc, f"{kind.name}: {spec.name} needs a doc line (config.pbtxt documents it)"
        assert (spec.segment or spec.arg) in prepare, f"{kind.name}: prepare() has no {spec.segment or spec.arg!r}"


@pytest.mark.parametrize("kind", SERVED, ids=lambda k: k.name)
def test_served_kinds_have_a_tiny_checkpoint_writer(kind):
    make = import_object(kind.tiny_checkpoint)
    assert "root" in inspect.signature(make).parameters  # the CLI's make-checkpoint --root


def test_tiny_checkpoints_are_detected_as_their_kind(tiny_orpheus, tiny_csm):
    assert registry.detect_kind(tiny_orpheus[0]).name == "orpheus"
    assert registry.detect_kind(tiny_csm).name == "csm"
    assert registry.KINDS["orpheus"].codec(tiny_orpheus[0], None) == tiny_orpheus[1]  # found next to the LM


def fake_writer(root=None):
    return f"{root}/model", None


def test_make_checkpoint_cli_picks_the_writer_by_model(tmp_path, capsys, monkeypatch):
    import dataclasses

    from voxbackend.cli import main

    kind = dataclasses.replace(registry.KINDS["csm"], tiny_checkpoint="tests.test_registry:fake_writer")
    monkeypatch.setitem(registry.KINDS, "csm", kind)
    assert main(["make-checkpoint", "--model", "csm", "--root", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"model: {tmp_path}/model\ncodec: None\n"
    with pytest.raises(SystemExit):
        main(["make-checkpoint", "--model", "nope"])
    assert "invalid choice" in capsys.readouterr().err
