"""perf/serving_ab.py runs each side's own code: its repository copy puts the side's checkout first on sys.path
and names the shared checkpoint (the server run itself is the benchmark, not a test)."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "perf"), str(ROOT)]

import serving_ab  # noqa: E402


def test_a_side_repository_runs_that_checkout_with_the_given_checkpoint(tmp_path):
    checkout = tmp_path / "base"
    for name, body in (("orpheus", "ensemble"), ("orpheus_engine", "engine"), ("audio_postprocess", "post"),
                       ("orpheus_text_stream", "text"), ("csm", "other")):
        (checkout / "model_repository" / name / "1").mkdir(parents=True)
        (checkout / "model_repository" / name / "config.pbtxt").write_text(
            f'# {body}\nparameters {{ key: "checkpoint" value: {{ string_value: "" }} }}\n'
            'parameters { key: "codec" value: { string_value: "" } }\n')
        (checkout / "model_repository" / name / "1" / "model.py").write_text("from voxbackend.triton import x\n")
    repo = serving_ab.side_repository(checkout, tmp_path / "repo", Path("/ck/orpheus"), Path("/ck/snac"))
    assert sorted(p.name for p in repo.iterdir()) == ["audio_postprocess", "orpheus", "orpheus_engine"]
    config = (repo / "orpheus_engine" / "config.pbtxt").read_text()
    assert 'string_value: "/ck/orpheus"' in config and 'string_value: "/ck/snac"' in config
    shim = (repo / "orpheus" / "1" / "model.py").read_text().splitlines()
    assert shim[:2] == ["import sys", f"sys.path.insert(0, {str(checkout)!r})"] and shim[2].startswith("from ")
