"""Mimi encoder (codes equal transformers' MimiModel.encode), request audio reading / resampling, and CSM context
segments given as a waveform (the prompt equals the one built from transformers' codes)."""
import io

import numpy as np
import pytest
import soundfile as sf
import torch

from voxbackend import InvalidRequest
from voxbackend.audio_io import read_audio, resample
from voxbackend.components.mimi.encoder import MimiEncoder
from voxbackend.models.csm.model import ContextSegment

import transformers  # noqa: E402

# the latents are compared bit for bit; at one intra-op thread (the run's, conftest) one case differs
pytestmark = pytest.mark.usefixtures("default_threads")


@pytest.fixture(scope="module")
def tiny_mimi(tmp_path_factory):
    from voxbackend.components.mimi.tiny import write_tiny_mimi

    return write_tiny_mimi(tmp_path_factory.mktemp("tiny_mimi"), seed=3)


@pytest.fixture(scope="module")
def ref_mimi(tiny_mimi):
    return transformers.MimiModel.from_pretrained(str(tiny_mimi)).eval()


@pytest.fixture(scope="module")
def csm(tiny_csm):
    from voxbackend.models.csm.model import Csm

    return Csm(tiny_csm)


def _noise(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.3


def _wav(audio: np.ndarray, rate: int, fmt: str = "WAV", subtype: str = "FLOAT") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, audio, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


# ---------------------------------------------------------------- encoder vs transformers

@pytest.mark.parametrize("samples", [1920 * 3, 1920 * 4 - 500, 1920 * 25 + 7, 1])
def test_encode_equals_transformers(tiny_mimi, ref_mimi, samples):
    """Whole frames, a partial last frame, past the 10-step transformer window, a single sample; batch of 2."""
    enc = MimiEncoder.from_pretrained(tiny_mimi)
    audio = _noise(samples, 2, 1, samples)
    with torch.inference_mode():
        want = ref_mimi.encode(audio, num_quantizers=32).audio_codes
        want_latents = ref_mimi.encoder(audio).latents
    got = enc.encode(audio)
    assert got.shape == want.shape == (2, 32, enc.num_frames(samples)) and got.dtype == torch.long
    assert torch.equal(enc.latents(audio), want_latents)  # bit for bit, so no argmin tie can differ
    assert torch.equal(got, want)
    with torch.inference_mode():
        assert torch.equal(enc.encode(audio, 8), ref_mimi.encode(audio, num_quantizers=8).audio_codes)


def test_nested_weight_names_and_csm_prefix(tiny_mimi, ref_mimi, tiny_csm):
    """transformers 5.x's in-memory names (encoder.encoder_seanet.*, ...) load too, and the codec inside a CSM
    checkpoint (codec_model.*) encodes like CsmForConditionalGeneration's own codec."""
    audio = _noise(1, 1, 1, 1920 * 6 + 100)
    enc = MimiEncoder(MimiEncoder.from_pretrained(tiny_mimi).config)
    enc.load_hf_weights(ref_mimi.state_dict())
    assert any(k.startswith("encoder.encoder_seanet.") for k in ref_mimi.state_dict())
    with torch.inference_mode():
        assert torch.equal(enc.eval().encode(audio), ref_mimi.encode(audio).audio_codes)
        ref_csm = transformers.CsmForConditionalGeneration.from_pretrained(str(tiny_csm)).eval()
        want = ref_csm.codec_model.encode(audio).audio_codes
    assert torch.equal(MimiEncoder.from_pretrained(tiny_csm, prefix="codec_model.").encode(audio), want)


def test_decoded_audio_encodes_to_as_many_frames(tiny_mimi):
    """The encoder pairs with our decoder: n frames decode to n * 1920 samples, which encode to n frames."""
    from voxbackend.components.mimi.decoder import MimiDecoder

    enc, dec = MimiEncoder.from_pretrained(tiny_mimi), MimiDecoder.from_pretrained(tiny_mimi)
    audio = dec.decode(enc.encode(_noise(2, 1, 1, 1920 * 5)))
    assert audio.shape == (1, 1, 1920 * 5) and enc.encode(audio).shape == (1, 32, 5)


def test_encode_rejects_bad_shapes(tiny_mimi):
    enc = MimiEncoder.from_pretrained(tiny_mimi)
    for bad in (torch.zeros(1920), torch.zeros(1, 2, 1920), torch.zeros(1, 1, 0)):
        with pytest.raises(ValueError, match="audio must be"):
            enc.encode(bad)
    with pytest.raises(ValueError, match="num_quantizers"):
        enc.encode(torch.zeros(1, 1, 1920), 33)


# ---------------------------------------------------------------- read_audio

def test_read_audio_float_and_files():
    x = (np.sin(np.arange(24000) * 0.05) * 0.5).astype(np.float32)
    assert np.array_equal(read_audio(x, 24000, 24000), x)                  # same rate: untouched
    assert np.array_equal(read_audio(x[None], 24000, 24000), x)            # [1, n]
    assert np.array_equal(read_audio(x[:, None].astype(np.float64), 24000, 24000), x)
    assert np.array_equal(read_audio(_wav(x, 24000), None, 24000), x)      # float WAV is lossless
    assert np.array_equal(read_audio(_wav(x, 24000), 24000, 24000), x)
    pcm = read_audio(_wav(x, 24000, subtype="PCM_16"), None, 24000)
    assert pcm.dtype == np.float32 and np.abs(pcm - x).max() < 1e-4
    flac = read_audio(_wav(x, 24000, "FLAC", "PCM_16"), None, 24000)
    assert np.abs(flac - x).max() < 1e-4
    stereo = read_audio(_wav(np.stack([x, 0 * x], 1), 24000), None, 24000)  # channels averaged
    assert np.allclose(stereo, x / 2)
    triton = np.array([_wav(x, 24000)], dtype=object)                      # a Triton BYTES tensor
    assert np.array_equal(read_audio(triton, None, 24000), x)


@pytest.mark.parametrize("src, dst, freq", [(16000, 24000, 440.0), (16000, 24000, 5000.0), (44100, 24000, 1000.0),
                                            (48000, 24000, 7000.0), (24000, 16000, 2000.0), (8000, 24000, 3000.0)])
def test_resampling_keeps_frequency(src, dst, freq):
    x = np.sin(2 * np.pi * freq * np.arange(2 * src) / src).astype(np.float32)
    y = read_audio(_wav(x, src), None, dst) if src == 16000 else read_audio(x, src, dst)
    assert y.dtype == np.float32 and len(y) == 2 * dst
    spectrum = np.abs(np.fft.rfft(y * np.hanning(len(y))))
    assert abs(np.argmax(spectrum) * dst / len(y) - freq) <= 0.5
    inner = slice(dst // 10, len(y) - dst // 10)  # away from the zero-padded ends
    want = np.sin(2 * np.pi * freq * np.arange(len(y)) / dst)
    assert np.abs(y[inner] - want[inner]).max() < 1e-3


def test_resampling_removes_what_the_new_rate_cannot_hold():
    x = np.sin(2 * np.pi * 14000 * np.arange(96000) / 48000).astype(np.float32)  # above 12 kHz Nyquist
    y = resample(x, 48000, 24000)
    assert np.abs(y[2400:-2400]).max() < 1e-3
    assert len(resample(np.ones(7, np.float32), 16000, 24000)) == 11  # ceil(7 * 3 / 2)


@pytest.mark.parametrize("data, rate, match", [
    (b"RIFF\x00\x00 this is not a wav file at all", None, "not a readable audio file"),
    ("hello".encode() * 50, None, "not a readable audio file"),
    (b"", None, "is empty"),
    (np.zeros(0, np.float32), 24000, "is empty"),
    (np.array([0.1, np.nan, 0.2], np.float32), 24000, "NaN or infinite"),
    (np.array([0.1, np.inf], np.float32), 24000, "NaN or infinite"),
    (np.zeros(24000 * 3, np.float32), 24000, r"3.00 s; the limit is 2 s"),
    (np.zeros(1000, np.int16), 24000, "must be float32"),
    (np.zeros(1000, np.complex64), 24000, "must be float32"),
    (np.zeros((2, 1000), np.float32), 24000, "must be mono"),
    (np.zeros((1, 1, 1000), np.float32), 24000, "must be mono"),
    (np.zeros(1000, np.float32), None, "need a sample_rate"),
    (np.zeros(1000, np.float32), 0, "sample_rate must be an integer"),
    (np.zeros(1000, np.float32), 16000.5, "sample_rate must be an integer"),
    (np.zeros(1000, np.float32), True, "sample_rate must be an integer"),
    ("WAV@16k", 24000, "the file says 16000 Hz but sample_rate=24000"),
    ([0.0, 0.1], 24000, "must be audio file bytes or a float32 array"),
])
def test_read_audio_bad_input(data, rate, match):
    if isinstance(data, str) and data == "WAV@16k":
        data = _wav(np.zeros(1600, np.float32), 16000)
    with pytest.raises(InvalidRequest, match=match):
        read_audio(data, rate, 24000, max_seconds=2, field="ctx")


# ---------------------------------------------------------------- CSM context audio

def test_csm_waveform_context_equals_codes_context(csm, tiny_csm):
    ref = transformers.CsmForConditionalGeneration.from_pretrained(str(tiny_csm)).eval()
    audio = _noise(7, 1920 * 4 - 500)
    with torch.inference_mode():
        codes = ref.codec_model.encode(audio[None, None]).audio_codes[0].T.numpy()  # [frames, 32]
    text = "The quick brown fox."
    want = csm.prepare(text, 1, context=[ContextSegment("I am well.", 0, codes)])
    x = audio.numpy()
    assert csm.prepare(text, 1, context=[ContextSegment("I am well.", 0, audio=x)]) == want
    assert csm.prepare(text, 1, context=[ContextSegment("I am well.", 0, audio=x, sample_rate=24000)]) == want
    assert csm.prepare(text, 1, context=[{"text": "I am well.", "speaker": 0, "audio": _wav(x, 24000)}]) == want
    # a 16 kHz clip is resampled first: the same as encoding its 24 kHz resampling
    x16 = _noise(8, 16000).numpy()
    with torch.inference_mode():
        codes16 = ref.codec_model.encode(torch.from_numpy(resample(x16, 16000, 24000))[None, None])
    assert csm.prepare(text, 1, context=[ContextSegment("Hi.", 2, audio=_wav(x16, 16000))]) == csm.prepare(
        text, 1, context=[ContextSegment("Hi.", 2, codes16.audio_codes[0].T.numpy())])


@pytest.mark.parametrize("seg, match", [
    (ContextSegment("Before.", 0, audio=b"not audio at all, just some bytes"), r"context\[0\].audio is not a readable"),
    (ContextSegment("Before.", 0, audio=np.zeros(0, np.float32)), r"context\[0\].audio is empty"),
    (ContextSegment("Before.", 0, audio=np.full(100, np.nan, np.float32)), r"context\[0\].audio contains NaN"),
    (ContextSegment("Before.", 0, audio=np.zeros(100, np.int16)), r"context\[0\].audio: raw samples must be float"),
    (ContextSegment("Before.", 0, np.zeros((3, 32), int), audio=np.zeros(100, np.float32)), "exactly one of"),
    (ContextSegment("Before.", 0), "exactly one of"),
    ({"text": "Before.", "speaker": 0, "wave": np.zeros(100, np.float32)}, "unknown keys"),
    (ContextSegment("Before.", 12, audio=np.zeros(100, np.float32)), r"context\[0\].speaker"),
    ("too long", r"context\[0\].audio is .* s; the limit is"),
])
def test_csm_bad_context_audio(csm, seg, match):
    if seg == "too long":
        seconds = csm.spec.geometry.max_context / 12.5 + 1
        seg = ContextSegment("Before.", 0, audio=np.zeros(int(seconds * 24000), np.float32))
    with pytest.raises(InvalidRequest, match=match):
        csm.prepare("Hi.", 0, context=[seg])
