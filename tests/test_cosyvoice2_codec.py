"""CosyVoice2 detokenizer (flow matching + HiFT) parity, on tiny random weights written by
voxbackend.models.cosyvoice2.tiny_codec and loaded, unchanged, by our code and by the oracles:

- upstream CosyVoice (`cosyvoice-minicpmo`): its CosyVoice2Model drives its own streaming (`tts(stream=True)`:
  windows, hop + prompt pad, flow re-encoding, HiFT mel/source/speech cache, cross-fade, flush) and its
  non-streaming path, one request at a time;
- step-audio2's flashcosyvoice: an independent, batched flow + HiFT on the same state dicts.

Ours runs several requests at once, of different ages and prompts, batched in one flow call per step. The HiFT
excitation noise is the only randomness: both sides draw it from the same seed, request by request.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from cosyvoice_oracle import load_flashcosyvoice, upstream_cosyvoice2_model
from voxbackend.components.flow_hift.flow_matching import FlowRow
from voxbackend.components.flow_hift.token2wav import Token2Wav, load_token2wav
from voxbackend.errors import InvalidRequest
from voxbackend.models.cosyvoice2.tiny_codec import write_tiny_codec

ATOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_codec(tmp_path_factory.mktemp("tiny_cosyvoice2"), seed=0)


@pytest.fixture(scope="module")
def ours(ckpt) -> Token2Wav:
    return load_token2wav(ckpt)


@pytest.fixture(scope="module")
def upstream(ckpt, ours):
    return upstream_cosyvoice2_model(ckpt, ours.cfg)


def make_request(seed: int, prompt_len: int, n_tokens: int, vocab: int):
    g = torch.Generator().manual_seed(seed)
    return dict(prompt_tokens=torch.randint(0, vocab, (prompt_len,), generator=g),
                prompt_feat=torch.randn(2 * prompt_len, 80, generator=g),
                embedding=torch.randn(192, generator=g),
                tokens=torch.randint(0, vocab, (n_tokens,), generator=g),
                seed=1000 + seed)


def upstream_chunks(model, req, stream: bool, hop: int = 25) -> list[torch.Tensor]:
    model.token_hop_len = hop
    with torch.random.fork_rng():
        torch.manual_seed(req["seed"])      # the HiFT excitation noise is the oracle's only draw from torch's RNG
        out = model.tts(source_speech_token=req["tokens"][None].int(),
                        flow_prompt_speech_token=req["prompt_tokens"][None].int(),
                        prompt_speech_feat=req["prompt_feat"][None], flow_embedding=req["embedding"][None],
                        stream=stream)
        return [chunk["tts_speech"][0] for chunk in out]


def assert_chunks_equal(got: list[torch.Tensor], want: list[torch.Tensor]):
    assert [len(c) for c in got] == [len(c) for c in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)


def test_audio_is_a_real_signal(ours):
    """Guards the parity tests below against a degenerate tiny model (silent, or clipped everywhere)."""
    req = make_request(1, 6, 40, ours.cfg.flow.vocab_size)
    audio = ours.decode_utterance(req["prompt_tokens"], req["prompt_feat"], req["embedding"], req["tokens"], seed=1)
    assert audio.shape == (40 * 960,)
    assert 0.01 < audio.std() < 0.5
    assert (audio.abs() >= ours.cfg.hift.audio_limit).float().mean() < 0.01
    f0 = ours.hift.f0_predictor(torch.randn(1, 80, 200, generator=torch.Generator().manual_seed(0)))
    voiced = (f0 > ours.cfg.hift.nsf_voiced_threshold).float().mean()
    assert 0.05 < voiced < 0.95, "the tiny f0 predictor should give voiced and unvoiced frames"


def test_whole_utterance_equals_upstream_non_streaming(ours, upstream):
    for seed, prompt_len, n in ((2, 9, 37), (3, 0, 20)):
        req = make_request(seed, prompt_len, n, ours.cfg.flow.vocab_size)
        want = upstream_chunks(upstream, req, stream=False)
        got = ours.decode_utterance(req["prompt_tokens"], req["prompt_feat"], req["embedding"], req["tokens"],
                                    seed=req["seed"])
        assert_chunks_equal([got], want)


def run_streams(codec: Token2Wav, reqs, starts, rates) -> list[list[torch.Tensor]]:
    """A simulated LM: request i starts at step starts[i] and produces rates[i] tokens a step; every step, each
    stream with a window due joins one batched decode."""
    streams = [codec.new_stream(r["prompt_tokens"], r["prompt_feat"], r["embedding"], seed=r["seed"]) for r in reqs]
    chunks: list[list[torch.Tensor]] = [[] for _ in reqs]
    step, batch_kinds = 0, []
    while not all(s.done for s in streams):
        for i, (r, s) in enumerate(zip(reqs, streams)):
            if step >= starts[i] and not s.ended:
                k = (step - starts[i]) * rates[i]
                s.push(r["tokens"][k:k + rates[i]].tolist())
                if k + rates[i] >= len(r["tokens"]):
                    s.end()
        due = [i for i, s in enumerate(streams) if codec.window_due(s)]
        if due:
            batch_kinds.append({(codec.window_due(streams[i]), streams[i].token_offset == 0) for i in due})
            for i, audio in zip(due, codec.decode([streams[i] for i in due])):
                chunks[i].append(audio)
        step += 1
    # the schedule batches first windows with later ones, and final windows with streaming ones
    assert any(("window", True) in kinds and ("window", False) in kinds for kinds in batch_kinds)
    assert any({k for k, _ in kinds} == {"window", "final"} for kinds in batch_kinds)
    return chunks


@pytest.mark.parametrize("hop", [25, 12])
def test_streaming_batched_equals_upstream_streaming(ckpt, upstream, hop):
    from dataclasses import replace
    codec = load_token2wav(ckpt)
    codec = Token2Wav(replace(codec.cfg, stream=replace(codec.cfg.stream, hop_tokens=hop)), codec.flow, codec.hift)
    vocab = codec.cfg.flow.vocab_size
    # Prompts of different lengths give different first-window pads. The oracle gets all tokens at once (its
    # voice-conversion path), so its input has ended before its first window, which matters when a padded first
    # window leaves between hop + 3 and first hop + 3 tokens (it flushes them at once): the third request is
    # such a case and, like the oracle's, arrives whole; the others stream in, 7 tokens a step, and leave more.
    first = hop + (-7) % hop                    # first hop of a 7-token prompt
    reqs = [make_request(10, 7, 2 * first + 3 + 2, vocab), make_request(11, 0, 2 * hop + 5, vocab),
            make_request(12, 13, 3 * hop + 1, vocab)]
    got = run_streams(codec, reqs, starts=[0, 2, 9], rates=[7, 7, 1000])
    for req, chunks in zip(reqs, got):
        want = upstream_chunks(upstream, req, stream=True, hop=hop)
        assert len(want) > 1
        assert_chunks_equal(chunks, want)


def test_first_window_size_is_a_parameter(ours):
    req = make_request(20, 7, 30, ours.cfg.flow.vocab_size)
    default = ours.new_stream(req["prompt_tokens"], req["prompt_feat"], req["embedding"])
    assert default.first_hop == 25 + 18          # prompt 7 + 43 tokens = 2 chunks of 25
    early = ours.new_stream(req["prompt_tokens"], req["prompt_feat"], req["embedding"], first_hop_tokens=5)
    early.push(req["tokens"][:8].tolist())
    assert ours.window_due(early) == "window"    # 5 tokens + 3 lookahead
    assert len(ours.decode([early])[0]) == 5 * 960 - 8 * 480   # the HiFT overlap waits for the next window
    with pytest.raises(InvalidRequest) as err:
        ours.new_stream(req["prompt_tokens"], req["prompt_feat"], req["embedding"], first_hop_tokens=3)
    assert err.value.field == "first_hop_tokens"
    with pytest.raises(InvalidRequest) as err:
        ours.new_stream(req["prompt_tokens"], req["prompt_feat"][:-1], req["embedding"])
    assert err.value.field == "prompt_feat"
    with pytest.raises(InvalidRequest) as err:
        ours.new_stream(req["prompt_tokens"], req["prompt_feat"], req["embedding"][:100])
    assert err.value.field == "embedding"


def test_stream_without_tokens_ends_silently(ours):
    """A request whose LM stopped at once still gets its final window (empty), batched with a normal one."""
    req = make_request(21, 5, 30, ours.cfg.flow.vocab_size)
    empty = ours.new_stream(req["prompt_tokens"], req["prompt_feat"], req["embedding"])
    empty.end()
    busy = ours.new_stream(req["prompt_tokens"], req["prompt_feat"], req["embedding"], seed=req["seed"])
    busy.push(req["tokens"].tolist())
    busy.end()
    silent, audio = ours.decode([empty, busy])
    assert silent.numel() == 0 and empty.done and ours.window_due(empty) is None
    assert audio.numel() > 0


def test_tiny_checkpoint_is_deterministic():
    from voxbackend.models.cosyvoice2.tiny_codec import tiny_state_dicts
    _, flow_a, hift_a = tiny_state_dicts(seed=3)
    _, flow_b, hift_b = tiny_state_dicts(seed=3)
    for a, b in ((flow_a, flow_b), (hift_a, hift_b)):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- step-audio2's flashcosyvoice: an independent implementation on the same weights --------------------------

@contextlib.contextmanager
def fixed_flow_noise(noise: torch.Tensor):
    """flashcosyvoice draws its flow noise with randn_like; give it the fixed buffer the reference uses."""
    original = torch.randn_like
    torch.randn_like = lambda x, **kw: noise[:, :, :x.size(2)].expand(x.size(0), -1, -1).clone().to(x.dtype)
    try:
        yield
    finally:
        torch.randn_like = original


@pytest.fixture(scope="module")
def flash(ckpt, ours):
    fc = load_flashcosyvoice()
    cfg, enc, est, h = ours.cfg, ours.cfg.flow.encoder, ours.cfg.flow.estimator, ours.cfg.hift
    with torch.random.fork_rng():
        encoder = fc.encoder.UpsampleConformerEncoder(input_size=enc.size, output_size=enc.size,
                                                      attention_heads=enc.heads, linear_units=enc.linear_units,
                                                      num_blocks=enc.num_blocks, static_chunk_size=enc.chunk_size)
        estimator = fc.estimator.CausalConditionalDecoder(
            in_channels=est.in_channels, out_channels=est.out_channels, channels=list(est.channels), dropout=0.0,
            attention_head_dim=est.attention_head_dim, n_blocks=est.n_blocks, num_mid_blocks=est.num_mid_blocks,
            num_heads=est.num_heads, act_fn="gelu", static_chunk_size=est.chunk_size, num_decoding_left_chunks=-1)
        flow = fc.flow.CausalMaskedDiffWithXvec(
            input_size=enc.size, output_size=cfg.flow.mel_bins, spk_embed_dim=cfg.flow.spk_embed_dim,
            vocab_size=cfg.flow.vocab_size, encoder=encoder,
            decoder=fc.flow.CausalConditionalCFM(estimator=estimator))
        hift = fc.hift.HiFTGenerator(
            in_channels=h.mel_bins, base_channels=h.base_channels, nb_harmonics=h.nb_harmonics,
            sampling_rate=h.sampling_rate, f0_predictor=fc.hift.ConvRNNF0Predictor(cond_channels=h.f0_channels))
    flow.load_state_dict(torch.load(ckpt / "flow.pt"), strict=True)
    hift.load_state_dict(torch.load(ckpt / "hift.pt"), strict=True)
    return flow.eval(), hift.eval()


@pytest.mark.parametrize("finalize", [True, False])
def test_flow_batch_equals_flashcosyvoice(ours, flash, finalize):
    flow, _ = flash
    vocab = ours.cfg.flow.vocab_size
    # equal prompt + token lengths: flashcosyvoice splits the lookahead off the padded batch's last columns
    reqs = [make_request(30, 6, 40, vocab), make_request(31, 6, 40, vocab)]
    rows = [FlowRow(torch.cat([r["prompt_tokens"], r["tokens"]]), r["prompt_feat"], r["embedding"],
                    finalize=finalize, streaming=not finalize) for r in reqs]
    got = ours.flow(rows)
    tokens = torch.stack([row.tokens for row in rows])
    with fixed_flow_noise(ours.flow.noise):
        want, lengths = flow(tokens, torch.tensor([tokens.size(1)] * 2), torch.stack([r["prompt_feat"] for r in reqs]),
                             torch.tensor([12, 12]), torch.stack([r["embedding"] for r in reqs]),
                             streaming=not finalize, finalize=finalize)
    for i, g in enumerate(got):
        torch.testing.assert_close(g, want[i, :, 12:int(lengths[i])], atol=ATOL, rtol=0)


def test_hift_with_cache_equals_flashcosyvoice(ours, flash):
    _, hift = flash
    g = torch.Generator().manual_seed(40)
    mel = torch.randn(1, 80, 58, generator=g)
    cache_source = torch.randn(1, 1, 8 * 480, generator=g) * 0.1
    with torch.random.fork_rng():
        torch.manual_seed(41)
        want, want_source = hift(mel, cache_source)
    got, got_source = ours.hift(mel, [torch.Generator().manual_seed(41)], [cache_source[0]])
    torch.testing.assert_close(got_source, want_source, atol=ATOL, rtol=0)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_checkpoint_layouts_load_alike(ckpt, ours, tmp_path):
    """safetensors under the same names, legacy weight_g/weight_v pairs and a `generator.` prefix (HiFiGAN-trainer
    checkpoints) all load to the same weights as flow.pt / hift.pt."""
    from safetensors.torch import save_file
    flow = torch.load(ckpt / "flow.pt")
    hift = {"generator." + k.replace(".parametrizations.weight.original0", ".weight_g")
            .replace(".parametrizations.weight.original1", ".weight_v"): v.contiguous()
            for k, v in torch.load(ckpt / "hift.pt").items()}
    save_file({k: v.contiguous() for k, v in flow.items()}, str(tmp_path / "flow.safetensors"))
    save_file(hift, str(tmp_path / "hift.safetensors"))
    (tmp_path / "token2wav.json").write_text((ckpt / "token2wav.json").read_text())
    other = load_token2wav(tmp_path)
    for mine, theirs in ((ours.flow, other.flow), (ours.hift, other.hift)):
        a, b = mine.state_dict(), theirs.state_dict()
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], atol=0, rtol=0, msg=key)
