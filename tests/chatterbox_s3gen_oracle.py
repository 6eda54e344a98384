"""Import Chatterbox's S3Gen (`chatterbox-tts==0.1.7`'s `models/s3gen`, a test oracle) without its front end's
dependencies.

`s3gen.py` imports torchaudio (no build for our torch) for resampling in `embed_ref`, and its S3Tokenizer and
`utils/mel.py` import librosa for mel filter banks; the tests hand S3Gen a ready `ref_dict` and never call either,
but `S3Token2Wav.__init__` builds an S3Tokenizer, whose `__init__` asks librosa for a filter bank: the stand-in
answers with transformers' Slaney bank (tests/cosyvoice_frontend_oracle.py). The S3 tokenizer model and scipy
(HiFT's window) are the real packages from the oracle folders; diffusers, conformer, einops, omegaconf and tqdm are
installed in the venv.
"""
from __future__ import annotations

import sys
import types

from chatterbox_oracle import chatterbox_package
from cosyvoice_frontend_oracle import _librosa_mel, load_s3tokenizer
from cosyvoice_oracle import _on_path, _stand_in


def _librosa_stand_in() -> None:
    if "librosa.filters" in sys.modules:
        return
    librosa = sys.modules.get("librosa") or _stand_in("librosa")
    librosa.__path__ = []
    librosa.filters = _stand_in("librosa.filters", mel=_librosa_mel)


def _torchaudio_stand_in() -> None:
    # xvector.py imports torchaudio.compliance.kaldi (fbank for CAMPPlus from audio; never called here)
    if "torchaudio.compliance.kaldi" in sys.modules:
        return
    torchaudio = sys.modules.get("torchaudio") or _stand_in("torchaudio")
    torchaudio.__path__ = []
    torchaudio.compliance = _stand_in("torchaudio.compliance")
    torchaudio.compliance.__path__ = []
    torchaudio.compliance.kaldi = _stand_in("torchaudio.compliance.kaldi")


def load_s3gen() -> types.SimpleNamespace:
    """The S3Gen modules: s3gen (S3Token2Wav), flow_matching (CausalConditionalCFM), hifigan, decoder."""
    load_s3tokenizer()
    with _on_path("scipy", "chatterbox"):
        chatterbox_package()
        _torchaudio_stand_in()
        _librosa_stand_in()
        from chatterbox.models.s3gen import decoder, flow, flow_matching, hifigan, s3gen
    return types.SimpleNamespace(s3gen=s3gen, S3Token2Wav=s3gen.S3Token2Wav, flow=flow, flow_matching=flow_matching,
                                 hifigan=hifigan, decoder=decoder)
