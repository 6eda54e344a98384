"""step-audio2==1.0.0's utils.py (the upstream spectrogram and placeholder count), importable without its
torchaudio and librosa: load_audio (torchaudio) is never called here, and librosa's mel filter bank is answered by
transformers' (slaney, the same bank)."""
from __future__ import annotations

import importlib.util
import sys
import types

from cosyvoice_frontend_oracle import _librosa_mel
from cosyvoice_oracle import ORACLES, _stand_in


def load_utils() -> types.ModuleType:
    if "step_audio2_utils" in sys.modules:
        return sys.modules["step_audio2_utils"]
    if "librosa.filters" not in sys.modules:
        librosa = sys.modules.get("librosa") or _stand_in("librosa")
        librosa.__path__ = []
        librosa.filters = _stand_in("librosa.filters", mel=_librosa_mel)
    if "torchaudio" not in sys.modules:
        _stand_in("torchaudio")
    spec = importlib.util.spec_from_file_location("step_audio2_utils", ORACLES / "step_audio2" / "utils.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["step_audio2_utils"] = module  # a name of its own: upstream calls it utils
    spec.loader.exec_module(module)
    return module
