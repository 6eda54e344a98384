"""Import the Chatterbox reference (`chatterbox-tts==0.1.7`, a test oracle) without its TTS stack's dependencies.

scripts/setup_env.sh installs it `--no-deps --target` into a folder under the venv (it pins torch 2.6,
torchaudio and transformers 5.2, none of which may replace ours). The package's `__init__` imports the whole
TTS front end (librosa, perth watermarking, pyloudnorm); the tests need only model classes, so `chatterbox` and
`chatterbox.models` are stand-in packages whose `__path__` is the real folder: submodules import from the real
files, the package `__init__`s never run.
"""
from __future__ import annotations

import sys
import types

from cosyvoice_oracle import ORACLES, _on_path, _stand_in

PACKAGE = ORACLES / "chatterbox" / "chatterbox"


def chatterbox_package() -> None:
    """`chatterbox` and `chatterbox.models` as packages over the real folders, their __init__s not run."""
    if "chatterbox" in sys.modules:
        return
    if not PACKAGE.is_dir():
        import pytest
        pytest.fail(f"oracle not installed at {PACKAGE} (run scripts/setup_env.sh)")
    package = _stand_in("chatterbox")
    package.__path__ = [str(PACKAGE)]
    models = _stand_in("chatterbox.models")
    models.__path__ = [str(PACKAGE / "models")]
    package.models = models


def load_t3() -> types.SimpleNamespace:
    """The T3 LM: its module (class T3), T3Config, T3Cond and the backbone config table (LLAMA_CONFIGS)."""
    with _on_path("chatterbox"):
        chatterbox_package()
        from chatterbox.models.t3 import llama_configs, t3
        from chatterbox.models.t3.modules import cond_enc, t3_config
    return types.SimpleNamespace(t3=t3, T3=t3.T3, T3Config=t3_config.T3Config, T3Cond=cond_enc.T3Cond,
                                 LLAMA_CONFIGS=llama_configs.LLAMA_CONFIGS)
