"""GLM-4-Voice's speech tokenizer (voxbackend/models/glm4_voice/speech_tokenizer.py) against independent oracles,
on tiny random weights (voxbackend/models/glm4_voice/tiny_tokenizer.py):

- the features: transformers' WhisperFeatureExtractor called the way upstream's extract_speech_token calls it
  (a clip's 30 s pieces together, padding="longest", pad_to_multiple_of=1280, with the attention mask);
- the blocks: transformers' WhisperEncoderLayer holding the same weights, under the mask written out below from
  upstream's forward (get_block_causal_attention_mask, or the padding mask, or plain causal); the causal
  convolutions, positions and pooling of upstream's WhisperVQEncoder.forward in plain torch;
- the quantizer: torch.cdist then argmin;
- the tokens: those oracles composed on upstream's padded batch, kept where its attention mask says, against each
  clip alone and against clips of different lengths batched together (the released layout, and three variants of
  the config upstream's code also supports).
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from voxbackend.models.glm4_voice.speech_tokenizer import (PIECE_SAMPLES, SpeechTokenizer, TokenizerConfig,
                                                           clip_pieces, encoder_name, load_speech_tokenizer,
                                                           nearest_codeword, piece_features, token_count)
from voxbackend.models.glm4_voice.tiny_tokenizer import TINY, tiny_tokenizer, write_tiny_tokenizer

TOKEN = 1280  # samples per token
# lengths that meet upstream's padding: a whole number of tokens and 30 samples short of one (the last frame, 40
# samples past the padded end, reads the clip reflected), 180 short of one (so does the frame after it, which a
# centred convolution reads), one sample into a token, and two clips longer than 30 s (their last piece is padded
# to 30 s, as the first one's batch is: zeros where it would read reflected samples)
LENGTHS = (10 * TOKEN, 7 * TOKEN + 1100, 6 * TOKEN - 30, 3 * TOKEN + 1, 12345,
           PIECE_SAMPLES + 3 * TOKEN - 30, PIECE_SAMPLES + 2 * TOKEN)
VARIANTS = {
    "released": TINY,
    "centred convs, padding mask only, pool after block 1": dataclasses.replace(
        TINY, encoder_causal_convolution=False, quantize_causal_block_size=None, pooling_position=1),
    "block mask after the pool too": dataclasses.replace(TINY, pooling_position=1),
    "causal blocks": dataclasses.replace(TINY, quantize_causal_encoder=True, pooling_type="max"),
}


def clip(samples: int, seed: int) -> np.ndarray:
    """A sweep with a wobbling level and a little noise: tokens that change along the clip."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(samples) / 16000
    tone = torch.sin(2 * np.pi * (120 + 30 * seed) * t * (1 + 0.7 * t)) * (1.2 + torch.sin(2 * np.pi * 2.5 * t))
    return (0.25 * tone + 0.03 * torch.randn(t.shape, generator=g)).numpy().astype(np.float32)


@pytest.fixture(scope="module")
def feature_extractor():
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=128)


@pytest.fixture(scope="module")
def models() -> dict[str, SpeechTokenizer]:
    return {name: tiny_tokenizer(seed=3, cfg=cfg) for name, cfg in VARIANTS.items()}


def assert_near(ours: torch.Tensor, expected: torch.Tensor, atol: float = 2e-5) -> None:
    """Within float32 rounding (torch.testing.assert_close's first call costs half a second of imports)."""
    assert ours.shape == expected.shape
    error = (ours - expected).abs().max().item()
    assert error <= atol, f"off by {error}"


def upstream_features(feature_extractor, audio: np.ndarray):
    """extract_speech_token's call on one clip: its 30 s pieces, padded together."""
    pieces = [audio[i:i + PIECE_SAMPLES] for i in range(0, len(audio), PIECE_SAMPLES)]
    return feature_extractor(pieces, sampling_rate=16000, return_attention_mask=True, return_tensors="pt",
                             padding="longest", pad_to_multiple_of=TOKEN)


def hf_layers(model: SpeechTokenizer):
    """transformers' Whisper encoder layers holding the tokenizer's blocks (the same names)."""
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoderLayer

    cfg = model.cfg
    hf_cfg = WhisperConfig(d_model=cfg.d_model, encoder_attention_heads=cfg.encoder_attention_heads,
                           encoder_ffn_dim=cfg.encoder_ffn_dim, activation_function="gelu", dropout=0.0,
                           attention_dropout=0.0, activation_dropout=0.0)
    hf_cfg._attn_implementation = "sdpa"
    layers = torch.nn.ModuleList(WhisperEncoderLayer(hf_cfg) for _ in model.layers).eval()
    layers.load_state_dict(model.layers.state_dict(), strict=True)
    return layers


def upstream_mask(attention_mask: torch.Tensor, cfg: TokenizerConfig, block: int | None) -> torch.Tensor:
    """The additive mask of upstream's blocks: get_block_causal_attention_mask (tril | block_diag, & padding), or
    get_extended_attention_mask (padding) without a block size, or in causal blocks SDPA's is_causal (tril)."""
    b, t = attention_mask.shape
    tril = torch.tril(torch.ones(1, t, t, dtype=torch.bool))
    if cfg.encoder_causal_attention or cfg.quantize_causal_encoder:
        allowed = tril.expand(b, t, t)
    elif block is None:
        allowed = attention_mask.bool()[:, None, :].expand(b, t, t)
    else:
        blocks = torch.block_diag(*[torch.ones(min(block, t - s), min(block, t - s)) for s in range(0, t, block)])
        allowed = (tril | blocks.bool()) & attention_mask.bool()[:, None, :]
    return ((1.0 - allowed.float()) * torch.finfo(torch.float32).min)[:, None]


def upstream_rows(model: SpeechTokenizer, features: torch.Tensor, attention_mask: torch.Tensor):
    """WhisperVQEncoder.forward up to its quantizer -> (the rows it quantizes, their attention mask)."""
    cfg, sd = model.cfg, model.state_dict()

    def conv(x: torch.Tensor, name: str, stride: int) -> torch.Tensor:
        weight, bias = sd[f"{name}.weight"], sd[f"{name}.bias"]
        if cfg.encoder_causal_convolution:  # CausalConv1d: 2 zeros on the left, none on the right
            return F.gelu(F.conv1d(F.pad(x, (2, 0)), weight, bias, stride=stride))
        return F.gelu(F.conv1d(x, weight, bias, stride=stride, padding=1))

    x = conv(conv(features, "conv1", 1), "conv2", 2).transpose(1, 2)
    x = x + sd["embed_positions.weight"][:x.shape[1]]
    mask = attention_mask[:, ::2]
    bias = upstream_mask(mask, cfg, cfg.quantize_causal_block_size)
    for i, layer in enumerate(hf_layers(model)):
        x = layer(x, bias)
        if i + 1 == cfg.pooling_position:
            k = cfg.pooling_kernel_size
            x = F.pad(x.transpose(1, 2), (0, -x.shape[1] % k))
            x = (F.avg_pool1d(x, k) if cfg.pooling_type == "avg" else F.max_pool1d(x, k)).transpose(1, 2)
            mask = mask[:, ::k]
            block = cfg.quantize_causal_block_size
            bias = upstream_mask(mask, cfg, None if block is None else block // k)
    return x, mask


def upstream_tokens(model: SpeechTokenizer, feature_extractor, audio: np.ndarray) -> list[int]:
    """extract_speech_token on the clip alone, with cdist + argmin as the quantizer."""
    features = upstream_features(feature_extractor, audio)
    with torch.inference_mode():
        rows, mask = upstream_rows(model, features.input_features, features.attention_mask)
        ids = torch.cdist(rows, model.codebook.weight[None]).argmin(dim=-1)
    return [int(i) for piece, keep in zip(ids, mask.bool()) for i in piece[keep]]


def test_features_equal_whisper_feature_extractor_as_upstream_calls_it(feature_extractor):
    for seed, samples in enumerate(LENGTHS):
        audio = clip(samples, seed)
        expected = upstream_features(feature_extractor, audio).input_features
        pieces = clip_pieces(torch.from_numpy(audio))
        assert len(pieces) == expected.shape[0]
        for (piece, padded), theirs in zip(pieces, expected):
            ours = piece_features(piece, padded)
            assert ours.shape[-1] >= -(-piece.shape[0] // TOKEN) * TOKEN // 160, "every frame its tokens read"
            assert_near(ours, theirs[:, :ours.shape[-1]])
    # the rule matters: the 30 s padding of a long clip's last piece changes the frames its last token reads
    piece, padded = clip_pieces(torch.from_numpy(clip(LENGTHS[5], 5)))[-1]
    own = -(-piece.shape[0] // TOKEN) * TOKEN
    assert padded == PIECE_SAMPLES and own < padded
    alone, upstream = piece_features(piece, own), piece_features(piece, padded)[:, :own // 160]
    assert (alone[:, -1] - upstream[:, -1]).abs().max() > 1e-3


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_encoder_equals_transformers_whisper_layers_with_upstreams_convs_mask_and_pool(
        models, feature_extractor, variant):
    """Two pieces padded together (a padding mask) through both: every row the same, padding rows included."""
    model = models[variant]
    features = feature_extractor([clip(21000, 1), clip(9 * TOKEN + 7, 2)], sampling_rate=16000,
                                 return_attention_mask=True, return_tensors="pt", padding="longest",
                                 pad_to_multiple_of=TOKEN)
    with torch.inference_mode():
        expected, mask = upstream_rows(model, features.input_features, features.attention_mask)
        ours, valid = model.hidden(features.input_features, torch.tensor([21000, 9 * TOKEN + 7]))
    assert torch.equal(valid, mask.bool())
    assert_near(ours, expected)


def test_the_quantizer_picks_the_nearest_codeword(models):
    g = torch.Generator().manual_seed(0)
    codebook = models["released"].codebook.weight
    rows = torch.randn(300, codebook.shape[1], generator=g)
    rows[:5] = codebook[[7, 0, 16383, 42, 7]]  # exact hits
    expected = torch.cdist(rows, codebook).argmin(dim=1)
    assert torch.equal(nearest_codeword(rows, codebook), expected)
    assert nearest_codeword(rows[:5], codebook).tolist() == [7, 0, 16383, 42, 7]
    twin = codebook.clone()
    twin[9000] = twin[123]
    assert nearest_codeword(codebook[123:124], twin).tolist() == [123], "a tie goes to the first id, as torch.min's"


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_clip_alone_and_in_a_batch_gets_upstreams_tokens(models, feature_extractor, variant):
    model = models[variant]
    # 30 s pieces cost most: one long clip for the released layout and for the centred convolutions (which read a
    # frame past the tokens' own), none for the others
    long = variant in ("released", "centred convs, padding mask only, pool after block 1")
    clips = [clip(samples, seed) for seed, samples in enumerate(LENGTHS[:6 if long else 5])]
    expected = [upstream_tokens(model, feature_extractor, audio) for audio in clips]
    for audio, tokens in zip(clips, expected):
        assert len(tokens) == token_count(len(audio))
        assert model.speech_tokens([audio]) == [tokens]
    assert model.speech_tokens(clips[::-1], max_batch=3) == expected[::-1]
    assert len({i for tokens in expected for i in tokens}) > 5, "the oracle is not one id over and over"


def test_loads_the_official_layout_and_refuses_a_checkpoint_without_a_weight(models, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = write_tiny_tokenizer(tmp_path / "tok", seed=3)
    config = json.loads((folder / "config.json").read_text())
    assert config["quantize_encoder_only"] and TokenizerConfig.from_hf(config) == TINY
    loaded = load_speech_tokenizer(folder)
    for name, tensor in models["released"].state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    audio = clip(2 * TOKEN + 5, 9)
    assert loaded.speech_tokens([audio, np.zeros(0, np.float32)]) == [models["released"].speech_tokens([audio])[0], []]
    weights = load_file(folder / "model.safetensors")
    assert "model.encoder.layers.2.fc1.weight" in weights and "model.encoder.ema_weight" in weights
    # copies without the `model.encoder.` prefix are in circulation too
    assert encoder_name("codebook.weight", TINY) == encoder_name("model.encoder.codebook.weight", TINY)
    assert encoder_name("layers.2.fc1.weight", TINY) is None and encoder_name("embed_positions2.weight", TINY) is None
    del weights["model.encoder.layers.1.fc2.bias"]
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(RuntimeError, match="layers.1.fc2.bias"):
        load_speech_tokenizer(folder)
    with pytest.raises(ValueError, match="activation"):
        TokenizerConfig.from_hf({**config, "activation_function": "relu"})
