"""Import Chatterbox's voice front end (`chatterbox-tts==0.1.7`, a test oracle): VoiceEncoder, its melspec, the
S3Tokenizer subclass, S3Gen's `embed_ref` and `ChatterboxTTS.prepare_conditionals` itself.

Their imports we do not have are stood in (none of them is what the tests compare):
- librosa (not installed):
  - `filters.mel`: transformers' `mel_filter_bank` (Slaney), as tests/cosyvoice_frontend_oracle.py does;
  - `stft`: numpy framing (centred, padded by pad_mode) and `np.fft.rfft` under scipy's periodic Hann window;
  - `effects.trim`: a numpy transcription of librosa 0.11's trim (per-frame RMS of zero-padded centred frames,
    dB against the loudest frame);
  - `load` / `resample`: voxbackend.audio_io (ours), so both sides start from the same 24 and 16 kHz samples.
- torchaudio (no build for our torch): `transforms.Resample` -> voxbackend.audio_io.resample (same reason);
  `compliance.kaldi.fbank` -> kaldi-native-fbank (CAMPPlus's input; Kaldi's defaults, no dither).
- perth (the watermarker, built only by ChatterboxTTS.__init__, which the tests never call) and onnx: empty.
"""
from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import torch

from chatterbox_oracle import chatterbox_package
from cosyvoice_frontend_oracle import _librosa_mel
from cosyvoice_oracle import _on_path, _stand_in


def _module(name: str, package: bool = False, **attrs) -> types.ModuleType:
    """The stand-in already made (by this or another oracle loader) or a new one; missing attributes added."""
    module = sys.modules.get(name) or _stand_in(name)
    if package and not hasattr(module, "__path__"):
        module.__path__ = []
    for key, value in attrs.items():
        if not hasattr(module, key):
            setattr(module, key, value)
    parent, _, child = name.rpartition(".")
    if parent and not hasattr(sys.modules[parent], child):
        setattr(sys.modules[parent], child, module)
    return module


def _stft(y, *, n_fft, hop_length=None, win_length=None, center=True, pad_mode="constant", window="hann"):
    from scipy.signal import get_window

    assert window == "hann" and (win_length or n_fft) == n_fft
    hop_length = hop_length or n_fft // 4
    y = np.asarray(y)
    if center:
        y = np.pad(y, n_fft // 2, mode=pad_mode)
    frames = np.lib.stride_tricks.sliding_window_view(y, n_fft)[::hop_length]
    spec = np.fft.rfft(frames * get_window("hann", n_fft, fftbins=True), axis=-1).T
    return spec.astype(np.complex64 if y.dtype == np.float32 else np.complex128)


def _trim(y, *, top_db=60, frame_length=2048, hop_length=512, **_):
    padded = np.pad(y, frame_length // 2, mode="constant")
    frames = np.lib.stride_tricks.sliding_window_view(padded, frame_length)[::hop_length]
    rms = np.sqrt(np.mean(np.abs(frames) ** 2, axis=-1))
    amin = 1e-5
    db = 10 * np.log10(np.maximum(amin ** 2, rms ** 2)) - 10 * np.log10(np.maximum(amin ** 2, rms.max() ** 2))
    loud = np.flatnonzero(db > -top_db)
    if not loud.size:
        return y[..., :0], np.asarray([0, 0])
    start, end = int(loud[0] * hop_length), min(y.shape[-1], int((loud[-1] + 1) * hop_length))
    return y[..., start:end], np.asarray([start, end])


def _load(path, *, sr=22050, **_):
    from voxbackend.audio_io import read_audio

    return read_audio(Path(path).read_bytes(), None, sr), sr


def _resample(y, *, orig_sr, target_sr, **_):
    from voxbackend.audio_io import resample

    return resample(np.asarray(y, dtype=np.float32), orig_sr, target_sr)


class _Resample(torch.nn.Module):
    def __init__(self, orig_freq: int, new_freq: int):
        super().__init__()
        self.rates = orig_freq, new_freq

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        rows = [_resample(row.detach().cpu().float().numpy(), orig_sr=self.rates[0], target_sr=self.rates[1])
                for row in wav.reshape(-1, wav.size(-1))]
        return torch.from_numpy(np.stack(rows)).reshape(*wav.shape[:-1], -1)


def _fbank(waveform: torch.Tensor, num_mel_bins: int = 23, **_) -> torch.Tensor:
    import kaldi_native_fbank as knf

    opts = knf.FbankOptions()
    opts.frame_opts.dither = 0.0  # torchaudio's default; every other option is Kaldi's default there too
    opts.mel_opts.num_bins = num_mel_bins
    fbank = knf.OnlineFbank(opts)
    fbank.accept_waveform(16000, waveform.reshape(-1).tolist())
    fbank.input_finished()
    return torch.tensor(np.stack([fbank.get_frame(i) for i in range(fbank.num_frames_ready)]))


def _stand_ins() -> None:
    _module("librosa", package=True, load=_load, resample=_resample, stft=_stft)
    _module("librosa.filters", mel=_librosa_mel)
    _module("librosa.effects", trim=_trim)
    _module("torchaudio", package=True)
    _module("torchaudio.transforms", Resample=_Resample)
    _module("torchaudio.compliance", package=True)
    _module("torchaudio.compliance.kaldi", fbank=_fbank)
    _module("perth")
    _module("onnx")


def load_chatterbox_voice() -> types.SimpleNamespace:
    """tts (ChatterboxTTS, Conditionals), voice_encoder (VoiceEncoder), melspec, config (VoiceEncConfig),
    s3tokenizer (S3Tokenizer), s3gen (S3Token2Mel), xvector (CAMPPlus), mel (mel_spectrogram), librosa (the
    stand-in)."""
    with _on_path("chatterbox", "s3tokenizer", "scipy"):
        _stand_ins()
        chatterbox_package()
        from chatterbox import tts
        from chatterbox.models.s3gen import s3gen, xvector
        from chatterbox.models.s3gen.utils import mel
        from chatterbox.models.s3tokenizer import s3tokenizer
        from chatterbox.models.voice_encoder import config, melspec, voice_encoder
    return types.SimpleNamespace(tts=tts, voice_encoder=voice_encoder, melspec=melspec, config=config,
                                 s3tokenizer=s3tokenizer, s3gen=s3gen, xvector=xvector, mel=mel,
                                 librosa=sys.modules["librosa"])


def s3_tokenizer(up: types.SimpleNamespace, n_mels: int, hidden: int, heads: int, layers: int) -> torch.nn.Module:
    """Chatterbox's S3Tokenizer at other sizes: its __init__ hands no config to S3TokenizerV2's, which then
    takes its default ModelConfig (the full 1280-wide model); that default is swapped for the call."""
    from s3tokenizer.model_v2 import ModelConfig, S3TokenizerV2

    cfg = ModelConfig(n_mels=n_mels, n_audio_state=hidden, n_audio_head=heads, n_audio_layer=layers)
    init = S3TokenizerV2.__init__
    saved, init.__defaults__ = init.__defaults__, (cfg,)
    try:
        return up.s3tokenizer.S3Tokenizer("speech_tokenizer_v2_25hz", cfg)
    finally:
        init.__defaults__ = saved


class _S3GenFront(torch.nn.Module):
    """The parts of S3Token2Mel that `embed_ref` reads, with upstream's own embed_ref."""

    def __init__(self, up: types.SimpleNamespace, tokenizer: torch.nn.Module, speaker_encoder: torch.nn.Module):
        super().__init__()
        self.tokenizer, self.speaker_encoder = tokenizer, speaker_encoder
        self.mel_extractor = up.mel.mel_spectrogram
        self.embed_ref = types.MethodType(up.s3gen.S3Token2Mel.embed_ref, self)

    device = property(lambda self: torch.device("cpu"))
    dtype = property(lambda self: torch.float32)


def prepare_conditionals(up: types.SimpleNamespace, wav_path, ve: torch.nn.Module, tokenizer: torch.nn.Module,
                         speaker_encoder: torch.nn.Module, exaggeration: float = 0.5):
    """Runs upstream `ChatterboxTTS.prepare_conditionals` on a stand-in `self` holding the given networks (no T3
    or flow: the recipe reads only T3's speech_cond_prompt_len and S3Gen's embed_ref); returns its Conditionals."""
    cls = up.tts.ChatterboxTTS
    front = _S3GenFront(up, tokenizer.eval(), speaker_encoder.eval())
    model = types.SimpleNamespace(
        s3gen=front, ve=ve.eval(), device="cpu", ENC_COND_LEN=cls.ENC_COND_LEN, DEC_COND_LEN=cls.DEC_COND_LEN,
        t3=types.SimpleNamespace(hp=types.SimpleNamespace(speech_cond_prompt_len=150)))
    cls.prepare_conditionals(model, str(wav_path), exaggeration=exaggeration)
    return model.conds
