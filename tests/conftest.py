"""Shared fixtures. Tests never touch the network: the checkpoints are built locally from a seed."""
import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def one_thread():
    """For modules of tiny tensors (`pytestmark = pytest.mark.usefixtures("one_thread")`): with intra-op threads
    every small op pays a fan-out, and on a shared 2-core machine a stalled thread (measured: 1-frame Qwen3-TTS
    codec windows 20x slower with 2 threads than with 1). Restored after the module."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_orpheus(tmp_path_factory):
    """(model_dir, codec_dir): tiny random Orpheus LM + SNAC 24 kHz (decoder_dim 64), seed 0."""
    from voxbackend.models.orpheus.tiny import write_default

    return write_default(tmp_path_factory.mktemp("tiny_orpheus"), seed=0, size="tiny")


@pytest.fixture(scope="session")
def tiny_csm(tmp_path_factory):
    """A tiny random CSM-1B-architecture checkpoint (HF layout, Mimi inside), seed 0."""
    from voxbackend.models.csm.tiny import write_tiny_csm

    return write_tiny_csm(tmp_path_factory.mktemp("tiny_csm"), seed=0)


# The slow tier: modules that start a tritonserver (directly, through the launcher, or through a perf script).
# `bash scripts/test.sh --quick` runs everything else (`-m "not triton"`).
_STARTS_TRITON = re.compile(r"TritonServer|start_serve|start_server|triton_util|\"serve\",|\"demo\"|run_cpu_suite|reliability|serving_ab")
_starts_triton: dict[str, bool] = {}


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = str(item.path)
        if path not in _starts_triton:
            _starts_triton[path] = bool(_STARTS_TRITON.search(item.path.read_text(encoding="utf-8")))
        if _starts_triton[path]:
            item.add_marker(pytest.mark.triton)
