"""GPU checks: the GPU-only ones skip cleanly on CPU machines (the device script's dry run: test_gpu_script.py)."""
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
