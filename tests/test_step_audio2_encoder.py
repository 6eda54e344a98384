"""Step-Audio 2's audio encoder and adapter (voxbackend/models/step_audio2/audio_encoder.py) against independent
oracles on tiny random weights:

- the spectrogram and the placeholder count: step-audio2==1.0.0's utils.py (log_mel_spectrogram, compute_token_num);
- the Whisper part (convolutions, positions, blocks, final norm): transformers' WhisperEncoder with the same
  weights, on an input as long as its context (transformers pads every input to it; the encoder here does not);
- where Step's encoder differs from Whisper's (the average pool before the final norm, the mask of the tail-pad
  frames, the adapter): a straightforward torch transcription of the upstream forward, below;
- a batch of clips of different lengths: each clip's rows as it has them alone.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from step_audio2_oracle import load_utils
from voxbackend.models.step_audio2.audio_encoder import (AudioEncoder, AudioEncoderConfig, piece_mel, pieces,
                                                          placeholder_count)
from voxbackend.models.tiny_weights import perturb_default_inits

TINY = AudioEncoderConfig(n_mels=128, n_audio_ctx=128, n_audio_state=32, n_audio_head=4, n_audio_layer=2, llm_dim=24)


def clip(seconds: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(int(seconds * 16000)) / 16000
    return (0.3 * torch.sin(2 * np.pi * (150 + 40 * seed) * t) + 0.05 * torch.randn(t.shape, generator=g)).float()


@pytest.fixture(scope="module")
def encoder() -> AudioEncoder:
    torch.manual_seed(0)
    model = AudioEncoder(TINY).eval()
    perturb_default_inits(model, torch.Generator().manual_seed(1))  # norms and biases away from 1 and 0
    return model


def test_spectrogram_and_placeholder_count_equal_upstream():
    utils = load_utils()
    for seconds, seed in ((0.4, 0), (1.37, 1), (3.0, 2)):
        audio = clip(seconds, seed)
        ours, theirs = piece_mel(audio), utils.log_mel_spectrogram(audio.clone(), n_mels=128, padding=479)
        assert ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    for frames in range(20, 400):
        assert placeholder_count(frames) == utils.compute_token_num(frames), frames
    long = pieces(clip(26.0, 3))
    assert [m.shape[-1] for m in long] == [2502, 102], "25 s pieces, each with its own tail pad"


def whisper_from(encoder: AudioEncoder, frames: int):
    """transformers' WhisperEncoder holding this encoder's weights, its context = `frames` mel frames."""
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    cfg = encoder.cfg
    hf = WhisperEncoder(WhisperConfig(num_mel_bins=cfg.n_mels, d_model=cfg.n_audio_state,
                                      encoder_layers=cfg.n_audio_layer, encoder_attention_heads=cfg.n_audio_head,
                                      encoder_ffn_dim=4 * cfg.n_audio_state, max_source_positions=frames // 2,
                                      activation_function="gelu", dropout=0.0, attention_dropout=0.0,
                                      activation_dropout=0.0)).eval()
    ours = encoder.encoder.state_dict()
    names = {"embed_positions.weight": "positional_embedding.weight", "layer_norm.weight": "after_norm.weight",
             "layer_norm.bias": "after_norm.bias"}
    per_block = {"self_attn.q_proj": "attn.query", "self_attn.k_proj": "attn.key", "self_attn.v_proj": "attn.value",
                 "self_attn.out_proj": "attn.out", "self_attn_layer_norm": "attn_ln", "fc1": "mlp.0", "fc2": "mlp.2",
                 "final_layer_norm": "mlp_ln"}
    state = {}
    for name in hf.state_dict():
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            module, leaf = rest.rsplit(".", 1)
            state[name] = ours[f"blocks.{i}.{per_block[module]}.{leaf}"]
        else:
            state[name] = ours[names.get(name, name)][: frames // 2]
    hf.load_state_dict(state, strict=True)
    return hf


def test_the_whisper_part_equals_transformers_whisper_encoder(encoder):
    """No mask and no pool (the two places where Step differs): the same rows as WhisperEncoder's."""
    enc = encoder.encoder
    mel = piece_mel(clip(1.2, 4))[None, :, :120]
    hf = whisper_from(encoder, 120)
    with torch.inference_mode():
        expected = hf(mel).last_hidden_state
        x = F.gelu(enc.conv2(F.gelu(enc.conv1(mel)))).transpose(1, 2) + enc.positional_embedding.weight[:60]
        for block in enc.blocks:
            x = block(x, None)
        torch.testing.assert_close(enc.after_norm(x), expected, atol=1e-5, rtol=1e-5)


def upstream_rows(encoder: AudioEncoder, mel: torch.Tensor) -> torch.Tensor:
    """One clip, as the upstream forward computes it: Whisper's blocks with q and k each scaled by d^-1/4, the
    frames past the clip's length (its 2 tail-pad frames) masked on the grid mel[(T + 1) % 2 :: 2], the average
    pool (2) before the final norm, then the adapter (conv k3 s2 p1 + GELU, linear, ReLU, linear)."""
    sd = {k: v for k, v in encoder.state_dict().items()}
    cfg, t_mel = encoder.cfg, mel.shape[-1]
    x = F.gelu(F.conv1d(mel[None], sd["encoder.conv1.weight"], sd["encoder.conv1.bias"], padding=1))
    x = F.gelu(F.conv1d(x, sd["encoder.conv2.weight"], sd["encoder.conv2.bias"], stride=2, padding=1))
    x = x[0].T  # [t, width]
    t = x.shape[0]
    frame_is_real = torch.arange(t_mel) < t_mel - 2
    bias = torch.where(frame_is_real[(t_mel + 1) % 2::2], 0.0, -1e10)
    x = x + sd["encoder.positional_embedding.weight"][:t]
    heads, d = cfg.n_audio_head, cfg.n_audio_state
    for i in range(cfg.n_audio_layer):
        p = f"encoder.blocks.{i}."
        h = F.layer_norm(x, (d,), sd[p + "attn_ln.weight"], sd[p + "attn_ln.bias"])
        q = (h @ sd[p + "attn.query.weight"].T + sd[p + "attn.query.bias"]).view(t, heads, -1).transpose(0, 1)
        k = (h @ sd[p + "attn.key.weight"].T).view(t, heads, -1).transpose(0, 1)
        v = (h @ sd[p + "attn.value.weight"].T + sd[p + "attn.value.bias"]).view(t, heads, -1).transpose(0, 1)
        scale = (d // heads) ** -0.25
        w = torch.softmax((q * scale) @ (k * scale).transpose(1, 2) + bias, dim=-1)
        a = (w @ v).transpose(0, 1).reshape(t, d)
        x = x + a @ sd[p + "attn.out.weight"].T + sd[p + "attn.out.bias"]
        h = F.layer_norm(x, (d,), sd[p + "mlp_ln.weight"], sd[p + "mlp_ln.bias"])
        h = F.gelu(h @ sd[p + "mlp.0.weight"].T + sd[p + "mlp.0.bias"])
        x = x + h @ sd[p + "mlp.2.weight"].T + sd[p + "mlp.2.bias"]
    x = F.avg_pool1d(x.T[None], 2, 2)[0].T
    x = F.layer_norm(x, (d,), sd["encoder.after_norm.weight"], sd["encoder.after_norm.bias"])
    x = F.gelu(F.conv1d(x.T[None], sd["adapter.conv.weight"], sd["adapter.conv.bias"], stride=2, padding=1))[0].T
    x = F.relu(x @ sd["adapter.linear1.weight"].T + sd["adapter.linear1.bias"])
    return x @ sd["adapter.linear2.weight"].T + sd["adapter.linear2.bias"]


def test_each_clip_alone_equals_the_upstream_forward(encoder):
    for seconds, seed in ((0.3, 5), (0.71, 6), (1.0, 7), (1.26, 8), (1.3, 9)):  # odd and even frame counts
        mel = piece_mel(clip(seconds, seed))
        [ours] = encoder([mel])
        with torch.inference_mode():
            expected = upstream_rows(encoder, mel)
        count = placeholder_count(mel.shape[-1])
        # upstream's adapter gives a row more for some lengths (1.3 s: 17 for 16 placeholders); it inserts the first
        assert ours.shape == (count, TINY.llm_dim) and expected.shape[0] in (count, count + 1), mel.shape
        torch.testing.assert_close(ours, expected[:count], atol=1e-5, rtol=1e-5)


def test_a_batch_of_different_lengths_gives_each_clip_its_rows_alone(encoder):
    mels = [piece_mel(clip(s, 10 + i)) for i, s in enumerate((1.26, 0.3, 0.71, 1.0, 0.52))]
    batched = encoder(mels)
    for mel, rows in zip(mels, batched):
        [alone] = encoder([mel])
        torch.testing.assert_close(rows, alone, atol=1e-5, rtol=1e-5)


def test_config_reads_the_official_section():
    section = {**dataclasses.asdict(TINY), "n_codebook_size": 4096}  # the official file has keys it does not use
    assert AudioEncoderConfig.from_hf(section) == TINY


def test_loads_from_the_official_names_and_refuses_a_checkpoint_without_them(encoder, tmp_path):
    from safetensors.torch import load_file, save_file

    from voxbackend.models.step_audio2.audio_encoder import load_audio_encoder

    weights = {k: v.contiguous() for k, v in encoder.state_dict().items()}
    weights["model.embed_tokens.weight"] = torch.zeros(8, TINY.llm_dim)  # the LM's, left for the LM
    save_file(weights, tmp_path / "model.safetensors")
    config = {"audio_encoder_config": {**dataclasses.asdict(TINY), "n_codebook_size": 4096}}
    loaded = load_audio_encoder(config, load_file(tmp_path / "model.safetensors"))
    mel = piece_mel(clip(0.5, 20))
    torch.testing.assert_close(loaded([mel])[0], encoder([mel])[0], atol=0, rtol=0)
    del weights["adapter.linear2.bias"]
    with pytest.raises(RuntimeError, match="adapter.linear2.bias"):
        load_audio_encoder(config, weights)
