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

    from voxbackend.components.mimi.weights import read_codec_tensors

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


@contextlib.contextmanager
def reference_tokenizer_loading():
    """While loading the whole reference 12 Hz tokenizer (`Qwen3TTSTokenizerV2Model`, encoder included), three
    adaptations of qwen-tts-hf to transformers 5.23, undone afterwards:
    * its Mimi encoder (a MimiModel subclass) drops the decoder half by assigning `upsample = None` and
      `decoder_transformer = None`, which are read-only properties of MimiModel in 5.23: plain class attributes
      on the subclass shadow them for the assignment, and the half is dropped as the reference means;
    * the RoPE "default" entry is the reference's for its own configs and transformers' Mimi one for Mimi's (the
      reference's reads `config.rope_theta`, which 5.23's Mimi configs keep in `rope_parameters` only);
    * the released checkpoint's flat Mimi names (`encoder.encoder.layers.*`, `encoder.encoder_transformer.*`,
      `encoder.downsample.*`) are renamed by transformers' own MimiModel conversion table, registered for the
      subclass, as it would be for a MimiModel."""
    import_qwen_tts()
    from qwen_tts.core.tokenizer_12hz import modeling_qwen3_tts_tokenizer_v2 as tokenizer_module
    from transformers import MimiConfig
    from transformers import conversion_mapping
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.mimi.modeling_mimi import MimiRotaryEmbedding

    encoder_cls = tokenizer_module.Qwen3TTSTokenizerV2Encoder
    reference_init = _reference_rope_init()

    def default_rope(config, device=None, seq_len=None, layer_type=None):
        if isinstance(config, MimiConfig):
            return MimiRotaryEmbedding.compute_default_rope_parameters(config, device=device)
        return reference_init(config, device)

    name = encoder_cls.__name__
    previous_rope = ROPE_INIT_FUNCTIONS.get("default")
    ROPE_INIT_FUNCTIONS["default"] = default_rope
    encoder_cls.upsample = None
    encoder_cls.decoder_transformer = None
    conversion_mapping.register_checkpoint_conversion_mapping(
        name, conversion_mapping.get_checkpoint_conversion_mapping("MimiModel"), overwrite=True)
    try:
        yield
    finally:
        del encoder_cls.upsample, encoder_cls.decoder_transformer
        conversion_mapping._checkpoint_conversion_mapping_cache.pop(name, None)
        conversion_mapping.USER_REGISTERED_MAPPINGS.discard(name)
        if previous_rope is None:
            del ROPE_INIT_FUNCTIONS["default"]
        else:
            ROPE_INIT_FUNCTIONS["default"] = previous_rope


def reference_tokenizer(folder):
    """(the reference tokenizer wrapper `Qwen3TTSTokenizer` on a speech-tokenizer folder, loading info of the
    whole `Qwen3TTSTokenizerV2Model` from that folder). The wrapper is what the reference voice-clone prompt encodes
    reference audio with: feature extractor, then `Qwen3TTSTokenizerV2Model.encode`, after its own transformers-5
    fix-ups (RoPE buffers, and Mimi attention over the whole clip as transformers 4.57.3 computed it)."""
    import_qwen_tts()
    from qwen_tts.core import Qwen3TTSTokenizerV2Model
    from qwen_tts.inference.qwen3_tts_tokenizer import Qwen3TTSTokenizer

    with reference_tokenizer_loading():
        _, info = Qwen3TTSTokenizerV2Model.from_pretrained(str(folder), output_loading_info=True)
        wrapper = Qwen3TTSTokenizer.from_pretrained(str(folder))
    wrapper.model.eval()
    return wrapper, info


def reference_model(folder):
    """The reference `Qwen3TTSForConditionalGeneration` built from a checkpoint folder's config.json (a Base config
    builds its speaker encoder) with the folder's model.safetensors loaded strictly."""
    from safetensors.torch import load_file

    import_qwen_tts()
    from qwen_tts.core.models import configuration_qwen3_tts, modeling_qwen3_tts

    config = configuration_qwen3_tts.Qwen3TTSConfig.from_pretrained(str(folder))
    with reference_rope():
        model = modeling_qwen3_tts.Qwen3TTSForConditionalGeneration(config).eval()
    model.load_state_dict(load_file(str(folder / "model.safetensors")), strict=True)
    return model


def transformers_slaney_mel(*, sr, n_fft, n_mels, fmin=0.0, fmax=None):
    """What `librosa.filters.mel` returns (Slaney scale and norm), from transformers' own `mel_filter_bank`, an
    implementation independent of ours: the reference speaker-encoder mel (`modeling_qwen3_tts.librosa_mel_fn`,
    a stand-in in tests) is monkeypatched with it where a test runs `extract_speaker_embedding`."""
    from transformers.audio_utils import mel_filter_bank

    return mel_filter_bank(n_fft // 2 + 1, n_mels, fmin, sr / 2 if fmax is None else fmax, sr,
                           norm="slaney", mel_scale="slaney").T.astype("float32")
