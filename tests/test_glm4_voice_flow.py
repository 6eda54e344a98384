"""GLM-4-Voice's speech decoder (voxbackend.models.glm4_voice.codec: CosyVoice 1's flow + 22.05 kHz HiFT, streamed
block by block) against upstream CosyVoice's modules driven as GLM-4-Voice drives them (tests/
glm4_voice_flow_oracle.py), on tiny random weights written here and loaded, unchanged, by both sides.

The randomness is the flow's initial noise and HiFT's excitation noise: upstream reseeds torch with 42 at every
flow call and draws both from it, ours draws both from a generator seeded the same, request by request.
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from glm4_voice_flow_oracle import (
    END,
    glm_flow_inference,
    glm_serving_blocks,
    glm_stream,
    upstream_decoder,
    upstream_frames,
    weight_normed,
)

from voxbackend.components.flow_hift.conformer_encoder import ConformerConfig
from voxbackend.components.flow_hift.hift import HiFTGenerator
from voxbackend.components.flow_hift.length_regulator import nearest_source
from voxbackend.components.flow_hift.unet_estimator import UNetConfig
from voxbackend.components.flow_hift.xvec_flow import XvecFlow, XvecFlowConfig, XvecFlowRow
from voxbackend.models.glm4_voice.codec import (
    GLM4_VOICE_HIFT,
    CodecConfig,
    Glm4VoiceCodec,
    decoder_config,
    load_decoder,
)
from voxbackend.models.tiny_weights import perturb_default_inits

ATOL = 1e-4

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest

TINY = CodecConfig(
    flow=XvecFlowConfig(vocab_size=300, encoder=ConformerConfig(size=64, heads=2, linear_units=64, num_blocks=2),
                        decoder=UNetConfig(channels=(32, 32), attention_head_dim=16, n_blocks=1, num_mid_blocks=1,
                                           num_heads=2)),
    hift=replace(GLM4_VOICE_HIFT, base_channels=32, f0_channels=32),
    block_sizes=(6, 7))


@pytest.fixture(scope="module")
def states():
    """(flow state, hift state as upstream stores it): random weights, norms and biases away from their inits."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        flow, hift = XvecFlow(TINY.flow), HiFTGenerator(TINY.hift)
    generator = torch.Generator().manual_seed(1)
    perturb_default_inits(flow, generator)
    perturb_default_inits(hift, generator)
    with torch.no_grad():
        # ISTFT log-magnitudes near 4 with small swings: audio around 0.1, rarely clipped
        half = TINY.hift.n_fft // 2 + 1
        hift.conv_post.weight.mul_(0.05)
        hift.conv_post.bias.zero_()
        hift.conv_post.bias[:half] = 4.0
        # f0 around 60 Hz with wide swings: voiced (> 10 Hz) and unvoiced frames
        hift.f0_predictor.classifier.weight.mul_(2000.0)
        hift.f0_predictor.classifier.bias.fill_(60.0)
    return dict(flow.state_dict()), weight_normed(hift.state_dict(), TINY.hift)


@pytest.fixture(scope="module")
def ours(states, tmp_path_factory) -> Glm4VoiceCodec:
    folder = tmp_path_factory.mktemp("glm4_voice_decoder")
    torch.save(states[0], folder / "flow.pt")
    torch.save(states[1], folder / "hift.pt")
    (folder / CodecConfig.CONFIG_NAME).write_text(json.dumps(TINY.to_dict()))
    assert decoder_config(folder) == TINY
    return load_decoder(folder)


@pytest.fixture(scope="module")
def upstream(states):
    return upstream_decoder(TINY, *states)


def test_config_defaults_are_the_released_decoders(tmp_path):
    assert decoder_config(tmp_path) == CodecConfig()    # the released folder has no codec.json
    cfg = CodecConfig.from_dict({"hift": {"base_channels": 32}, "block_sizes": [6, 7]})
    assert cfg.hift == replace(GLM4_VOICE_HIFT, base_channels=32) and cfg.block_sizes == (6, 7)
    assert (cfg.sample_rate, cfg.hift.samples_per_frame, cfg.flow.encoder.block_size) == (22050, 256, 10)
    with pytest.raises(ValueError, match="unknown"):
        CodecConfig.from_dict({"flow": {"encoder": {"chunk_size": 25}}})


def test_frame_counts_and_interpolation_are_upstreams():
    assert TINY.flow.frames(list(range(1, 3000))) == [upstream_frames(n) for n in range(1, 3000)]
    assert TINY.mel_overlap == 34
    n_in = torch.arange(1, 80)
    n_out = torch.tensor(TINY.flow.frames(n_in.tolist())) + torch.arange(79) % 3 - 1   # odd ratios too
    got = nearest_source(n_in, n_out, int(n_out.max()))
    for i, (a, b) in enumerate(zip(n_in.tolist(), n_out.tolist())):
        want = F.interpolate(torch.arange(a, dtype=torch.float32)[None, None], size=b, mode="nearest")
        assert torch.equal(got[i, :b], want[0, 0].long())


def test_flow_batch_equals_upstream_alone(ours, upstream):
    """Rows of different lengths in one call: no prompt, a prompt mel shorter than its tokens' frames (as GLM's
    later blocks get), a speaker vector."""
    g = torch.Generator().manual_seed(5)
    vocab = TINY.flow.vocab_size
    cases = [(0, 0, 13, False), (9, upstream_frames(9) - 30, 7, False), (14, upstream_frames(14) - 34 + 2, 12, True)]
    rows, wants = [], []
    for n_prompt, n_feat, n_new, speaker in cases:
        prompt = torch.randint(0, vocab, (n_prompt,), generator=g)
        tokens = torch.randint(0, vocab, (n_new,), generator=g)
        feat = torch.randn(n_feat, 80, generator=g)
        embedding = torch.randn(192, generator=g) if speaker else torch.zeros(192)
        rows.append(XvecFlowRow(torch.cat([prompt, tokens]), feat, embedding, torch.Generator().manual_seed(42)))
        with torch.random.fork_rng():
            wants.append(glm_flow_inference(upstream[0], tokens[None], prompt[None], feat[None], embedding[None])[0])
    for got, want in zip(ours.flow(rows), wants):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_hift_equals_upstream(ours, upstream):
    g = torch.Generator().manual_seed(6)
    mel = torch.randn(2, 80, 30, generator=g)
    cache = [None, 0.1 * torch.randn(1, 256, generator=g)]
    speech, source = ours.hift(mel, [torch.Generator().manual_seed(s) for s in (7, 8)], cache)
    for i, seed in enumerate((7, 8)):
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            cached = torch.zeros(1, 1, 0) if cache[i] is None else cache[i][None]
            want_speech, want_source = upstream[1].inference(mel[i:i + 1], cache_source=cached)
        torch.testing.assert_close(source[i], want_source[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(speech[i], want_speech[0], atol=ATOL, rtol=0)


def test_block_schedule_is_web_demos(ours):
    """The released block sizes; the LM's tokens arrive one at a time, then the reply ends. The state moves on
    as decode moves it."""
    cfg = replace(TINY, block_sizes=CodecConfig().block_sizes)
    codec = Glm4VoiceCodec(cfg, ours.flow, ours.hift)
    for n in (1, 24, 25, 26, 75, 76, 176, 525, 526, 1000):
        state, got = codec.new_state(), []
        for token in list(range(n)) + [END]:
            if token == END:
                state.end()
            else:
                state.push([token])
            while (block := codec.next_block(state)) is not None:
                got.append((block.end - block.start, block.final))
                state.offset, state.blocks, state.done = block.end, state.blocks + 1, block.final
        assert got == [(len(b), final) for b, final in glm_serving_blocks(list(range(n)) + [END], cfg.block_sizes)]
    assert got[:6] == [(25, False), (50, False), (100, False), (150, False), (200, False), (200, False)]


def run_replies(codec: Glm4VoiceCodec, replies: list[list[int]], starts: list[int], rates: list[int]):
    """A simulated LM: reply i starts at step starts[i] and yields rates[i] tokens a step; each step, every reply
    with a block due joins one batched decode. Returns each reply's chunks and the batches' block indices."""
    states = [codec.new_state() for _ in replies]
    chunks: list[list[torch.Tensor]] = [[] for _ in replies]
    step, batches = 0, []
    while not all(s.done for s in states):
        for i, (tokens, s) in enumerate(zip(replies, states)):
            if step >= starts[i] and not s.ended:
                k = (step - starts[i]) * rates[i]
                s.push(tokens[k:k + rates[i]])
                if k + rates[i] >= len(tokens):
                    s.end()
        due = [(i, b) for i, s in enumerate(states) if (b := codec.next_block(s)) is not None]
        if due:
            batches.append([(states[i].blocks, b.final) for i, b in due])
            for (i, _), audio in zip(due, codec.decode([states[i] for i, _ in due], [b for _, b in due])):
                chunks[i].append(audio)
        step += 1
    return chunks, batches


def test_streamed_replies_batched_equal_upstream_serving(ours, upstream):
    """Three replies streamed in at different rates, their blocks batched as they fall due (first blocks with
    later ones, final with non-final), each equal to upstream serving that reply alone."""
    g = torch.Generator().manual_seed(9)
    # 6 tokens: one full block, final; 11: a block and a final one; 21: the last size repeats, a 1-token final
    replies = [torch.randint(0, TINY.flow.vocab_size, (n,), generator=g).tolist() for n in (11, 6, 21)]
    got, batches = run_replies(ours, replies, starts=[0, 0, 0], rates=[1, 1, 2])
    assert any(0 in {k for k, _ in batch} and len({k for k, _ in batch}) > 1 for batch in batches), \
        "first blocks batched with later ones"
    assert any(len({f for _, f in batch}) > 1 for batch in batches), "final blocks batched with others"
    for tokens, chunks in zip(replies, got):
        want = glm_stream(*upstream, TINY, tokens)
        assert [len(c) for c in chunks] == [len(w) for w in want]
        for c, w in zip(chunks, want):
            torch.testing.assert_close(c, w, atol=ATOL, rtol=0)
    audio = torch.cat(got[2])
    assert 0.01 < audio.std() < 0.5 and (audio.abs() >= TINY.hift.audio_limit).float().mean() < 0.01


def test_reply_without_audio_ends_silently(ours):
    state = ours.new_state()
    state.end()
    block = ours.next_block(state)
    assert block.final and block.start == block.end == 0
    assert ours.decode([state], [block])[0].numel() == 0 and state.done and ours.next_block(state) is None
