"""CosyVoice2 voice-cloning front end against its references, on tiny random weights written by
voxbackend.models.cosyvoice2.tiny_cloning and loaded unchanged by every side (offline, CPU).

- S3 tokenizer v2: tokens equal `s3tokenizer==0.3.0`'s S3TokenizerV2 (padded batch and one clip); our log-mel
  equals its log_mel_spectrogram.
- CAMPPlus: embeddings equal the reference torch class (chatterbox's xvector.CAMPPlus) on the same features;
  our Kaldi fbank equals kaldi-native-fbank's.
- Prompt mel equals Matcha-TTS's mel_spectrogram (upstream's feat_extractor); the Slaney filters equal librosa's
  (the tables s3tokenizer stores) and transformers' mel_filter_bank.
- The whole clone equals the upstream recipe run on the reference pieces; voices are cached by name, stored as
  files and loaded without a clip; bad input is refused naming the field.
"""
from __future__ import annotations

import io
from dataclasses import replace

import numpy as np
import pytest
import soundfile as sf
import torch
from transformers.audio_utils import mel_filter_bank

from cosyvoice_frontend_oracle import ORACLES, load_campplus_reference, load_matcha_audio, load_s3tokenizer
from voxbackend.audio_io import resample
from voxbackend.components.features.kaldi_fbank import kaldi_fbank
from voxbackend.components.features.mel_features import flow_mel, slaney_mel_filters, whisper_log_mel
from voxbackend.errors import InvalidRequest
from voxbackend.models.cosyvoice2.cloning import VoiceCloner, VoicePrompt, load_voice_cloner
from voxbackend.models.cosyvoice2.tiny_cloning import write_tiny_cloner


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_cloner(tmp_path_factory.mktemp("cosyvoice2_frontend"), seed=0)


@pytest.fixture(scope="module")
def frontend(folder) -> VoiceCloner:
    return load_voice_cloner(folder)


@pytest.fixture(scope="module")
def reference_tokenizer(frontend):
    load_s3tokenizer()
    from s3tokenizer.model_v2 import ModelConfig, S3TokenizerV2

    cfg = frontend.cfg.tokenizer
    model = S3TokenizerV2("speech_tokenizer_v2_25hz",
                          ModelConfig(n_mels=cfg.n_mels, n_audio_state=cfg.hidden, n_audio_head=cfg.heads,
                                      n_audio_layer=cfg.layers))
    model.load_state_dict(frontend.tokenizer.state_dict(), strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def reference_campplus(frontend):
    cfg = frontend.cfg.speaker
    model = load_campplus_reference().CAMPPlus(feat_dim=cfg.feat_dim, embedding_size=cfg.embedding_size,
                                               growth_rate=cfg.growth_rate, bn_size=cfg.bn_size,
                                               init_channels=cfg.init_channels)
    model.load_state_dict(frontend.speaker.state_dict(), strict=True)
    return model.eval()


def speechlike(seconds: float, rate: int, seed: int) -> np.ndarray:
    """Tone bursts of random pitch and loudness over noise, 1/8 s each: features that change over time."""
    g = np.random.default_rng(seed)
    n = rate // 8
    t = np.arange(n) / rate
    parts = [g.uniform(0.05, 0.4) * np.sin(2 * np.pi * g.uniform(80, 3000) * t)
             + g.uniform(0.0, 0.1) * g.standard_normal(n)
             for _ in range(int(seconds * 8))]
    return np.concatenate(parts).astype(np.float32)


def knf_fbank(audio_16k: np.ndarray) -> np.ndarray:
    import kaldi_native_fbank as knf

    opts = knf.FbankOptions()
    opts.frame_opts.dither = 0.0  # upstream: kaldi.fbank(dither=0); every other option is Kaldi's default
    opts.mel_opts.num_bins = 80
    fbank = knf.OnlineFbank(opts)
    fbank.accept_waveform(16000, audio_16k.tolist())
    fbank.input_finished()
    return np.stack([fbank.get_frame(i) for i in range(fbank.num_frames_ready)])


# ---------------------------------------------------------------- features


def test_slaney_filters_equal_librosa_and_transformers():
    with np.load(ORACLES / "s3tokenizer/s3tokenizer/assets/mel_filters.npz") as stored:  # librosa.filters.mel
        for n_mels in (80, 128):
            np.testing.assert_allclose(slaney_mel_filters(16000, 400, n_mels).numpy(), stored[f"mel_{n_mels}"],
                                       rtol=0, atol=1e-7)
    ours = slaney_mel_filters(24000, 1920, 80, 0.0, 8000.0).numpy()
    theirs = mel_filter_bank(961, 80, 0.0, 8000.0, 24000, norm="slaney", mel_scale="slaney").T
    assert (ours > 0).sum(axis=1).min() >= 2  # every band covers FFT bins
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-7)


def test_whisper_log_mel_equals_s3tokenizer():
    s3tokenizer = load_s3tokenizer()
    for samples in (16000 * 3, 16000 * 2 + 123):
        audio = torch.from_numpy(speechlike(samples / 16000 + 1, 16000, seed=samples)[:samples])
        ours, theirs = whisper_log_mel(audio), s3tokenizer.log_mel_spectrogram(audio, n_mels=128)
        assert ours.shape == theirs.shape == (128, samples // 160)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_flow_mel_equals_matcha_mel_spectrogram():
    matcha = load_matcha_audio()
    for samples in (24000 * 2, 24000 + 301):
        audio = torch.from_numpy(speechlike(3, 24000, seed=samples)[:samples])
        theirs = matcha.mel_spectrogram(audio[None], n_fft=1920, num_mels=80, sampling_rate=24000, hop_size=480,
                                        win_size=1920, fmin=0, fmax=8000, center=False)[0].T  # cosyvoice2.yaml
        ours = flow_mel(audio)
        assert ours.shape == (samples // 480, 80)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_kaldi_fbank_equals_kaldi_native_fbank():
    for samples in (16000 * 2, 16000 + 399, 400):
        audio = speechlike(3, 16000, seed=samples)[:samples]
        ours, theirs = kaldi_fbank(torch.from_numpy(audio)).numpy(), knf_fbank(audio)
        assert ours.shape == theirs.shape == (1 + (samples - 400) // 160, 80)
        # knf computes in float32 (we in float64): log energies agree to ~1e-4, to ~1e-3 in near-silent bands
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=5e-3)
        assert np.abs(ours - theirs).mean() < 1e-4
    assert kaldi_fbank(torch.zeros(399)).shape == (0, 80)


# ---------------------------------------------------------------- networks


def test_s3_tokens_equal_s3tokenizer_padded_batch(frontend, reference_tokenizer):
    g = torch.Generator().manual_seed(3)
    mel = torch.randn(3, 128, 403, generator=g)
    lengths = torch.tensor([403, 257, 64])
    ours, ours_len = frontend.tokenizer.quantize(mel, lengths)
    theirs, theirs_len = reference_tokenizer.quantize(mel, lengths)
    assert ours_len.tolist() == theirs_len.tolist() == [101, 65, 16]
    for row, n in enumerate(ours_len.tolist()):
        assert ours[row, :n].tolist() == theirs[row, :n].tolist()
    assert len(set(ours[0].tolist())) > 30  # the tiny weights use many codes: equality is not trivial
    assert 0 <= int(ours.min()) and int(ours.max()) < 6561
    # padding never leaks into a row: a row alone gives the same tokens
    alone, _ = frontend.tokenizer.quantize(mel[1:2, :, :257], lengths[1:2])
    assert alone[0].tolist() == ours[1, :65].tolist()


def test_s3_tokens_of_a_waveform_equal_s3tokenizer(frontend, reference_tokenizer):
    s3tokenizer = load_s3tokenizer()
    audio = torch.from_numpy(speechlike(4, 16000, seed=1))
    mel = s3tokenizer.log_mel_spectrogram(audio, n_mels=128)
    theirs, n = reference_tokenizer.quantize(mel[None], torch.tensor([mel.size(-1)]))
    ours = frontend.tokenizer.tokenize(audio)
    assert ours.dtype == torch.int32 and ours.numel() == int(n[0]) == 100
    assert ours.tolist() == theirs[0, : int(n[0])].tolist()


def test_campplus_equals_reference_forward(frontend, reference_campplus):
    feats = []
    for seconds, seed in ((3.2, 4), (2.1, 5)):  # > 100 frames after the stride: a partial CAM segment too
        f = kaldi_fbank(torch.from_numpy(speechlike(seconds, 16000, seed)))
        feats.append(f - f.mean(dim=0, keepdim=True))
    for f in feats:
        with torch.inference_mode():
            theirs = reference_campplus(f[None])[0]
        ours = frontend.speaker.embed_features(f)
        assert ours.shape == (192,)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    a, b = (frontend.speaker.embed_features(f) for f in feats)
    assert (a - b).abs().max() > 0.1  # the tiny weights carry the input through: equality is not trivial
    # batched: equal-length rows give the same embeddings as one at a time
    pair = torch.stack([feats[0][:180], feats[1][:180]])
    with torch.inference_mode():
        torch.testing.assert_close(frontend.speaker(pair), reference_campplus(pair), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the front end


def test_clone_follows_the_upstream_recipe(frontend, reference_tokenizer, reference_campplus):
    """frontend_zero_shot on the reference pieces: tokens of the 16 kHz clip, mel of the 24 kHz clip, cut to
    2 frames per token, CAMPPlus of the mean-normalised fbank (kaldi-native-fbank here)."""
    s3tokenizer, matcha = load_s3tokenizer(), load_matcha_audio()
    clip = speechlike(2.5, 22050, seed=7)
    prompt = frontend.clone(clip, 22050, "hello there")
    audio_16k, audio_24k = (torch.from_numpy(resample(clip, 22050, 16000)),
                            torch.from_numpy(resample(clip, 22050, 24000)))
    mel = s3tokenizer.log_mel_spectrogram(audio_16k, n_mels=128)
    tokens, n_tokens = reference_tokenizer.quantize(mel[None], torch.tensor([mel.size(-1)]))
    feat = matcha.mel_spectrogram(audio_24k[None], 1920, 80, 24000, 480, 1920, 0, 8000, False)[0].T
    n = min(feat.size(0) // 2, int(n_tokens[0]))
    fbank = torch.from_numpy(knf_fbank(audio_16k.numpy()))
    with torch.inference_mode():
        embedding = reference_campplus((fbank - fbank.mean(dim=0, keepdim=True))[None])[0]
    assert prompt.transcript == "hello there"
    assert prompt.speech_tokens.tolist() == tokens[0, :n].tolist()
    torch.testing.assert_close(prompt.speech_feat, feat[: 2 * n], rtol=0, atol=1e-5)
    torch.testing.assert_close(prompt.embedding, embedding, rtol=1e-3, atol=1e-3)
    assert prompt.speech_feat.shape == (2 * prompt.speech_tokens.numel(), 80)


def wav_bytes(audio: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, audio, rate, format="WAV", subtype="FLOAT")
    return buf.getvalue()


def test_named_voice_is_computed_once_and_stored_voices_load_without_a_clip(folder, tmp_path):
    frontend = load_voice_cloner(folder)
    clip = wav_bytes(speechlike(1.5, 44100, seed=9), 44100)  # another rate: resampled to 16 and 24 kHz
    first = frontend.voice("alice", clip, transcript="hi")
    assert frontend.computed == 1
    again = frontend.voice("alice")
    assert again is first and frontend.computed == 1
    assert frontend.voice("alice", clip, transcript="hi") is first and frontend.computed == 1
    other = frontend.voice("bob", speechlike(1.0, 16000, seed=10), 16000, "yo")
    assert frontend.computed == 2 and other.speech_tokens.numel() == 25
    assert first.speech_tokens.numel() == 37  # 1.5 s: 150 log-mel frames -> 38 tokens, 75 mel frames -> 37

    path = frontend.save_voice("alice", first)
    assert path == folder / "voices" / "alice.safetensors"
    fresh = load_voice_cloner(folder)  # a new server: knows alice from the file, not bob
    assert fresh.stored_voices() == ["alice"]
    stored = fresh.voice("alice")
    assert fresh.computed == 0 and stored.transcript == "hi"
    assert torch.equal(stored.speech_tokens, first.speech_tokens) and stored.speech_tokens.dtype == torch.int32
    assert torch.equal(stored.speech_feat, first.speech_feat) and torch.equal(stored.embedding, first.embedding)
    with pytest.raises(InvalidRequest) as e:
        fresh.voice("bob")
    assert e.value.field == "voice" and "bob" in str(e.value)


def test_voice_cache_is_bounded(folder):
    loaded = load_voice_cloner(folder)
    frontend = VoiceCloner(replace(loaded.cfg, max_cached_voices=2), loaded.tokenizer, loaded.speaker)
    clip = speechlike(0.5, 16000, seed=11)
    for name in ("a", "b", "c"):
        frontend.voice(name, clip, 16000, "x")
    frontend.voice("c")
    with pytest.raises(InvalidRequest):
        frontend.voice("a")  # evicted, and never stored


@pytest.mark.parametrize("kwargs, field, words", [
    (dict(name=None, audio="clip", transcript=None), "reference_text", "transcript"),
    (dict(name="v1", audio="clip", transcript="   "), "reference_text", "transcript"),
    (dict(name=None, audio=b"RIFF not a wav", transcript="hi"), "reference_audio", "not a readable audio"),
    (dict(name=None, audio="long", transcript="hi"), "reference_audio", "the limit is 30 s"),
    (dict(name=None, audio="short", transcript="hi"), "reference_audio", "at least 0.5 s"),
    (dict(name=None, audio=None, transcript="hi"), "reference_audio", "without reference_audio"),
    (dict(name=None, audio=None, transcript=None), "voice", "voice name or a reference clip"),
    (dict(name="../etc/passwd", audio=None, transcript=None), "voice", "voice name must match"),
    (dict(name="nobody", audio=None, transcript=None), "voice", "not known"),
])
def test_bad_input_is_refused_naming_the_field(frontend, kwargs, field, words):
    clips = {"clip": speechlike(1.0, 16000, 12), "long": np.zeros(16000 * 31, np.float32),
             "short": speechlike(1.0, 16000, 13)[:4000]}
    audio = clips.get(kwargs["audio"], kwargs["audio"]) if isinstance(kwargs["audio"], str) else kwargs["audio"]
    before = frontend.computed
    with pytest.raises(InvalidRequest) as e:
        frontend.voice(kwargs["name"], audio, 16000 if isinstance(audio, np.ndarray) else None, kwargs["transcript"])
    assert e.value.field == field and words in str(e.value)
    assert frontend.computed == before


def test_voice_file_layout(tmp_path):
    prompt = VoicePrompt("transcript", torch.arange(3, dtype=torch.int32), torch.randn(6, 80), torch.randn(192))
    prompt.save(tmp_path / "v.safetensors")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "v.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == ["embedding", "speech_feat", "speech_tokens"]
        assert f.metadata() == {"transcript": "transcript"}
    bad = VoicePrompt("t", torch.arange(3, dtype=torch.int32), torch.randn(5, 80), torch.randn(192))
    bad.save(tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match="5 frames for 3 tokens"):
        VoicePrompt.load(tmp_path / "bad.safetensors")
