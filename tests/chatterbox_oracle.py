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


def upstream_t3(llama_config: dict, weights: dict):
    """(the T3 namespace of load_t3, an upstream T3 over `llama_config` with `weights` loaded strictly). Upstream's
    Perceiver hard-codes width 1024: it is built at the backbone's width (a functools.partial; 32 queries and 4 heads
    kept), and the backbone entry is added to LLAMA_CONFIGS for the build only."""
    import functools

    name = "Llama_tiny_test"
    oracle = load_t3()
    cond_enc = sys.modules[oracle.T3Cond.__module__]
    width = llama_config["hidden_size"]
    perceiver = cond_enc.Perceiver
    oracle.LLAMA_CONFIGS[name] = llama_config
    cond_enc.Perceiver = functools.partial(perceiver, pre_attention_query_size=width, embedding_dim=width)
    try:
        hp = oracle.T3Config()
        hp.llama_config_name = name
        t3 = oracle.T3(hp).eval()
    finally:
        cond_enc.Perceiver = perceiver
        del oracle.LLAMA_CONFIGS[name]
    t3.load_state_dict(weights)  # strict: names and shapes must be upstream's
    return oracle, t3
