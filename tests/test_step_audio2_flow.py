"""Step-Audio 2's flow (DiT estimator, V2 token encoder) against the upstream classes on the same tiny random
weights (tests/step_audio2_flow_oracle.py)."""
from __future__ import annotations

import pytest
import torch
from step_audio2_flow_oracle import tiny_config, upstream_flow

from voxbackend.components.flow_hift.dit_flow import DiTFlow, DiTFlowStream

CFG = tiny_config()


@pytest.fixture(scope="module")
def flows():
    upstream = upstream_flow(CFG, seed=1)
    ours = DiTFlow(CFG).eval()
    ours.load_state_dict(upstream.state_dict(), strict=True)
    return upstream, ours


def test_state_dict_names_and_shapes_match(flows):
    upstream, ours = flows
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in upstream.state_dict().items()}


@torch.inference_mode()
def test_encoder_matches_upstream_v2(flows):
    upstream, ours = flows
    x = torch.randn(1, 11, CFG.encoder.size)
    lengths = torch.tensor([11])
    expected, _ = upstream.encoder(x, lengths)
    got = ours.encoder(x, lengths, torch.zeros_like(lengths), torch.zeros(1, dtype=torch.bool), 11)
    assert got.shape == expected.shape == (1, 22, CFG.encoder.size)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@torch.inference_mode()
def test_estimator_matches_upstream(flows):
    """Two rows at different times; the second has 5 padded frames (the mask hides them as keys)."""
    upstream, ours = flows
    b, t = 2, 17
    x, mu, cond = (torch.randn(b, CFG.mel_bins, t) for _ in range(3))
    spks, times = torch.randn(b, CFG.mel_bins), torch.tensor([0.13, 0.71])
    mask = torch.ones(b, 1, t)
    mask[1, :, 12:] = 0
    expected = upstream.decoder.estimator(x, mask, mu, times, spks, cond)
    got = ours.decoder.estimator(x, mask, mu, times, spks, cond)
    assert expected.abs().mean() > 0.1     # the random weights give a real vector field
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def _upstream_inference(upstream, tokens, prompt_tokens, prompt_feat, embedding, noise):
    upstream.decoder.rand_noise = noise[None]
    return upstream.inference(tokens[None], torch.tensor([len(tokens)]), prompt_tokens[None],
                              torch.tensor([len(prompt_tokens)]), prompt_feat[None],
                              torch.tensor([len(prompt_feat)]), embedding[None], n_timesteps=CFG.n_timesteps)[0]


@pytest.mark.parametrize("n_prompt, n_prompt_mel", [(0, 0), (6, 12), (6, 9)], ids=["no_prompt", "prompt", "short"])
def test_whole_utterance_matches_upstream_inference(flows, n_prompt, n_prompt_mel):
    """Same tokens, prompt, speaker and noise; "short": a prompt mel shorter than its tokens' frames."""
    upstream, ours = flows
    generator = torch.Generator().manual_seed(n_prompt_mel)
    tokens = torch.randint(0, CFG.vocab_size, (9,), generator=generator)
    prompt_tokens = torch.randint(0, CFG.vocab_size, (n_prompt,), generator=generator)
    prompt_feat = torch.randn(n_prompt_mel, CFG.mel_bins, generator=generator)
    embedding = torch.randn(CFG.spk_embed_dim, generator=generator)
    noise = torch.randn(CFG.mel_bins, 40, generator=generator)
    expected = _upstream_inference(upstream, tokens, prompt_tokens, prompt_feat, embedding, noise)
    got = ours(tokens, prompt_tokens, prompt_feat, embedding, noise)
    assert got.shape == expected.shape == (CFG.mel_bins, 2 * (n_prompt + 9) - n_prompt_mel)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_generator_noise_is_drawn_for_the_whole_utterance(flows):
    """A generator gives the same mel as the (mel_bins, frames) noise it would draw, prompt frames included."""
    _, ours = flows
    tokens, prompt_tokens = torch.arange(5), torch.arange(100, 103)
    prompt_feat, embedding = torch.randn(6, CFG.mel_bins), torch.randn(CFG.spk_embed_dim)
    noise = torch.randn(CFG.mel_bins, 16, generator=torch.Generator().manual_seed(7))
    got = ours(tokens, prompt_tokens, prompt_feat, embedding, torch.Generator().manual_seed(7))
    torch.testing.assert_close(got, ours(tokens, prompt_tokens, prompt_feat, embedding, noise), atol=0, rtol=0)


def test_streaming_chunks_match_upstream_inference_chunk(flows):
    """The prompt (its first 3 tokens again as lookahead, as upstream's token2wav does) and then three chunks, the
    first two with 3 lookahead tokens: each chunk's mel against upstream setup_cache + inference_chunk."""
    upstream, ours = flows
    generator = torch.Generator().manual_seed(3)
    prompt_tokens = torch.randint(0, CFG.vocab_size, (6,), generator=generator)
    prompt_tokens = torch.cat([prompt_tokens, prompt_tokens[:3]])
    prompt_feat = torch.randn(12, CFG.mel_bins, generator=generator)
    embedding = torch.randn(CFG.spk_embed_dim, generator=generator)
    tokens = torch.randint(0, CFG.vocab_size, (13,), generator=generator)
    noise = torch.randn(CFG.mel_bins, 40, generator=generator)
    chunks = [(tokens[:5 + 3], False), (tokens[5:9 + 3], False), (tokens[9:], True)]

    upstream.decoder.rand_noise = noise[None]
    with torch.inference_mode():
        cache = upstream.setup_cache(prompt_tokens[None], prompt_feat[None], embedding[None],
                                     n_timesteps=CFG.n_timesteps)
        expected = []
        for chunk, last in chunks:
            mel, cache = upstream.inference_chunk(chunk[None], embedding[None], cache, last_chunk=last,
                                                  n_timesteps=CFG.n_timesteps)
            expected.append(mel[0].clone())
    stream = DiTFlowStream(ours, prompt_tokens, prompt_feat, embedding, noise)
    for (chunk, last), want, frames in zip(chunks, expected, (10, 8, 8)):
        got = stream(chunk, last_chunk=last)
        assert got.shape == want.shape == (CFG.mel_bins, frames)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
