"""Qwen3-TTS Base (voice cloning) against the reference (qwen-tts-hf): the tiny Base checkpoint that voxbackend
writes (without the reference) loads into the reference classes strictly: `Qwen3TTSForConditionalGeneration`
(which builds the ECAPA-TDNN speaker encoder for a Base config) and the whole 12 Hz tokenizer
`Qwen3TTSTokenizerV2Model`, Mimi encoder included.

Speaker encoder: our log mel equals the reference `mel_spectrogram` (its librosa filter bank answered by
transformers' own Slaney `mel_filter_bank`, an implementation independent of ours) and our ECAPA-TDNN x-vector
equals `extract_speaker_embedding` on the tiny random weights within 1e-5 (measured: bit-identical, the same ops in
the same order; the embeddings spread over tens of units, std about 15, so the bound is tight).

Reference codes: our Qwen3TTSEncoder (the Mimi encoder loaded from the speech tokenizer) gives exactly the codes of
the reference tokenizer wrapper's `encode` (feature extractor + `Qwen3TTSTokenizerV2Model.encode`), for partial
last frames and for a clip past Mimi's 250-step (10 s) window, where the reference attends to the whole clip.

Voice-clone front end: Qwen3TTSVoiceClone.clone gives the reference `Qwen3TTSModel.create_voice_clone_prompt`'s
ref_code (exactly) and ref_spk_embedding (1e-5) for float clips and WAV files at 24 kHz (the reference's
resampler is librosa's, not installed here: other rates are checked against our own resampling, which
test_mimi_encoder measures); every bad clip is refused naming reference_audio.
"""
from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch

from qwen_tts_oracle import import_qwen_tts, reference_model, reference_tokenizer, transformers_slaney_mel
from voxbackend.components.speaker.ecapa_tdnn import EcapaConfig, EcapaTdnn
from voxbackend.components.features.mel_features import slaney_mel_filters, speaker_mel
from voxbackend.audio_io import resample
from voxbackend.models.qwen3_tts.codec_encoder import Qwen3TTSEncoder
from voxbackend.errors import InvalidRequest
from voxbackend.models.qwen3_tts.voice_clone import Qwen3TTSVoiceClone, VoiceClonePrompt
from voxbackend.models.qwen3_tts.tiny import write_tiny_qwen3_tts

TOL = 1e-5
EMBEDDING_RTOL = 2e-6  # of the embedding's largest value: about 16 float32 roundings (3e-7 seen)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_tiny_qwen3_tts(tmp_path_factory.mktemp("qwen3_tts_base"), variant="base", seed=5)


@pytest.fixture(scope="module")
def ref_model(base):
    return reference_model(base)


@pytest.fixture(scope="module")
def ref_tokenizer(base):
    return reference_tokenizer(base / "speech_tokenizer")


def test_base_checkpoint_loads_into_the_reference_model_strictly(base, ref_model):
    cfg = json.loads((base / "config.json").read_text())
    assert cfg["tts_model_type"] == "base" and cfg["talker_config"]["spk_id"] == {}
    se = cfg["speaker_encoder_config"]
    assert se["enc_dim"] == cfg["talker_config"]["hidden_size"] and se["sample_rate"] == 24000
    assert ref_model.speaker_encoder is not None and ref_model.speaker_encoder_sample_rate == 24000
    # load_state_dict(strict=True) passed in reference_model: every speaker-encoder tensor came from the file
    mels = torch.randn(2, 50, se["mel_dim"], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        emb = ref_model.speaker_encoder(mels)
    assert emb.shape == (2, se["enc_dim"]) and emb.std() > 0.1  # random weights: not a constant embedding
    assert (emb[0] - emb[1]).abs().max() > 0.1


def test_speech_tokenizer_loads_into_the_reference_tokenizer_strictly(base, ref_tokenizer):
    wrapper, info = ref_tokenizer
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert not info["error_msgs"]
    cfg = json.loads((base / "speech_tokenizer" / "config.json").read_text())
    assert cfg["encoder_valid_num_quantizers"] == 16 and cfg["encoder_config"]["codebook_size"] == 2048
    assert wrapper.feature_extractor.sampling_rate == 24000
    audio = torch.randn(8 * 1920, generator=torch.Generator().manual_seed(0)).clamp(-1, 1).numpy() * 0.5
    codes = wrapper.encode(audio, sr=24000).audio_codes[0]
    assert codes.shape == (8, 16) and int(codes.max()) < 2048 and len(set(codes[:, 0].tolist())) > 1
    # the loading adaptations are undone: later tests see transformers as it is
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Encoder
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert "default" not in ROPE_INIT_FUNCTIONS and "upsample" not in vars(Qwen3TTSTokenizerV2Encoder)


def test_other_variants_are_unchanged_by_base(tmp_path):
    """Base draws its speaker encoder after the talker from the same stream: the talker tensors are the same."""
    from safetensors.torch import load_file

    cv = load_file(str(write_tiny_qwen3_tts(tmp_path / "cv", variant="custom_voice", seed=1) / "model.safetensors"))
    b = load_file(str(write_tiny_qwen3_tts(tmp_path / "b", variant="base", seed=1) / "model.safetensors"))
    assert set(b) - set(cv) == {k for k in b if k.startswith("speaker_encoder.")}
    assert all(torch.equal(cv[k], b[k]) for k in cv)
    with pytest.raises(ValueError, match="variant"):
        write_tiny_qwen3_tts(tmp_path / "x", variant="clone")


# ---------------------------------------------------------------- speaker encoder


def voiced(samples: int, seed: int, rate: int = 24000) -> np.ndarray:
    """A vowel-like clip: a few harmonics of a gliding pitch under a syllable-rate envelope, plus breath noise."""
    g = np.random.default_rng(seed)
    t = np.arange(samples) / rate
    f0 = g.uniform(90, 260) * (1 + 0.15 * np.sin(2 * np.pi * g.uniform(0.5, 2) * t))
    phase = 2 * np.pi * np.cumsum(f0) / rate
    tone = sum(g.uniform(0.1, 1) / k * np.sin(k * phase) for k in range(1, 7))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * g.uniform(2, 5) * t) ** 2
    clip = 0.3 * envelope * tone + 0.02 * g.standard_normal(samples)
    return (0.9 * clip / np.abs(clip).max()).astype(np.float32)


@pytest.fixture
def reference_mel(monkeypatch):
    """The reference modeling module with librosa.filters.mel (a stand-in in tests) answered by transformers."""
    import_qwen_tts()
    from qwen_tts.core.models import modeling_qwen3_tts

    monkeypatch.setattr(modeling_qwen3_tts, "librosa_mel_fn", transformers_slaney_mel)
    return modeling_qwen3_tts


def test_speaker_mel_equals_reference(reference_mel):
    ours_bank = slaney_mel_filters(24000, 1024, 128, 0.0, 12000.0).numpy()
    np.testing.assert_allclose(ours_bank, transformers_slaney_mel(sr=24000, n_fft=1024, n_mels=128, fmax=12000),
                               rtol=0, atol=1e-7)
    for samples in (24000, 24000 * 2 + 137, 1280):
        audio = voiced(samples, seed=samples)
        ours = speaker_mel(torch.from_numpy(audio))
        theirs = reference_mel.mel_spectrogram(torch.from_numpy(audio)[None], n_fft=1024, num_mels=128,
                                               sampling_rate=24000, hop_size=256, win_size=1024, fmin=0,
                                               fmax=12000)[0].T
        assert ours.shape == theirs.shape == (samples // 256, 128)
        assert (ours - theirs).abs().max() < TOL


@pytest.fixture(scope="module")
def ecapa(base):
    return EcapaTdnn.from_checkpoint(base)


def test_speaker_embedding_equals_reference(ecapa, ref_model, reference_mel):
    embeddings = []
    for samples in (1280, 24000 - 1, 24000 * 3 + 500, 24000 * 7):
        audio = voiced(samples, seed=samples + 1)
        ours = ecapa.embed(torch.from_numpy(audio))
        theirs = ref_model.extract_speaker_embedding(audio, 24000)
        assert ours.shape == theirs.shape == (64,) and ours.dtype == torch.float32
        # values reach ~50, so float32 rounding alone is ~6e-6 per op; AVX2 and AVX-512 kernels round differently
        error = (ours - theirs).abs().max() / theirs.abs().max()
        assert error < EMBEDDING_RTOL, error
        embeddings.append(ours)
    e = torch.stack(embeddings)
    assert e.std() > 0.5  # spread over units, so 1e-5 is tight
    assert torch.cdist(e, e).fill_diagonal_(1e9).min() > 0.1  # different clips, different voices


def test_speaker_encoder_defaults_are_the_references():
    """A released config.json may state only some fields: the others must default as in the reference."""
    import_qwen_tts()
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSSpeakerEncoderConfig

    ref = Qwen3TTSSpeakerEncoderConfig()
    ours = EcapaConfig()
    for name in vars(ours):
        want = getattr(ref, name)
        assert getattr(ours, name) == (tuple(want) if isinstance(want, list) else want), name
    assert EcapaConfig.from_dict({"enc_dim": 2048, "unknown": 1}) == EcapaConfig(enc_dim=2048)
    with pytest.raises(ValueError, match="aggregation width"):
        EcapaConfig(enc_channels=(32, 32, 32, 32, 90))
    with pytest.raises(ValueError, match="divide"):
        EcapaConfig(enc_channels=(32, 36, 36, 36, 108))


def test_speaker_encoder_refuses_what_it_cannot_embed(ecapa, base, tmp_path):
    with pytest.raises(ValueError, match="needs 1280"):
        ecapa.embed(torch.zeros(1279))
    cv = write_tiny_qwen3_tts(tmp_path / "cv", variant="custom_voice")
    with pytest.raises(ValueError, match="not a Qwen3-TTS Base"):
        EcapaTdnn.from_checkpoint(cv)


# ---------------------------------------------------------------- reference codes


@pytest.fixture(scope="module")
def encoder(base):
    return Qwen3TTSEncoder.from_pretrained(base)  # the checkpoint folder: finds speech_tokenizer/


def test_reference_codes_equal_reference_tokenizer(encoder, ref_tokenizer):
    wrapper, _ = ref_tokenizer
    for samples in (1, 1920, 1921, 24000 * 3 + 7, 24000 * 12):
        audio = voiced(samples, seed=samples + 2) if samples > 1 else np.full(1, 0.5, np.float32)
        ours = encoder.encode(torch.from_numpy(audio))
        theirs = wrapper.encode(audio, sr=24000).audio_codes[0]
        assert ours.dtype == torch.int64 and ours.shape == (-(-samples // 1920), 16)
        assert torch.equal(ours, theirs), (samples, (ours != theirs).float().mean().item())


def test_reference_codes_attend_to_the_whole_clip(encoder, base):
    """Past 250 transformer steps (10 s) a sliding-window Mimi gives other codes: the comparison above can fail."""
    from voxbackend.components.mimi.encoder import MimiEncoder
    from voxbackend.components.mimi.weights import read_codec_tensors

    cfg = json.loads((base / "speech_tokenizer" / "config.json").read_text())["encoder_config"]
    windowed = MimiEncoder(cfg)
    windowed.load_hf_weights(read_codec_tensors(base / "speech_tokenizer", "encoder."))
    audio = torch.from_numpy(voiced(24000 * 12, seed=9))
    ours, short = encoder.encode(audio), windowed.encode(audio[None, None], 16)[0].T
    assert torch.equal(ours[:125], short[:125])  # inside the window both see the same steps
    assert (ours != short).float().mean() > 0.01


def test_reference_encoder_refuses_bad_input(encoder, tmp_path):
    for bad in (torch.zeros(0), torch.zeros(2, 1920)):
        with pytest.raises(ValueError, match="mono"):
            encoder.encode(bad)
    with pytest.raises(ValueError, match="at most"):
        encoder.encode(torch.zeros(encoder.max_samples + 1))
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_tts_tokenizer_12hz"}')
    with pytest.raises(ValueError, match="no encoder_config"):
        Qwen3TTSEncoder.from_pretrained(tmp_path)


# ---------------------------------------------------------------- voice-clone front end


@pytest.fixture(scope="module")
def front(base):
    return Qwen3TTSVoiceClone.from_pretrained(base)


@pytest.fixture
def reference_prompt(ref_model, ref_tokenizer, reference_mel):
    """The reference Qwen3TTSModel wrapper around the reference model and tokenizer: its create_voice_clone_prompt
    (processor unused there)."""
    from qwen_tts.inference.qwen3_tts_model import Qwen3TTSModel

    ref_model.load_speech_tokenizer(ref_tokenizer[0])
    wrapper = Qwen3TTSModel(ref_model, processor=None)

    def prompt(audio):
        item, = wrapper.create_voice_clone_prompt(ref_audio=audio, ref_text="a transcript", x_vector_only_mode=False)
        return item

    return prompt


def wav_bytes(audio: np.ndarray, rate: int, subtype: str = "FLOAT") -> bytes:
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, audio, rate, format="WAV", subtype=subtype)
    return buf.getvalue()


def test_voice_clone_equals_reference_prompt(front, reference_prompt):
    for samples in (1920, 24000 * 2 + 333, 24000 * 11):
        audio = voiced(samples, seed=samples + 3)
        ours, theirs = front.clone(audio, 24000), reference_prompt((audio, 24000))
        assert isinstance(ours, VoiceClonePrompt) and not ours.codes.is_inference()
        assert torch.equal(ours.codes, theirs.ref_code)
        assert (ours.x_vector - theirs.ref_spk_embedding).abs().max() < TOL
    # a 16-bit stereo WAV file: both read it with libsndfile and average the channels
    stereo = np.stack([voiced(24000, seed=1), voiced(24000, seed=2)], axis=1)
    data = wav_bytes(stereo, 24000, "PCM_16")
    ours, theirs = front.clone(data), reference_prompt("data:audio/wav;base64," + base64.b64encode(data).decode())
    assert torch.equal(ours.codes, theirs.ref_code) and ours.codes.shape == (13, 16)
    assert (ours.x_vector - theirs.ref_spk_embedding).abs().max() < TOL


def _glide(seconds: float, rate: int) -> np.ndarray:
    """One continuous signal sampled at any rate (a gliding vowel, harmonics under 3 kHz): resampling it should
    give what sampling it at the new rate gives."""
    t = np.arange(int(seconds * rate)) / rate
    phase = 2 * np.pi * (140 * t - 140 * 0.1 / (2 * np.pi * 1.3) * np.cos(2 * np.pi * 1.3 * t))
    clip = sum(0.5 / k * np.sin(k * phase) for k in range(1, 8)) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t) ** 2)
    return (0.25 * clip).astype(np.float32)


def test_other_rates_are_resampled_once_for_both_encoders(front):
    native = front.clone(_glide(2.0, 24000), 24000)
    for rate in (16000, 44100, 48000):
        clip = _glide(2.0, rate)
        ours = front.clone(clip, rate)
        at_24k = front.clone(resample(clip, rate, 24000), 24000)
        assert torch.equal(ours.codes, at_24k.codes) and torch.equal(ours.x_vector, at_24k.x_vector)
        assert ours.codes.shape == native.codes.shape == (25, 16)
        # measured: x-vectors 0.25-0.4 % apart, codes all equal (the resampler is -80 dB, not exact)
        gap = (ours.x_vector - native.x_vector).norm() / native.x_vector.norm()
        assert gap < 1e-2, (rate, gap)
        assert (ours.codes != native.codes).float().mean() < 0.05


@pytest.mark.parametrize("audio, rate, match", [
    (b"RIFF\x00\x00 not a wav file", None, "not a readable audio file"),
    (b"", None, "is empty"),
    (np.zeros(0, np.float32), 24000, "is empty"),
    (np.zeros(1919, np.float32), 24000, "at least 80 ms"),
    (np.zeros(1279, np.float32), 16000, "at least 80 ms"),  # 1919 samples at 24 kHz
    (np.zeros(30 * 24000 + 1, np.float32), 24000, "limit is 30 s"),
    (np.zeros(30 * 16000 + 1, np.float32), 16000, "limit is 30 s"),
    (np.full(4000, np.nan, np.float32), 24000, "NaN"),
    (np.zeros(4000, np.float32), None, "need a sample_rate"),
    (np.zeros((2, 4000), np.float32), 24000, "mono"),
    (np.zeros(4000, np.int16), 24000, "float32"),
    (np.zeros(4000, np.float32), 7, "sample_rate must be"),
    ("a string", 24000, "must be audio file bytes"),
])
def test_bad_reference_audio_is_refused(front, audio, rate, match):
    with pytest.raises(InvalidRequest, match=match) as err:
        front.clone(audio, rate)
    assert err.value.field == "reference_audio"


def test_limits_and_checkpoints(front, base, tmp_path):
    assert front.clone(np.zeros(30 * 24000, np.float32), 24000).codes.shape == (375, 16)  # silence is a clip
    assert front.clone(np.zeros(1920, np.float32), 24000).codes.shape == (1, 16)
    short = Qwen3TTSVoiceClone.from_pretrained(base, max_reference_s=2.0)
    with pytest.raises(InvalidRequest, match="limit is 2 s"):
        short.clone(np.zeros(2 * 24000 + 1, np.float32), 24000)
    with pytest.raises(ValueError, match="past the encoder"):
        Qwen3TTSVoiceClone.from_pretrained(base, max_reference_s=1000.0)
    with pytest.raises(ValueError, match="not a Qwen3-TTS Base"):
        Qwen3TTSVoiceClone.from_pretrained(write_tiny_qwen3_tts(tmp_path / "vd", variant="voice_design"))
