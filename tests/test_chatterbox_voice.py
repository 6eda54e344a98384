"""Chatterbox's voice front end against its reference (`chatterbox-tts==0.1.7`, tests/chatterbox_voice_oracle.py
lists what is stood in), on random weights loaded unchanged by both sides (offline, CPU).

- VoiceEncoder (reference sizes): embeddings equal upstream `VoiceEncoder.embeds_from_wavs` on 16 kHz clips
  (silence trimming, partial windows, the coverage rule), and its mel equals upstream `melspectrogram`.
- clone() equals upstream `ChatterboxTTS.prepare_conditionals` run on the tiny checkpoint's networks (S3Gen's real
  `embed_ref`): speaker_emb, T3 prompt tokens, S3Gen prompt tokens / mel / x-vector; librosa's load/resample and
  torchaudio's Resample are answered by our resampler, so both sides see the same 24 and 16 kHz samples.
- conds.pt: ours loads in upstream `Conditionals.load`, upstream's loads in ours; refusals name their field;
  named voices are cached, stored and loaded without a clip; no name and no clip is the built-in voice.
"""
from __future__ import annotations

import io
import json
import shutil
from dataclasses import replace

import numpy as np
import pytest
import soundfile as sf
import torch
from safetensors.torch import save_file

from chatterbox_voice_oracle import load_chatterbox_voice, prepare_conditionals, s3_tokenizer
from voxbackend.errors import InvalidRequest
from voxbackend.models.chatterbox.tiny_voice import INPUT_GAIN, tiny_voice
from voxbackend.models.chatterbox.voice import ChatterboxVoice, VoiceCloner
from voxbackend.models.chatterbox.voice_encoder import VoiceEncoder, VoiceEncoderConfig, trim_silence
from voxbackend.models.tiny_weights import perturb_default_inits

pytestmark = pytest.mark.usefixtures("one_thread")  # small tensors: see conftest


def speechlike(seconds: float, rate: int, seed: int, quiet: tuple[float, float] = (0.0, 0.0)) -> np.ndarray:
    """Tone bursts of random pitch and loudness over noise, 1/8 s each, between near-silent lead and tail."""
    g = np.random.default_rng(seed)
    n = rate // 8
    t = np.arange(n) / rate
    parts = [g.uniform(0.05, 0.4) * np.sin(2 * np.pi * g.uniform(80, 3000) * t) + g.uniform(0.0, 0.1) *
             g.standard_normal(n) for _ in range(round(seconds * 8))]
    lead, tail = (1e-3 * g.standard_normal(int(s * rate)) for s in quiet)
    return np.concatenate([lead, *parts, tail]).astype(np.float32)


def wav_bytes(audio: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, audio, rate, format="WAV", subtype="FLOAT")
    return buf.getvalue()


@pytest.fixture(scope="module")
def up():
    return load_chatterbox_voice()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chatterbox_voice")
    config, ve, s3gen = tiny_voice(seed=0)
    (folder / "voice.json").write_text(json.dumps(config))
    save_file(ve, str(folder / "ve.safetensors"))
    save_file(s3gen, str(folder / "s3gen.safetensors"))
    return folder


@pytest.fixture(scope="module")
def cloner(folder) -> VoiceCloner:
    return VoiceCloner.from_folder(folder)


@pytest.fixture(scope="module")
def reference(up, cloner):
    """Upstream VoiceEncoder, S3Tokenizer and CAMPPlus at the tiny sizes, holding the tiny checkpoint's weights."""
    ve_cfg, tok, spk = cloner.cfg.voice_encoder, cloner.cfg.tokenizer, cloner.cfg.speaker
    hp = up.config.VoiceEncConfig()
    hp.ve_hidden_size, hp.speaker_embed_size = ve_cfg.hidden, ve_cfg.embed_size
    ve = up.voice_encoder.VoiceEncoder(hp)
    ve.load_state_dict(cloner.encoder.state_dict(), strict=True)
    tokenizer = s3_tokenizer(up, tok.n_mels, tok.hidden, tok.heads, tok.layers)
    missing, unexpected = tokenizer.load_state_dict(cloner.tokenizer.state_dict(), strict=False)
    assert sorted(missing) == ["_mel_filters", "window"] and not unexpected  # its own buffers, computed
    speaker = up.xvector.CAMPPlus(feat_dim=spk.feat_dim, embedding_size=spk.embedding_size,
                                  growth_rate=spk.growth_rate, bn_size=spk.bn_size, init_channels=spk.init_channels,
                                  memory_efficient=False)
    speaker.load_state_dict(cloner.speaker.state_dict(), strict=True)
    return ve.eval(), tokenizer.eval(), speaker.eval()


# ---------------------------------------------------------------- VoiceEncoder


def test_voice_encoder_equals_embeds_from_wavs(up):
    torch.manual_seed(0)
    theirs = up.voice_encoder.VoiceEncoder()  # the reference sizes
    with torch.no_grad():
        perturb_default_inits(theirs, torch.Generator().manual_seed(1))
        theirs.lstm.weight_ih_l0.mul_(INPUT_GAIN)  # so the embedding depends on the clip (see tiny_voice)
    ours = VoiceEncoder(VoiceEncoderConfig())
    ours.load_state_dict(theirs.state_dict(), strict=True)
    theirs.eval(), ours.eval()
    clips = [speechlike(1.3, 16000, seed=1),                       # one partial, zero padded
             speechlike(3.5, 16000, seed=2, quiet=(0.7, 0.5)),     # silence trimmed at both ends
             speechlike(7.3, 16000, seed=3)]                       # the last partial dropped (coverage < 0.8)
    trimmed = trim_silence(clips[1], 20.0).size
    assert trimmed == up.librosa.effects.trim(clips[1], top_db=20)[0].size < clips[1].size - 16000
    embeds = []
    for clip in clips:
        expected = torch.from_numpy(theirs.embeds_from_wavs([clip], sample_rate=16000)[0])
        got = ours.embed(clip)
        assert got.shape == (256,)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        embeds.append(got)
    assert (embeds[0] - embeds[1]).abs().max() > 1e-2  # the embedding depends on the clip
    assert VoiceEncoderConfig().frame_step == 77 and VoiceEncoderConfig().partials(731) == (8, 699)
    mel = up.melspec.melspectrogram(clips[2], theirs.hp).T
    torch.testing.assert_close(ours.mel(torch.from_numpy(clips[2])), torch.from_numpy(mel), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- clone() vs prepare_conditionals


def assert_same_voice(voice: ChatterboxVoice, conds, odd_frame: bool = False) -> None:
    t3, gen = conds.t3, conds.gen
    p = voice.prompt_tokens.numel()
    torch.testing.assert_close(voice.speaker_emb, t3.speaker_emb[0], rtol=0, atol=1e-5)
    assert voice.cond_tokens.tolist() == t3.cond_prompt_speech_tokens[0].tolist()
    assert voice.prompt_tokens.tolist() == gen["prompt_token"][0].tolist() and gen["prompt_token_len"].item() == p
    assert gen["prompt_feat"].shape[1] == 2 * p + odd_frame  # upstream keeps an odd trailing frame; we drop it
    torch.testing.assert_close(voice.prompt_feat, gen["prompt_feat"][0, : 2 * p], rtol=0, atol=1e-5)
    # CAMPPlus's fbank: ours in float64, kaldi-native-fbank's in float32
    torch.testing.assert_close(voice.xvector, gen["embedding"][0], rtol=1e-3, atol=1e-3)


def test_clone_equals_prepare_conditionals(up, cloner, reference, tmp_path):
    # 11.5 s at 24 kHz: T3's prompt sees 6 s (150 tokens), S3Gen's 10 s; the VoiceEncoder all of it, trimmed
    clip = speechlike(10.5, 24000, seed=4, quiet=(0.6, 0.4))
    (tmp_path / "long.wav").write_bytes(wav_bytes(clip, 24000))
    voice = cloner.clone(clip, 24000)
    conds = prepare_conditionals(up, tmp_path / "long.wav", *reference)
    assert voice.cond_tokens.numel() == 150 and voice.prompt_tokens.numel() == 250
    assert voice.prompt_feat.shape == (500, 80) and voice.xvector.shape == (192,)
    assert_same_voice(voice, conds)
    assert len(set(voice.cond_tokens.tolist())) > 20  # the tiny tokenizer uses many codes: equality is not trivial

    # 2.625 s at 22.05 kHz (62995 samples at 24 kHz): 131 mel frames for 66 tokens, cut to 65 (embed_ref's rule)
    short = wav_bytes(speechlike(2.625, 22050, seed=5), 22050)
    (tmp_path / "short.wav").write_bytes(short)
    voice = cloner.clone(short, None)
    conds = prepare_conditionals(up, tmp_path / "short.wav", *reference)
    assert voice.prompt_tokens.numel() == 65 and voice.cond_tokens.numel() == 66
    assert_same_voice(voice, conds, odd_frame=True)

    # upstream's conds.pt of that clip reads as upstream's voice, its odd frame dropped
    conds.save(tmp_path / "conds.pt")
    stored = ChatterboxVoice.from_conds(tmp_path / "conds.pt")
    t3, gen = conds.t3, conds.gen
    assert torch.equal(stored.speaker_emb, t3.speaker_emb[0]) and torch.equal(stored.xvector, gen["embedding"][0])
    assert stored.cond_tokens.tolist() == t3.cond_prompt_speech_tokens[0].tolist()
    assert stored.prompt_tokens.tolist() == gen["prompt_token"][0].tolist()
    assert torch.equal(stored.prompt_feat, gen["prompt_feat"][0, :130]) and not stored.xvector.requires_grad


# ---------------------------------------------------------------- conds.pt and voice files


def test_conds_round_trip(up, cloner, tmp_path):
    voice = cloner.clone(speechlike(1.5, 16000, seed=6), 16000)
    voice.to_conds(tmp_path / "conds.pt", exaggeration=0.7)
    conds = up.tts.Conditionals.load(tmp_path / "conds.pt")  # torch.load(weights_only=True), as upstream
    t3, gen = conds.t3, conds.gen
    p = voice.prompt_tokens.numel()
    assert t3.speaker_emb.shape == (1, 256) and t3.clap_emb is None and t3.cond_prompt_speech_emb is None
    assert t3.cond_prompt_speech_tokens.dtype == torch.long and t3.cond_prompt_speech_tokens.shape == (1, 38)
    assert t3.emotion_adv.shape == (1, 1, 1) and t3.emotion_adv.item() == pytest.approx(0.7)
    assert gen["prompt_token"].shape == (1, p) and gen["prompt_token"].dtype == torch.long
    assert gen["prompt_token_len"].tolist() == [p] and gen["prompt_feat_len"] is None
    assert gen["prompt_feat"].shape == (1, 2 * p, 80) and gen["embedding"].shape == (1, 192)
    again = ChatterboxVoice.from_conds(tmp_path / "conds.pt")
    voice.save(tmp_path / "v.safetensors")
    loaded = ChatterboxVoice.load(tmp_path / "v.safetensors")
    for name, value in voice.tensors().items():
        assert torch.equal(getattr(again, name), value) and torch.equal(getattr(loaded, name), value), name
        assert getattr(loaded, name).dtype == value.dtype
    with pytest.raises(ValueError, match="not 2 frames"):
        ChatterboxVoice(voice.speaker_emb, voice.cond_tokens, voice.prompt_tokens, voice.prompt_feat[:-1],
                        voice.xvector)


@pytest.mark.parametrize("seconds, words", [(0.9, "1 to 30 s"), (30.5, "the limit is 30 s")])
def test_clip_length_is_refused_naming_reference_audio(cloner, seconds, words):
    before = cloner.computed
    with pytest.raises(InvalidRequest) as e:
        cloner.voice(None, np.zeros(int(seconds * 16000), np.float32) + 0.01, 16000)
    assert e.value.field == "reference_audio" and words in str(e.value)
    assert cloner.computed == before
    assert (VoiceCloner.MIN_REFERENCE_S, VoiceCloner.MAX_REFERENCE_S) == (1.0, 30.0)


def test_named_voices(folder, tmp_path):
    shutil.copytree(folder, tmp_path / "ckpt")
    cloner = VoiceCloner.from_folder(tmp_path / "ckpt")
    with pytest.raises(InvalidRequest) as e:
        cloner.voice()  # no conds.pt in this checkpoint
    assert e.value.field == "voice"
    for bad in ("nobody", "../etc/passwd"):
        with pytest.raises(InvalidRequest) as e:
            cloner.voice(bad)
        assert e.value.field == "voice" and bad in str(e.value)

    alice = cloner.voice("alice", wav_bytes(speechlike(1.5, 44100, seed=7), 44100))
    assert cloner.computed == 1 and cloner.voice("alice") is alice and cloner.computed == 1
    assert cloner.voice("alice", speechlike(2.0, 16000, seed=8), 16000) is alice  # a name is an identity
    cloner.save_voice("alice", alice)
    alice.to_conds(tmp_path / "ckpt" / "conds.pt")

    fresh = VoiceCloner.from_folder(tmp_path / "ckpt")  # a new server: alice from her file, the built-in voice
    assert fresh.stored_voices() == ["alice"]
    stored, builtin = fresh.voice("alice"), fresh.voice()
    assert fresh.computed == 0 and fresh.voice() is builtin
    for name, value in alice.tensors().items():
        assert torch.equal(getattr(stored, name), value) and torch.equal(getattr(builtin, name), value), name


def test_voice_cache_is_bounded(cloner):
    small = VoiceCloner(replace(cloner.cfg, max_cached_voices=1), cloner.encoder, cloner.tokenizer, cloner.speaker)
    clip = speechlike(1.0, 16000, seed=9)
    small.voice("a", clip, 16000)
    small.voice("b", clip, 16000)
    assert small.voice("b") is not None
    with pytest.raises(InvalidRequest) as e:
        small.voice("a")  # evicted, and never stored
    assert e.value.field == "voice"

