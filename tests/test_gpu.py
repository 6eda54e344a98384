"""GPU checks: the GPU-only ones skip cleanly on CPU machines; the device script (perf/gpu/run.sh) dry-runs here."""
import sys
from pathlib import Path

import pytest
import torch

import voxbackend

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_flashinfer_matches_torch_attention():
    pytest.importorskip("flashinfer")
    sys.path.insert(0, str(Path(__file__).parents[1] / "perf" / "gpu"))
    import gpu_check

    lines: list[str] = []
    assert gpu_check.attention_parity(lines), lines


def test_flashinfer_is_refused_without_cuda(tmp_path):
    from tests.util_llama import write_tiny_llama

    write_tiny_llama(tmp_path)
    with pytest.raises(ValueError, match="CUDA"):
        voxbackend.load(tmp_path, attention="flashinfer")
    assert type(voxbackend.load(tmp_path).attention).__name__ == "TorchPagedAttention"


def test_the_gpu_scripts_dry_run_takes_every_step_on_cpu(tmp_path):
    """perf/gpu/run.sh --dry-run: the device script's steps at tiny sizes on CPU, so it cannot rot before a GPU is
    lent (its numbers mean nothing here)."""
    import os
    import subprocess

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
    assert "goodput through tritonserver" in text and "\n| 0.5 |" in text, text  # the sweep's one rate ran
