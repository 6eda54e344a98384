"""Import the CosyVoice2 reference decoders (test oracles) without their heavy, unneeded dependencies.

scripts/setup_env.sh installs `cosyvoice-minicpmo` (upstream CosyVoice code), `step-audio2` (flashcosyvoice, an
independent reimplementation) and scipy `--no-deps --target` into folders under the venv, so none of their
top-level modules (`cosyvoice`, `matcha`, `utils`, `token2wav`...) are importable by the server itself. Only the
tests put those folders on sys.path, and only here. The stand-ins cover modules the tested path (flow inference,
HiFT inference, CosyVoice2Model streaming) imports but never calls: torchaudio (no build for our torch), matcha's
lightning-based utils package, and the ONNX/TensorRT/vLLM export helpers.
"""
from __future__ import annotations

import contextlib
import importlib.machinery
import logging
import sys
import types
from pathlib import Path

import pytest

ORACLES = Path(sys.prefix) / "oracles"


def _stand_in(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


@contextlib.contextmanager
def _on_path(*folders: str):
    """The oracle folders are importable only while their modules load (they stay cached in sys.modules)."""
    paths = [ORACLES / f for f in folders]
    for path in paths:
        if not path.is_dir():
            pytest.fail(f"oracle not installed at {path} (run scripts/setup_env.sh)")
    sys.path.extend(str(p) for p in paths)
    try:
        yield
    finally:
        for p in paths:
            sys.path.remove(str(p))


def load_cosyvoice():
    """Returns the upstream modules the tests drive: (flow, flow_matching, decoder, encoder, hift, f0, cli.model)."""
    with _on_path("scipy", "cosyvoice"):
        return _import_cosyvoice()


def _import_cosyvoice():
    if "torchaudio" not in sys.modules:
        _stand_in("torchaudio")
    if "matcha.utils" not in sys.modules:
        import matcha  # noqa: F401  (the real package; only its utils/__init__ pulls lightning and rich)
        utils = _stand_in("matcha.utils")
        utils.__path__ = []  # a package, so `matcha.utils.pylogger` resolves to the stand-in below
        _stand_in("matcha.utils.pylogger", get_pylogger=lambda name=__name__: logging.getLogger(name))
    if "cosyvoice.utils.file_utils" not in sys.modules:
        import cosyvoice.utils  # noqa: F401
        _stand_in("cosyvoice.utils.file_utils", logging=logging,
                  convert_onnx_to_trt=None, export_cosyvoice2_vllm=None)
    from cosyvoice.cli import model as cli_model
    from cosyvoice.flow import decoder, flow, flow_matching
    from cosyvoice.hifigan import f0_predictor, generator
    from cosyvoice.transformer import upsample_encoder
    return types.SimpleNamespace(flow=flow, flow_matching=flow_matching, decoder=decoder,
                                 encoder=upsample_encoder, hift=generator, f0=f0_predictor, model=cli_model)


def load_cosyvoice_llm():
    """Upstream cosyvoice.llm.llm (Qwen2LM, Qwen2Encoder) on transformers' Qwen2ForCausalLM."""
    with _on_path("scipy", "cosyvoice"):
        _import_cosyvoice()
        from cosyvoice.llm import llm
    return llm


def load_flashcosyvoice():
    """step-audio2's flashcosyvoice flow and HiFT (batched, independent of the upstream code)."""
    with _on_path("scipy", "step_audio2"):
        from flashcosyvoice.modules import flow, hifigan
        from flashcosyvoice.modules.flow_components import estimator, upsample_encoder
    return types.SimpleNamespace(flow=flow, hift=hifigan, estimator=estimator, encoder=upsample_encoder)
