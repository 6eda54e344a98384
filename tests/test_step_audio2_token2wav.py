"""Step-Audio 2's streaming token2wav (voxbackend/components/flow_hift/dit_token2wav.py) against upstream
`Token2wav.set_stream_cache` + `stream` (tests/step_audio2_token2wav_oracle.py) on the same tiny random flow and
HiFT, prompt, flow noise and HiFT noise seed."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from step_audio2_flow_oracle import tiny_config, upstream_flow
from step_audio2_token2wav_oracle import flash_hift, set_stream_cache_on_cpu, stream_on_cpu, upstream_token2wav

from voxbackend.components.flow_hift.dit_flow import DiTFlow
from voxbackend.components.flow_hift.dit_token2wav import DiTToken2Wav, DiTToken2WavConfig, VoicePrompt, split_chunks
from voxbackend.components.flow_hift.hift import HiFTGenerator, fold_weight_norm
from voxbackend.models.cosyvoice2.tiny_codec import tiny_state_dicts

pytestmark = pytest.mark.usefixtures("one_thread")

FLOW_CFG = tiny_config()
CFG = DiTToken2WavConfig()
PROMPT_TOKENS = 6                       # 12 prompt mel frames: the trim keeps 12 + 100
N_TOKENS = 4 * 25 + 20                  # chunks of 25 + 3 lookahead, 25 + 3, 25 + 3, 25 + 3, then the last 20
HIFT_SEED = 11
KEY = "prompt.wav"


@pytest.fixture(scope="module")
def models():
    # stream_frames: the upstream DiT's cache buffers hold the trimmed cache (12 + 100 frames) plus a chunk
    up_flow = upstream_flow(FLOW_CFG, seed=2, stream_frames=12 + 100 + 64)
    flow = DiTFlow(FLOW_CFG).eval()
    flow.load_state_dict(up_flow.state_dict(), strict=True)
    hift_cfg, _, hift_state = tiny_state_dicts(seed=4)
    up_hift = flash_hift(hift_state, hift_cfg.hift.base_channels, hift_cfg.hift.f0_channels)
    hift = HiFTGenerator(hift_cfg.hift).eval()
    hift.load_state_dict(fold_weight_norm(hift_state, hift_cfg.hift), strict=True)
    return up_flow, up_hift, DiTToken2Wav(CFG, flow, hift)


@pytest.fixture(scope="module")
def request_data():
    g = torch.Generator().manual_seed(5)
    return dict(prompt_tokens=torch.randint(0, FLOW_CFG.vocab_size, (PROMPT_TOKENS,), generator=g),
                prompt_mel=torch.randn(2 * PROMPT_TOKENS, FLOW_CFG.mel_bins, generator=g) - 4.0,
                embedding=torch.randn(FLOW_CFG.spk_embed_dim, generator=g),
                tokens=torch.randint(0, FLOW_CFG.vocab_size, (N_TOKENS,), generator=g),
                # longer than the 12 + 100 + 56 frames a stream reads (the trim bounds its noise index), so that
                # indexing the noise by absolute frame after a trim would read other noise, not fail
                noise=torch.randn(FLOW_CFG.mel_bins, 2 * PROMPT_TOKENS + N_TOKENS * 2, generator=g))


@pytest.fixture(scope="module")
def upstream_chunks(models, request_data):
    """Upstream's float audio and PCM per chunk, and its DiT attention-cache length after each chunk."""
    up_flow, up_hift, _ = models
    r = request_data
    up_flow.decoder.rand_noise = r["noise"][None]
    t2w = upstream_token2wav(up_flow, up_hift, KEY, r["prompt_tokens"], r["prompt_mel"], r["embedding"])
    out = []
    with torch.random.fork_rng():
        torch.manual_seed(HIFT_SEED)    # upstream's HiFT draws from the global generator; nothing else does
        set_stream_cache_on_cpu(t2w, KEY)
        for start, end, last in split_chunks(N_TOKENS, CFG):
            speech, pcm = stream_on_cpu(t2w, r["tokens"][start:end].tolist(), KEY, last)
            out.append((speech, pcm, t2w.stream_cache["estimator_att_cache"].shape[4]))
    return out


def quantize(audio: torch.Tensor) -> bytes:
    """Token2wav.stream's int16 conversion."""
    return (np.clip(audio.numpy(), -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def test_chunks_are_the_reference_schedule():
    assert split_chunks(N_TOKENS, CFG) == [(0, 28, False), (25, 53, False), (50, 78, False), (75, 103, False),
                                           (100, 120, True)]
    assert split_chunks(28, CFG) == [(0, 28, True)]
    assert split_chunks(29, CFG) == [(0, 28, False), (25, 29, True)]


def test_streaming_equals_upstream_stream(models, request_data, upstream_chunks):
    """Each chunk's float audio against upstream's, captured before its int16 conversion, within 1e-4 (3 LSB of
    int16; the audio peaks near 0.55). The flows' mels agree to ~1e-6 and the HiFT on one mel to ~4e-6, but this
    tiny HiFT's F0 predictor (weights x 2000, tiny_codec.py) turns a 1e-6 mel difference into ~4e-5 of audio. The
    chunks after the third run on a trimmed attention cache (12 prompt + 100 frames kept)."""
    _, _, codec = models
    r = request_data
    state = codec.start(VoicePrompt(r["prompt_tokens"], r["prompt_mel"], r["embedding"]), r["noise"],
                        hift_seed=HIFT_SEED)
    chunks = split_chunks(N_TOKENS, CFG)
    lengths = [(50 - 8) * 480, 50 * 480, 50 * 480, 50 * 480, (8 + 40) * 480]
    audio = []
    for (start, end, last), (want, pcm, cached), length in zip(chunks, upstream_chunks, lengths):
        got = codec.decode_chunk(state, r["tokens"][start:end], last_chunk=last)
        assert got.dtype == torch.float32 and got.shape == want.shape == (length,)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        assert pcm == quantize(want)    # the captured floats are what upstream quantised
        if not last:
            assert state.key_order.numel() == cached
        audio.append(got)
    # the trim ran (after the third and fourth chunks) and bounds the cache
    assert [c for _, _, c in upstream_chunks[:4]] == [62, 112, 112, 112]
    assert state.done and state.hift_cache is None
    audio = torch.cat(audio)
    rms = audio.pow(2).mean().sqrt()
    assert 0.02 < rms < 0.5, rms        # a real signal, not silence, and not pinned at the clipping limit
    assert (audio.abs() > 0.98).float().mean() < 0.01


def test_generator_noise_and_seed_generator(models, request_data):
    """A generator draws noise_frames(prompt) frames of noise; a seeded HiFT generator equals its seed."""
    _, _, codec = models
    r = request_data
    prompt = VoicePrompt(r["prompt_tokens"], r["prompt_mel"], r["embedding"])
    frames = codec.noise_frames(prompt)
    assert frames == 2 * PROMPT_TOKENS + 100 + 2 * CFG.max_chunk_tokens
    noise = torch.randn(FLOW_CFG.mel_bins, frames, generator=torch.Generator().manual_seed(9))
    a = codec.start(prompt, torch.Generator().manual_seed(9), hift_seed=torch.Generator().manual_seed(3))
    b = codec.start(prompt, noise, hift_seed=3)
    chunk = r["tokens"][:28]
    torch.testing.assert_close(codec.decode_chunk(a, chunk), codec.decode_chunk(b, chunk), atol=0, rtol=0)


def test_rejects_bad_input(models, request_data):
    _, _, codec = models
    r = request_data
    with pytest.raises(ValueError, match="prompt mel"):
        codec.start(VoicePrompt(r["prompt_tokens"], r["prompt_mel"][:-1], r["embedding"]), r["noise"])
    with pytest.raises(ValueError, match="at least 3"):
        codec.start(VoicePrompt(r["prompt_tokens"][:2], r["prompt_mel"][:4], r["embedding"]), r["noise"])
    state = codec.start(VoicePrompt(r["prompt_tokens"], r["prompt_mel"], r["embedding"]), r["noise"])
    with pytest.raises(ValueError, match="HiFT cache"):
        codec.decode_chunk(state, r["tokens"][:6])
    codec.decode_chunk(state, r["tokens"][:5], last_chunk=True)
    with pytest.raises(RuntimeError):
        codec.decode_chunk(state, r["tokens"][:5], last_chunk=True)
