"""The device script (perf/gpu/run.sh) dry-runs here: its steps at tiny sizes on CPU, a tritonserver included (the
goodput sweep), so it cannot rot before a GPU is lent."""
import os
import subprocess
import sys
from pathlib import Path


def test_the_gpu_scripts_dry_run_takes_every_step_on_cpu(tmp_path):
    """perf/gpu/run.sh --dry-run: the device script's steps at tiny sizes on CPU, so it cannot rot before a GPU is
    lent (its numbers mean nothing here)."""
    root = Path(__file__).parents[1]
    done = subprocess.run(["bash", "perf/gpu/run.sh", "--dry-run", str(tmp_path)], cwd=root, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [report] = tmp_path.glob("*-gpu-check-dry-run.md")
    text = report.read_text()
    assert text.count("| PASS |") == 5 and "FAIL" not in text, text
    assert "single-stream time to first audio" in text and "\n| 128 | " in text, text
    assert "csm greedy, cuda_graphs=padded == off" in text and "padded, eager (dry run) step ms" in text, text
    assert "\n| on | " in text and "\n| off | " in text, text  # the codec beside the LM, and not
    # the sweep's one rate ran, with the codec as its own model (colocated is the same call without settings)
    assert "goodput through tritonserver (orpheus, codec stage: `" in text and "codec_instances=1" in text, text
    assert text.count("\n| 0.5 |") == 1, text
