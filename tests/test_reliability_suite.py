"""The reliability suite (perf/reliability.py) must not rot: its probe table and verdict logic, and a few probes
run for real against a server it starts itself (`--quick --only ...`).

The real run asserts on mechanics: probes that today's code passes must pass (so a broken probe shows), and a
probe of a known finding (TEMPERATURE=inf) must report a coherent verdict either way, so the test keeps passing
once that finding is fixed.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "perf"), str(ROOT)]

import reliability as rel  # noqa: E402  (perf/reliability.py)
from voxbackend.stream_client import StreamOutcome  # noqa: E402


def outcome(error: str | None = None, responses: int = 1, chunks: int = 0, late: int = 0) -> StreamOutcome:
    out = StreamOutcome(send_time=0.0, error=error, responses=responses, late_responses=late)
    for i in range(chunks):
        out.chunks.append(np.zeros(10, np.float32))
        out.arrivals.append(0.1 * i)
        out.indices.append(i)
    if error is None:
        out.finish_reason = "client-cancelled"
    return out


# ---------------------------------------------------------------- the tables and the verdict logic (no server)


def test_the_tables_have_unique_names_and_at_least_30_bad_inputs():
    names = [c.name for c in rel.BAD_INPUTS]
    assert len(names) >= 30 and len(set(names)) == len(names)
    assert len({p.name for p in rel.PROBES}) == len(rel.PROBES)
    assert rel.PROBES[-1].name == "shutdown_busy", "the busy shutdown stops the main server: it must run last"
    for c in rel.BAD_INPUTS:
        assert c.fields and all(f for f in c.fields), c.name
        if c.check is None:
            c.build()  # every request can be built without a server


def test_a_refusal_must_name_the_field_and_be_the_only_response():
    fields = ("TEXT",)
    assert rel.judge_refusal(outcome("in ensemble 'orpheus', InvalidRequest: TEXT is empty"), fields)[0]
    assert not rel.judge_refusal(outcome("CONTEXT_TEXT[0] is not valid UTF-8"), fields)[0], "a longer name is not it"
    assert not rel.judge_refusal(outcome("text is empty"), fields)[0], "tensor names are upper case"
    assert not rel.judge_refusal(outcome("TEXT is empty", responses=2), fields)[0]
    assert not rel.judge_refusal(outcome("TEXT is empty", late=1), fields)[0]
    assert not rel.judge_refusal(outcome("TEXT is empty", responses=3, chunks=2), fields)[0]
    ok, observed = rel.judge_refusal(outcome(None, chunks=1), fields)
    assert not ok and observed.startswith("accepted")


def test_only_selects_probes_and_single_bad_inputs():
    probes, cases = rel.select("bad_input:voice_unknown,bad_input:csm_speaker_negative,cancel_storm", quick=True)
    assert [p.name for p in probes] == ["bad_input", "cancel_storm"]
    assert [c.name for c in cases] == ["voice_unknown", "csm_speaker_negative"]
    assert rel.served_models(probes, cases) == ["orpheus", "csm"]
    probes, cases = rel.select(None, quick=True)
    assert [p.name for p in probes] == [p.name for p in rel.PROBES]
    assert cases and not any(c.model.startswith("csm") for c in cases), "--quick serves Orpheus only"
    assert rel.served_models(*rel.select("engine_fault", quick=False)) == [], "the fault probe brings its own server"
    with pytest.raises(SystemExit, match="unknown probe"):
        rel.select("no_such_probe", quick=False)


def test_the_report_has_one_row_per_result_and_totals_leaks(tmp_path):
    results = [rel.Result("a", "exp | with bar", "obs", rel.PASS, 0, 0, 1.0),
               rel.Result("b", "exp", "obs", rel.FAIL, 3, 1, 2.0), rel.Result("c", "exp", "obs", rel.ERROR)]
    suite = rel.Suite(args=rel.parse_args(["--quick"]), tmp=tmp_path)
    md = rel.render(results, {"date": "today", "commit": "abc"}, ["--quick"], suite, 60.0, {"max_queue": "12"},
                    ["orpheus"])
    assert "**1/3 probes passed**" in md and "KV pages leaked: 3, queue slots leaked: 1" in md
    assert "exp \\| with bar" in md
    assert len([ln for ln in md.splitlines() if re.match(r"^\| [abc] \|", ln)]) == 3


# ---------------------------------------------------------------- a few probes against a real server


PASSING_TODAY = ["bad_input:text_empty", "bad_input:top_p_zero", "bad_input:dtype_temperature_fp64",
                 "bad_input:engine_prompt_ids_empty"]
FINDING = "bad_input:temperature_inf"  # issue 9: accepted today; its verdict may go either way


def table_rows(md: str) -> dict[str, list[str]]:
    rows = {}
    for line in md.splitlines():
        if line.startswith("| ") and not line.startswith(("| probe", "| process", "| s ")):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            rows[cells[0]] = cells
    return rows


def test_quick_probes_run_against_a_real_server(tmp_path):
    out = tmp_path / "reliability.md"
    only = ",".join(PASSING_TODAY + [FINDING, "cancel_storm"])
    done = subprocess.run([sys.executable, str(ROOT / "perf" / "reliability.py"), "--quick", "--only", only,
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    printed = done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode in (0, 1) and out.exists(), printed
    rows = table_rows(out.read_text())
    assert not [k for k, r in rows.items() if r[3] == "**ERROR**"], printed
    for name in PASSING_TODAY:
        row = next((r for k, r in rows.items() if k.startswith(name + " ")), None)
        assert row is not None, f"no row for {name}: {sorted(rows)}"
        assert row[3] == "**PASS**", row
    long_streams = rows["bad_input:long_streams (orpheus)"]
    assert long_streams[3] == "**PASS**" and long_streams[4:6] == ["0", "0"], long_streams
    finding = next(r for k, r in rows.items() if k.startswith(FINDING + " "))
    if finding[3] == "**FAIL**":
        assert finding[2].startswith("accepted"), finding
    else:
        assert finding[3] == "**PASS**" and "TEMPERATURE" in finding[2], finding
    storm = rows["cancel_storm"]
    assert storm[3] == "**PASS**" and storm[4:6] == ["0", "0"], storm
