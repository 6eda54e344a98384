"""Import the CosyVoice2 front-end references (test oracles) without torchaudio, onnx or librosa.

scripts/setup_env.sh installs them `--no-deps --target` into folders under the venv (like the decoder oracles in
tests/cosyvoice_oracle.py), so the server never imports them:
- `s3tokenizer==0.3.0`: the S3 tokenizer v2 torch model and its log-mel. Its utils import torchaudio (only for
  loading/resampling files) and onnx (only for converting checkpoints) at import time: stand-ins, never called.
- `chatterbox-tts==0.1.7`: its `xvector.py` is the CAMPPlus torch class (FunASR's copy of 3D-Speaker's); it is
  loaded as a single file, since the package's __init__ pulls its whole TTS stack. Its torchaudio import serves
  only `extract_feature`, which the tests do not call.
- Matcha-TTS's `mel_spectrogram` (upstream CosyVoice2's feat_extractor, in the cosyvoice oracle folder): its
  librosa import serves only `filters.mel`; the stand-in answers it with transformers' own Slaney filter bank
  (`transformers.audio_utils.mel_filter_bank`), an implementation independent of ours.
"""
from __future__ import annotations

import importlib.util
import sys
import types

from cosyvoice_oracle import ORACLES, _on_path, _stand_in


def load_s3tokenizer() -> types.ModuleType:
    with _on_path("s3tokenizer"):
        if "torchaudio" not in sys.modules:
            _stand_in("torchaudio")
        if "onnx" not in sys.modules:
            _stand_in("onnx")
        import s3tokenizer
    return s3tokenizer


def _load_file(name: str, path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_campplus_reference() -> types.ModuleType:
    """chatterbox's xvector module (class CAMPPlus)."""
    with _on_path("chatterbox"):
        if "torchaudio.compliance.kaldi" not in sys.modules:
            torchaudio = sys.modules.get("torchaudio") or _stand_in("torchaudio")
            torchaudio.__path__ = []
            torchaudio.compliance = _stand_in("torchaudio.compliance")
            torchaudio.compliance.__path__ = []
            torchaudio.compliance.kaldi = _stand_in("torchaudio.compliance.kaldi")
        return _load_file("chatterbox_xvector", ORACLES / "chatterbox/chatterbox/models/s3gen/xvector.py")


def _librosa_mel(*, sr, n_fft, n_mels, fmin=0.0, fmax=None):
    from transformers.audio_utils import mel_filter_bank

    return mel_filter_bank(n_fft // 2 + 1, n_mels, fmin, sr / 2 if fmax is None else fmax, sr,
                           norm="slaney", mel_scale="slaney").T.astype("float32")


def load_matcha_audio() -> types.ModuleType:
    """matcha.utils.audio (mel_spectrogram), with librosa.filters.mel answered by transformers."""
    with _on_path("scipy", "cosyvoice"):
        if "librosa.filters" not in sys.modules:
            librosa = _stand_in("librosa")
            librosa.__path__ = []
            librosa.filters = _stand_in("librosa.filters", mel=_librosa_mel)
        return _load_file("matcha_audio", ORACLES / "cosyvoice/matcha/utils/audio.py")
