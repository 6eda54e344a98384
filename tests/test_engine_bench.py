"""perf/engine_bench.py works end to end (tiny model, seconds) and its queueing arithmetic is right."""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "perf" / "engine_bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("engine_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["engine_bench"] = mod  # dataclasses look their module up by name
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop("engine_bench", None)


def test_naive_queued_ttfa_is_sum_of_earlier_services_plus_own(bench):
    R = bench.ReqResult
    served = [R(0, 1.0, 10.0, 2.0, 100), R(3, 2.0, 20.0, 2.0, 100)]  # mean service 15, mean own TTFA 1.5
    # request 0: 1; 1 (extrapolated): 10 + 1.5; 2: 10 + 15 + 1.5; 3: 10 + 15 + 15 + 2
    assert bench.naive_queued_ttfa(4, served) == pytest.approx([1.0, 11.5, 26.5, 42.0])
    row = bench.naive_row(4, served)
    assert row.xrt == pytest.approx(4.0 / 30.0) and row.tok_s == pytest.approx(200 / 30.0)


def test_on_time_follows_the_design_definition(bench):
    # chunks of 1 s each: the 2nd arrives 0.5 s after the 1st (on time), the 3rd 2.5 s after (late: 2 s played)
    r = bench.ReqResult(0, 0.1, 3.0, 3.0, 21, chunk_times=[0.1, 0.6, 2.6], chunk_lens=[1.0, 1.0, 1.0])
    assert bench.on_time([r]) == (1, 2, 0, 1)
    silent = bench.ReqResult(1, None, 0.5, 0.0, 5)
    assert bench.on_time([silent]) == (0, 0, 0, 0)


def test_spread_covers_both_ends(bench):
    assert bench.spread(32, 4) == [0, 10, 21, 31]
    assert bench.spread(1, 4) == [0]


def quick_run(bench, tmp_path: Path, capsys, *model: str) -> tuple[str, str]:
    """`engine_bench.py [--model M] --quick` in this process (a subprocess would import torch again, for longer
    than the run itself takes): the results file's text and what it printed."""
    out = tmp_path / "result.md"
    assert bench.main([*model, "--quick", "--cache-dir", str(tmp_path / "cache"), "--out", str(out)]) == out
    return out.read_text(), capsys.readouterr().out


def test_quick_run_writes_a_results_table(bench, tmp_path, capsys):
    text, printed = quick_run(bench, tmp_path, capsys)
    assert "x real time = audio seconds / wall seconds" in text
    rows = [ln for ln in text.splitlines() if ln.startswith("| 1 |") or ln.startswith("| 4 |")]
    systems = {(ln.split("|")[1].strip(), ln.split("|")[2].strip()) for ln in rows}
    assert {("1", "naive"), ("1", "engine"), ("4", "naive"), ("4", "engine")} <= systems
    for key in ("- commit:", "- cpu:", "- torch:", "- weights: random", "- dataset:", "max_tokens 42"):
        assert key in text, key
    ratio_line = next(ln for ln in printed.splitlines() if ln.startswith("Ratio engine/naive"))
    ratios = [float(x.split()[-1].rstrip("x,")) for x in ratio_line.split(":", 1)[1].split(",")]
    assert len(ratios) == 2 and all(r > 0 for r in ratios)


def test_csm_quick_run_writes_a_results_table(bench, tmp_path, capsys):
    text, _ = quick_run(bench, tmp_path, capsys, "--model", "csm")
    systems = {tuple(c.strip() for c in ln.split("|")[1:3]) for ln in text.splitlines() if ln.startswith("| ")}
    assert {("1", "naive"), ("1", "engine"), ("4", "naive"), ("4", "engine")} <= systems
    for key in ("- commit:", "- cpu:", "random weights", "- dataset:", "12 frames", "CsmForConditionalGeneration"):
        assert key in text, key
    ratios = [float(x.split()[-1].rstrip("x")) for x in text.split("Ratio engine/naive (x real time):")[1].split(",")]
    assert len(ratios) == 2 and all(r > 0 for r in ratios)


def test_qwen3_tts_quick_run_writes_a_results_table(bench, tmp_path, capsys):
    text, _ = quick_run(bench, tmp_path, capsys, "--model", "qwen3_tts")
    systems = {tuple(c.strip() for c in ln.split("|")[1:3]) for ln in text.splitlines() if ln.startswith("| ")}
    assert {("1", "naive"), ("1", "engine"), ("4", "naive"), ("4", "engine")} <= systems
    for key in ("- commit:", "- cpu:", "random weights", "- dataset:", "12 frames", "non_streaming_mode=False"):
        assert key in text, key
    ratios = [float(x.split()[-1].rstrip("x")) for x in text.split("Ratio engine/naive (x real time):")[1].split(",")]
    assert len(ratios) == 2 and all(r > 0 for r in ratios)


def test_cosyvoice2_quick_run_writes_a_results_table(bench, tmp_path, capsys):
    text, _ = quick_run(bench, tmp_path, capsys, "--model", "cosyvoice2")
    rows = [[c.strip() for c in ln.split("|")[1:-1]] for ln in text.splitlines() if ln.startswith("| ")]
    systems = {tuple(r[:2]) for r in rows}
    assert {(n, s) for n in ("1", "4") for s in ("engine", "naive", "naive stream=True")} <= systems
    for r in rows[1:]:  # every system served audio, within the 30-token cap
        assert float(r[2]) > 0 and float(r[6]) > 0 and 0 < float(r[5]) <= 30, r
    for key in ("- commit:", "- cpu:", "random weights", "- dataset:", "capped at 30 tokens",
                "CosyVoice2Model.tts(stream=False)", "flow"):
        assert key in text, key
    for label in ("Ratio engine/naive (x real time):", "Ratio engine/naive stream=True (x real time):"):
        line = next(ln for ln in text.splitlines() if ln.startswith(label))
        ratios = [float(x.split()[-1].rstrip("x")) for x in line.split(":", 1)[1].split(",")]
        assert len(ratios) == 2 and all(r > 0 for r in ratios)


def assert_reference_table(text: str, cap: int, keys: tuple[str, ...]) -> None:
    """A model bench's results file (engine vs its reference at 1 and 4 streams): positive numbers, tokens within
    the cap, its provenance, the METHOD `keys`, and both ratio lines."""
    rows = [[c.strip() for c in ln.split("|")[1:-1]] for ln in text.splitlines() if ln.startswith("| ")]
    assert {(n, s) for n in ("1", "4") for s in ("engine", "reference")} <= {tuple(r[:2]) for r in rows}
    for r in rows[1:]:  # x real time, tokens/s, TTFA p50 / p90, tokens, audio, wall: served audio within the cap
        assert all(float(x) > 0 for x in (r[3], r[4], r[5], r[6], r[8], r[9])) and 0 < float(r[7]) <= cap, r
    for key in ("- commit:", "- cpu:", "random, seed 0", "- dataset:", *keys):
        assert key in text, key
    for label in ("Ratio engine/reference (x real time):", "TTFA p50, reference/engine:"):
        line = next(ln for ln in text.splitlines() if ln.startswith(label))
        ratios = [float(x.split()[-1].rstrip("x")) for x in line.split(":", 1)[1].split(",")]
        assert len(ratios) == 2 and all(r > 0 for r in ratios)


def test_chatterbox_quick_run_writes_a_results_table(bench, tmp_path, capsys):
    text, _ = quick_run(bench, tmp_path, capsys, "--model", "chatterbox")
    assert_reference_table(text, 30, ("at most 30 tokens", "T3.inference", "S3Token2Wav.inference"))


def test_step_audio2_quick_run_writes_a_results_table(bench, tmp_path, capsys):
    text, _ = quick_run(bench, tmp_path, capsys, "--model", "step_audio2")
    assert_reference_table(text, 100, ("greedy, at most 100 tokens", "Qwen2ForCausalLM.generate",
                                       "Token2wav.set_stream_cache", "from the end of the user's clip"))
    # greedy on both sides: the reference says what the engine says
    assert "the reference's reply equals the engine's for 2 of the 2 requests" in text


def test_step_audio2_queued_ttfa_is_sum_of_earlier_services_plus_own(bench):
    import step_audio2_bench  # perf/ is on sys.path once engine_bench is loaded

    R = step_audio2_bench.Result
    served = {0: R(1.0, 10.0, 1.0, 5, []), 3: R(2.0, 20.0, 1.0, 5, [])}  # mean service 15, mean own TTFA 1.5
    assert step_audio2_bench.queued_ttfa(4, served) == pytest.approx([1.0, 11.5, 26.5, 42.0])


def test_glm4_voice_quick_run_writes_a_results_table(bench, tmp_path, capsys):
    text, _ = quick_run(bench, tmp_path, capsys, "--model", "glm4_voice")
    assert_reference_table(text, 80, ("greedy, at most 80 tokens", "GlmForCausalLM.generate",
                                      "GlmAudioDecoder.token2wav", "from the end of the user's clip"))
    # greedy on both sides: the reference says what the engine says, and speaks as long
    assert "and so does its audio's length, for 2 of the 2 requests" in text
