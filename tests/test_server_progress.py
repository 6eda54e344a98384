"""`voxbackend serve` on a terminal: models loading, read from tritonserver's log (deploy/server.py LoadProgress)."""
from voxbackend.deploy.server import LoadProgress


def _line(text: str) -> str:
    return f'I1206 13:35:33.185007 3472 model_lifecycle.cc:472] "{text}"\n'


def test_loading_lines_count_ready_models_from_this_runs_log_only(tmp_path):
    log = tmp_path / "tritonserver.log"
    log.write_text(_line("loading: old:1") + _line("successfully loaded 'old'"))  # an earlier run's lines
    said: list[str] = []
    progress = LoadProgress(log, log.stat().st_size, said.append, every_s=3600)
    with open(log, "a") as f:
        f.write(_line("loading: orpheus:1") + _line("loading: orpheus_engine:1") + _line("loading: orpheus_pre")[:-2])
    progress.poll()  # a line still being written is left for the next poll
    assert [s.rsplit(" ", 2)[0] for s in said] == ["loading models: 0/2 ready"]
    with open(log, "a") as f:
        f.write('process:1"\n' + _line("successfully loaded 'orpheus_engine'"))
    progress.poll()
    progress.poll()  # nothing new: no line (every_s is long)
    with open(log, "a") as f:
        f.write(_line("successfully loaded 'orpheus'") + _line("successfully loaded 'orpheus_preprocess'"))
    progress.poll()
    assert [s.rsplit(" ", 2)[0] for s in said] == [
        "loading models: 0/2 ready", "loading models: 1/3 ready (orpheus_engine)",
        "loading models: 3/3 ready (orpheus, orpheus_preprocess)"]
