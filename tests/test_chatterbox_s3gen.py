"""Chatterbox S3Gen (voxbackend.models.chatterbox.s3gen) against upstream `S3Token2Wav` (chatterbox-tts 0.1.7).

Upstream is built at its official sizes (S3Token2Wav's own constructor; the mean-flow estimator with the same
arguments and meanflow=True), given random weights, and its state dict written as s3gen.safetensors and
s3gen_meanflow.safetensors with no s3gen.json, so the loader's defaults are the official sizes. The files leave
out upstream's 500 MB of `tokenizer.*` to save the write and keep `speaker_encoder.*`, which the loader must skip.
Both sides get the same start noise (upstream's `randn_like(mu)` answered from our noise buffer) and the same HiFT
excitation draws (torch's global RNG seeded as our stream's generator). Measured max abs differences: audio
1.4e-5 (CFM) and 1.5e-5 (meanflow), mel 3.6e-6, a finalize=False window's mel 4.2e-6 (1.3e-2 with CosyVoice2's
lookahead semantics instead).
"""
from __future__ import annotations

import contextlib
import types

import pytest
import torch
from safetensors.torch import save_file

from chatterbox_s3gen_oracle import load_s3gen as load_oracle
from voxbackend.components.flow_hift.flow_matching import FlowRow
from voxbackend.models.chatterbox.s3gen import MEANFLOW_FILE, S3GEN_FILE, S3Gen, load_s3gen
from voxbackend.models.chatterbox.tiny_s3gen import tiny_s3gen, write_tiny_s3gen
from voxbackend.models.tiny_weights import perturb_default_inits

ATOL = 1e-4
# one intra-op thread: under the suite's two workers on two cores, two threads each made the full-size decodes ~5x
# slower (oversubscribed), not faster
pytestmark = pytest.mark.usefixtures("one_thread")


def _meanflow_estimator(oracle):
    """Chatterbox-Turbo's estimator: S3Token2Mel's arguments, meanflow=True."""
    return oracle.decoder.ConditionalDecoder(in_channels=320, out_channels=80, causal=True, channels=[256],
                                             dropout=0.0, attention_head_dim=64, n_blocks=4, num_mid_blocks=12,
                                             num_heads=8, act_fn="gelu", meanflow=True)


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    """(oracle modules, upstream S3Token2Wav with the CFM estimator, both estimators, the checkpoint folder)."""
    oracle = load_oracle()
    tokenizer = oracle.s3gen.S3Tokenizer
    # its 124M parameters are never run by S3Gen (upstream reads its device from them: one is kept)
    oracle.s3gen.S3Tokenizer = lambda *args, **kwargs: torch.nn.Linear(1, 1)
    try:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = oracle.S3Token2Wav()
    finally:
        oracle.s3gen.S3Tokenizer = tokenizer
    with torch.random.fork_rng():
        torch.manual_seed(0)
        estimators = {False: model.flow.decoder.estimator, True: _meanflow_estimator(oracle).eval()}
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        perturb_default_inits(model.flow, g)
        perturb_default_inits(estimators[True], g)
        mixer = estimators[True].time_embed_mixer.weight  # initialised to ignore r: make r matter
        mixer.add_(0.05 * torch.randn(mixer.shape, generator=g))
        hift = model.mel2wav
        perturb_default_inits(hift, g)
        hift.conv_post.parametrizations.weight.original0.mul_(0.05)  # log-magnitudes near 4: audio ~0.1, unclipped
        hift.conv_post.bias.zero_()
        hift.conv_post.bias[:9] = 4.0
        # |f0| spread around 10 Hz: voiced and unvoiced frames (a zero-sum weight keeps the mean near the bias)
        f0_out = hift.f0_predictor.classifier
        f0_out.weight.sub_(f0_out.weight.mean()).mul_(1000.0)
        f0_out.bias.fill_(10.0)
    folder = tmp_path_factory.mktemp("s3gen")
    for mf, name in ((False, S3GEN_FILE), (True, MEANFLOW_FILE)):
        model.flow.decoder.estimator = estimators[mf]
        save_file({k: v.contiguous() for k, v in model.state_dict().items() if not k.startswith("tokenizer.")},
                  str(folder / name))
    model.flow.decoder.estimator = estimators[False]
    return types.SimpleNamespace(oracle=oracle, model=model.eval(), estimators=estimators, folder=folder)


class _TorchWithNoise:
    """torch, but `randn_like` answers with the first frames of a fixed noise buffer."""

    def __init__(self, noise: torch.Tensor):
        self.noise = noise

    def __getattr__(self, name):
        return getattr(torch, name)

    def randn_like(self, like: torch.Tensor) -> torch.Tensor:
        return self.noise[:, :, :like.size(2)].expand_as(like).clone().to(like)


@contextlib.contextmanager
def same_noise(oracle, noise: torch.Tensor, hift_seed: int):
    """Upstream's CFM start noise from our buffer; its HiFT draws from torch's RNG seeded as our stream's."""
    module = oracle.flow_matching
    module.torch = _TorchWithNoise(noise)
    try:
        with torch.random.fork_rng(), torch.inference_mode():
            torch.manual_seed(hift_seed)
            yield
    finally:
        module.torch = torch


def make_request(seed: int, prompt_len: int, n_tokens: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(prompt_tokens=torch.randint(0, 6561, (prompt_len,), generator=g),
                prompt_feat=torch.randn(2 * prompt_len, 80, generator=g),
                embedding=torch.randn(192, generator=g),
                tokens=torch.randint(0, 6561, (n_tokens,), generator=g), seed=1000 + seed)


def ref_dict(req: dict) -> dict:
    p = req["prompt_tokens"]
    return dict(prompt_token=p[None], prompt_token_len=torch.tensor([len(p)]), prompt_feat=req["prompt_feat"][None],
                prompt_feat_len=None, embedding=req["embedding"][None])


def ours_utterance(codec: S3Gen, req: dict) -> torch.Tensor:
    return codec.decode_utterance(req["prompt_tokens"], req["prompt_feat"], req["embedding"], req["tokens"],
                                  seed=req["seed"])


def assert_real_audio(codec: S3Gen, audio: torch.Tensor, n_tokens: int):
    """Guards the parity checks against a degenerate model (silent, or clipped everywhere)."""
    assert audio.shape == (n_tokens * 960,)
    assert audio[:480].abs().max() == 0 and audio[960:].std() > 0.01, "trim_fade: 20 ms silence, then signal"
    assert (audio.abs() >= codec.cfg.hift.audio_limit).float().mean() < 0.01


def test_whole_utterance_equals_upstream(upstream):
    codec = load_s3gen(upstream.folder)
    req = make_request(1, 8, 24)
    with same_noise(upstream.oracle, codec.flow.noise, req["seed"]):
        want = upstream.model.inference(req["tokens"][None], ref_dict=ref_dict(req))[0][0]
    got = ours_utterance(codec, req)
    assert_real_audio(codec, got, 24)
    with torch.inference_mode():
        mel = codec.flow([FlowRow(torch.cat([req["prompt_tokens"], req["tokens"]]), req["prompt_feat"],
                                  req["embedding"], finalize=True, streaming=False)])[0]
        f0 = codec.hift.f0_predictor(mel[None])
    assert 0.05 < (f0 > codec.cfg.hift.nsf_voiced_threshold).float().mean() < 0.95, "both excitation branches"
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_lookahead_window_equals_upstream_finalize_false(upstream, monkeypatch):
    """A streamed window (finalize=False): the last 3 tokens are encoded, attended to and their frames dropped.
    0.1.7 itself fails here with a shape error (its estimator mask keeps the untrimmed length); the mask is cut
    to the trimmed length, as its docstring describes the mode."""
    codec = load_s3gen(upstream.folder)
    req = make_request(2, 6, 20)
    cfm = upstream.model.flow.decoder
    forward = cfm.forward
    monkeypatch.setattr(cfm, "forward", lambda mu, mask, **kw: forward(mu=mu, mask=mask[..., :mu.size(2)], **kw))
    with same_noise(upstream.oracle, codec.flow.noise, 0):
        want = upstream.model.flow_inference(req["tokens"][None], ref_dict=ref_dict(req), finalize=False)[0]
    got = codec.flow([FlowRow(torch.cat([req["prompt_tokens"], req["tokens"]]), req["prompt_feat"],
                              req["embedding"], finalize=False, streaming=True)])[0]
    assert got.shape == want.shape == (80, 2 * (20 - 3))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_meanflow_equals_upstream(upstream, monkeypatch):
    codec = load_s3gen(upstream.folder, meanflow=True)
    assert codec.flow.cfg.n_timesteps == 2
    req = make_request(3, 8, 24)
    monkeypatch.setattr(upstream.model.flow.decoder, "estimator", upstream.estimators[True])
    monkeypatch.setattr(upstream.model, "meanflow", True)
    prompt_frames = 2 * len(req["prompt_tokens"])
    noised = codec.flow.noise[:, :, prompt_frames:prompt_frames + 2 * 24].clone()
    with same_noise(upstream.oracle, codec.flow.noise, req["seed"]):
        want = upstream.model(req["tokens"][None], None, None, ref_dict=ref_dict(req), finalize=True,
                              n_cfm_timesteps=2, noised_mels=noised)[0]
    got = ours_utterance(codec, req)
    assert_real_audio(codec, got, 24)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def stream(codec: S3Gen, req: dict, per_step: int) -> list[torch.Tensor]:
    s = codec.new_stream(req["prompt_tokens"], req["prompt_feat"], req["embedding"], seed=req["seed"])
    chunks, tokens = [], req["tokens"].tolist()
    for i in range(0, len(tokens), per_step):
        s.push(tokens[i:i + per_step])
        if i + per_step >= len(tokens):
            s.end()
        while codec.window_due(s):
            chunks.append(codec.decode([s])[0])
    return chunks


@pytest.mark.parametrize("meanflow", [False, True])
def test_streamed_windows_vs_whole_utterance(tmp_path, meanflow):
    """Windows of 25 tokens + 3 lookahead, concatenated, against the whole-utterance decode (module docstring of
    s3gen.py): the final window, which sees every token, gives the whole decode's mel for its frames; earlier
    windows' mel differ (full attention: the whole decode's frames also saw the later tokens), less so the later
    the window (max abs, measured here: 0.125, 0.048, 0.024 for CFM; 0.081, 0.042, 0.015 for meanflow); the audio
    also differs by HiFT's excitation noise, drawn window by window, and the 8-frame cross-fades: even the final
    window, whose mel is exact, differs (RMS of the difference per window, over the utterance's RMS, measured:
    0.25-0.30 for CFM, 0.04-0.10 for meanflow; max abs 0.07 and 0.085)."""
    codec = load_s3gen(write_tiny_s3gen(tmp_path, seed=0, meanflow=meanflow), meanflow=meanflow)
    req = make_request(4, 10, 80)
    mels = []
    hook = codec.flow.register_forward_hook(lambda module, args, out: mels.append(out[0]))
    try:
        whole = ours_utterance(codec, req)
        chunks = stream(codec, req, per_step=4)
    finally:
        hook.remove()
    assert [len(c) for c in chunks] == [(50 - 8) * 480, 50 * 480, 50 * 480, (10 + 8) * 480]
    streamed = torch.cat(chunks)
    assert streamed.shape == whole.shape
    assert streamed[:480].abs().max() == 0, "trim_fade on the stream's start"
    whole_mel, offsets = mels[0], (0, 50, 100, 150)
    diffs = [(m[:, off:] - whole_mel[:, off:off + m.size(1) - off]).abs().max().item()
             for m, off in zip(mels[1:], offsets)]
    assert diffs[-1] < 1e-5, "the final window sees every token: the whole decode's mel"
    assert min(diffs[:-1]) > 1e-3, "earlier windows did not see the later tokens (full attention)"
    rms = whole.pow(2).mean().sqrt()
    start = 0
    for c in chunks:
        d = streamed[start:start + len(c)] - whole[start:start + len(c)]
        assert d.pow(2).mean().sqrt() < 0.4 * rms
        start += len(c)


def test_streams_batch_like_single(tmp_path):
    """Two requests of different prompts, lengths and ages in one decode call give each its solo audio."""
    codec = load_s3gen(write_tiny_s3gen(tmp_path, seed=0))
    reqs = [make_request(5, 12, 60), make_request(6, 7, 41)]
    solo = [stream(codec, r, per_step=3) for r in reqs]
    streams = [codec.new_stream(r["prompt_tokens"], r["prompt_feat"], r["embedding"], seed=r["seed"]) for r in reqs]
    chunks: list[list[torch.Tensor]] = [[], []]
    starts, batched = (0, 6), False
    for step in range(200):
        for i, (r, s) in enumerate(zip(reqs, streams)):
            k = (step - starts[i]) * 3
            if k >= 0 and not s.ended:
                s.push(r["tokens"][k:k + 3].tolist())
                if k + 3 >= len(r["tokens"]):
                    s.end()
        due = [i for i, s in enumerate(streams) if codec.window_due(s)]
        batched |= len(due) > 1
        for i, audio in zip(due, codec.decode([streams[i] for i in due]) if due else []):
            chunks[i].append(audio)
        if all(s.done for s in streams):
            break
    assert batched
    for got, want in zip(chunks, solo):
        assert [len(c) for c in got] == [len(c) for c in want]
        # batched matmuls round differently with the batch's make-up (1.3e-5 seen); a wrong window is ~0.1 off
        torch.testing.assert_close(torch.cat(got), torch.cat(want), atol=1e-4, rtol=0)


def test_tiny_writer_is_deterministic(tmp_path):
    config, state = tiny_s3gen(seed=0)
    assert config["flow"]["vocab_size"] == 6561 == state["flow.input_embedding.weight"].size(0)
    assert all(k.startswith(("flow.", "mel2wav.")) for k in state)
    assert any(k.endswith("parametrizations.weight.original0") for k in state), "HiFT stored weight-normed"
    a = load_s3gen(write_tiny_s3gen(tmp_path / "a", seed=0))
    b = load_s3gen(write_tiny_s3gen(tmp_path / "b", seed=0))
    c = load_s3gen(write_tiny_s3gen(tmp_path / "c", seed=1))
    req = make_request(7, 5, 30)
    audio = ours_utterance(a, req)
    assert_real_audio(a, audio, 30)
    assert torch.equal(audio, ours_utterance(a, req))
    assert torch.equal(audio, ours_utterance(b, req))
    assert not torch.allclose(audio, ours_utterance(c, req), atol=1e-3)
