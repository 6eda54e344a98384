"""Importing the Qwen3-TTS reference (`qwen-tts-hf`, installed --no-deps) without the packages it declares but the
12 Hz path never calls: `librosa`, `sox`, `onnxruntime` and `torchaudio` become empty stand-in modules.

Each stand-in carries a real `__spec__` (transformers calls `importlib.util.find_spec("torchaudio")`), and the
few names the reference imports at module level exist but raise when called, so a test that reaches them by
mistake fails loudly instead of computing with a fake.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

import pytest

# module -> names imported from it at module level by qwen_tts (the 25 Hz tokenizer and the mel front end)
_STAND_INS = {
    "librosa": (),
    "librosa.filters": ("mel",),
    "sox": (),
    "onnxruntime": (),
    "torchaudio": (),
    "torchaudio.compliance": (),
    "torchaudio.compliance.kaldi": (),
}


def _unavailable(module: str, name: str):
    def call(*args, **kwargs):
        raise RuntimeError(f"{module}.{name} is a test stand-in: the tested path must not call it")
    return call


def install_stand_ins() -> None:
    """Put a stand-in in sys.modules for each of those packages that is not really installed."""
    for module, names in _STAND_INS.items():
        root = module.split(".")[0]
        if module in sys.modules or (root == module and importlib.util.find_spec(module) is not None):
            continue
        if root != module and not getattr(sys.modules.get(root), "_voxbackend_stand_in", False):
            continue  # the real parent package is installed: leave its submodules alone
        stub = types.ModuleType(module)
        stub.__spec__ = importlib.machinery.ModuleSpec(module, loader=None, is_package=True)
        stub.__path__ = []
        stub._voxbackend_stand_in = True
        for name in names:
            setattr(stub, name, _unavailable(module, name))
        sys.modules[module] = stub
        parent, _, child = module.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, stub)


def import_qwen_tts():
    """The `qwen_tts` package with stand-ins installed; the test is skipped when the oracle is not installed."""
    if importlib.util.find_spec("qwen_tts") is None:
        pytest.skip("qwen-tts-hf (the Qwen3-TTS oracle) is not installed; scripts/setup_env.sh installs it")
    install_stand_ins()
    import qwen_tts

    return qwen_tts
