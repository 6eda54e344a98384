"""step-audio2==1.0.0's token2wav.py (`Token2wav`: set_stream_cache + stream) as a test oracle, run on the CPU on
tiny modules: the upstream DiT flow (tests/step_audio2_flow_oracle.py) and flashcosyvoice's HiFT.

Its __init__ (s3tokenizer / campplus ONNX models, hyperpyyaml, `.cuda()`) never runs: `upstream_token2wav` builds
the object with object.__new__ and sets what the stream path reads, the prompt given directly as the
`cache[prompt_wav]` entry `_prepare_prompt` would make. Module-level imports the stream path never calls get
stand-ins (torchaudio + .compliance.kaldi, s3tokenizer, onnxruntime, hyperpyyaml, librosa.filters for
flashcosyvoice.utils.audio). The module is loaded under a name of its own (upstream calls it `token2wav`).

`stream_on_cpu` runs `Token2wav.stream` unchanged with the module's `torch` and `np` globals swapped, for the call,
for proxies: `torch.tensor(..., device='cuda')` / `torch.zeros(..., device='cuda')` land on the CPU,
`torch.amp.autocast('cuda')` is a no-op (float32 either way), and `np.clip`, which the method applies to the final
float speech before the int16 conversion, records its input: the float audio upstream computed, captured from its
own code path.
"""
from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from unittest import mock

import numpy as np
import torch
from cosyvoice_oracle import ORACLES, _on_path, _stand_in
from step_audio2_flow_oracle import load_step_flow

MODULE_NAME = "step_audio2_token2wav"


def _stand_ins() -> None:
    for name in ("s3tokenizer", "onnxruntime"):
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            _stand_in(name)
    if "hyperpyyaml" not in sys.modules and importlib.util.find_spec("hyperpyyaml") is None:
        _stand_in("hyperpyyaml", load_hyperpyyaml=None)
    if "torchaudio.compliance.kaldi" not in sys.modules:
        torchaudio = sys.modules.get("torchaudio") or _stand_in("torchaudio")
        torchaudio.__path__ = getattr(torchaudio, "__path__", [])
        torchaudio.compliance = _stand_in("torchaudio.compliance", __path__=[])
        torchaudio.compliance.kaldi = _stand_in("torchaudio.compliance.kaldi")
    if "librosa.filters" not in sys.modules:
        librosa = sys.modules.get("librosa") or _stand_in("librosa")
        librosa.__path__ = []
        librosa.filters = _stand_in("librosa.filters", mel=None)


def load_token2wav_module() -> types.ModuleType:
    if MODULE_NAME in sys.modules:
        return sys.modules[MODULE_NAME]
    load_step_flow()        # the cosyvoice2 flow package, with its own stand-ins
    _stand_ins()
    with _on_path("scipy", "step_audio2"):
        spec = importlib.util.spec_from_file_location(MODULE_NAME, ORACLES / "step_audio2" / "token2wav.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[MODULE_NAME] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[MODULE_NAME]
            raise
    return module


def flash_hift(hift_state: dict, base_channels: int, f0_channels: int) -> torch.nn.Module:
    """flashcosyvoice's HiFTGenerator (what Token2wav uses) at tiny widths, hift_state loaded strictly."""
    module = load_token2wav_module()
    from flashcosyvoice.modules.hifigan import ConvRNNF0Predictor

    with torch.random.fork_rng():
        hift = module.HiFTGenerator(base_channels=base_channels,
                                    f0_predictor=ConvRNNF0Predictor(cond_channels=f0_channels))
    hift.load_state_dict(hift_state, strict=True)
    return hift.eval()


def upstream_token2wav(flow: torch.nn.Module, hift: torch.nn.Module, prompt_key: str, prompt_tokens: torch.Tensor,
                       prompt_mel: torch.Tensor, embedding: torch.Tensor, mel_cache_len: int = 8):
    """A Token2wav without __init__: the stream attributes set as __init__ would (on the CPU), and the prompt
    (tokens (P,), mel (2P, mel), speaker (spk,)) as _prepare_prompt's cache entry for prompt_key."""
    module = load_token2wav_module()
    t2w = object.__new__(module.Token2wav)
    t2w.float16 = False
    t2w.flow, t2w.hift = flow, hift
    t2w.mel_cache_len = mel_cache_len
    t2w.source_cache_len = int(mel_cache_len * 480)
    t2w.speech_window = torch.from_numpy(np.hamming(2 * t2w.source_cache_len))
    t2w.hift_cache_dict = {}
    t2w.stream_cache = None
    t2w.cache = {prompt_key: (prompt_tokens[None].int(), torch.tensor([len(prompt_tokens)], dtype=torch.int32),
                              embedding[None], prompt_mel[None],
                              torch.tensor([len(prompt_mel)], dtype=torch.int32))}
    return t2w


class _CpuTorch:
    """The `torch` the upstream module sees during a call: device='cuda' dropped, autocast a no-op."""

    amp = types.SimpleNamespace(autocast=lambda *args, **kwargs: contextlib.nullcontext())

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def tensor(*args, device=None, **kwargs):
        return torch.tensor(*args, **kwargs)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, **kwargs)


class _RecordingNumpy:
    def __init__(self):
        self.clipped: list[np.ndarray] = []

    def __getattr__(self, name):
        return getattr(np, name)

    def clip(self, a, *args, **kwargs):
        self.clipped.append(np.array(a, copy=True))
        return np.clip(a, *args, **kwargs)


@contextlib.contextmanager
def on_cpu():
    """While it lasts, the upstream module runs on the CPU; yields the recorder of the float speech."""
    module = load_token2wav_module()
    recorder = _RecordingNumpy()
    with mock.patch.object(module, "torch", _CpuTorch()), mock.patch.object(module, "np", recorder):
        yield recorder


def set_stream_cache_on_cpu(t2w, prompt_key: str) -> None:
    with on_cpu():
        t2w.set_stream_cache(prompt_key)


def stream_on_cpu(t2w, tokens: list[int], prompt_key: str, last_chunk: bool) -> tuple[torch.Tensor, bytes]:
    """One `Token2wav.stream` call: (its float speech before quantisation, (samples,) float32; its PCM bytes)."""
    with on_cpu() as recorder:
        pcm = t2w.stream(tokens, prompt_key, last_chunk=last_chunk)
    (speech,) = recorder.clipped
    return torch.from_numpy(speech).reshape(-1), pcm
