"""Using the Qwen3-TTS reference (`qwen-tts-hf`, installed --no-deps) in tests without it leaking into others.

* `librosa`, `sox`, `onnxruntime` and `torchaudio` are declared by the package but never called on the 12 Hz path:
  they become stand-in modules for the import only (each with a real `__spec__`, since transformers calls
  `importlib.util.find_spec("torchaudio")`; the few names imported at module level raise when called), and leave
  sys.modules again afterwards, so no later test sees a fake torchaudio.
* Importing qwen_tts registers a "default" RoPE initializer in transformers' global ROPE_INIT_FUNCTIONS that reads
  `config.rope_theta`; on transformers 5.23 that entry breaks every later MimiModel init (its config has only
  `rope_parameters`). It is taken out after the import; build reference models inside `reference_rope()`.
"""
from __future__ import annotations

import contextlib
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


def _install_stand_ins() -> list[str]:
    """Put a stand-in in sys.modules for each of those packages that is not really installed; returns their names."""
    added = []
    for module, names in _STAND_INS.items():
        root = module.split(".")[0]
        if module in sys.modules or (root == module and importlib.util.find_spec(module) is not None):
            continue
        parent = sys.modules.get(root)
        if root != module and (parent is None or getattr(parent, "__file__", None) is not None):
            continue  # the real parent package is installed: leave its submodules alone (a stand-in has no file)
        stub = types.ModuleType(module)
        stub.__spec__ = importlib.machinery.ModuleSpec(module, loader=None, is_package=True)
        stub.__path__ = []
        stub._voxbackend_stand_in = True
        for name in names:
            setattr(stub, name, _unavailable(module, name))
        sys.modules[module] = stub
        added.append(module)
        parent, _, child = module.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, stub)
    return added


def _reference_rope_init():
    from qwen_tts._transformers_compat import _default_rope_parameters

    return _default_rope_parameters


def import_qwen_tts():
    """The `qwen_tts` package (and all its modules, imported once); fails the test when it is not installed."""
    if importlib.util.find_spec("qwen_tts") is None:
        pytest.fail("qwen-tts-hf (the Qwen3-TTS oracle) is not installed; scripts/setup_env.sh installs it")
    if "qwen_tts" not in sys.modules:
        added = _install_stand_ins()
        try:
            import qwen_tts  # noqa: F401  (imports the 12 Hz, 25 Hz and talker modules)
        finally:
            for module in added:
                del sys.modules[module]
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if ROPE_INIT_FUNCTIONS.get("default") is _reference_rope_init():
            del ROPE_INIT_FUNCTIONS["default"]
    return sys.modules["qwen_tts"]


@contextlib.contextmanager
def reference_rope():
    """While building a reference model: its RoPE modules look up ROPE_INIT_FUNCTIONS["default"] in __init__."""
    import_qwen_tts()
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if "default" in ROPE_INIT_FUNCTIONS:
        yield
        return
    ROPE_INIT_FUNCTIONS["default"] = _reference_rope_init()
    try:
        yield
    finally:
        del ROPE_INIT_FUNCTIONS["default"]


def reference_codec(folder):
    """The reference 12 Hz decoder with a speech-tokenizer folder's `decoder.*` weights (strict), and the official
    decode entry point `Qwen3TTSTokenizerV2Model.decode` bound to it: codes [B, T, 16] -> audio per clip. The whole
    reference model does not construct on transformers 5.23 (its Mimi encoder assigns MimiModel properties), and
    decoding never touches the encoder."""
    import types

    import torch

    from voxbackend.codecs.mimi_weights import read_codec_tensors

    import_qwen_tts()
    from qwen_tts.core import Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Decoder

    cfg = Qwen3TTSTokenizerV2Config.from_pretrained(folder)
    with reference_rope():
        decoder = Qwen3TTSTokenizerV2Decoder._from_config(cfg.decoder_config).eval()
    decoder.load_state_dict(read_codec_tensors(folder, "decoder."), strict=True)
    model = types.SimpleNamespace(decoder=decoder, decode_upsample_rate=cfg.decode_upsample_rate, config=cfg)

    def decode(codes: torch.Tensor) -> list[torch.Tensor]:
        with torch.no_grad():
            return Qwen3TTSTokenizerV2Model.decode(model, codes).audio_values

    return decoder, decode
