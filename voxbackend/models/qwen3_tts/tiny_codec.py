"""Tiny random Qwen3-TTS 12 Hz speech-tokenizer folders in the official layout (config.json + model.safetensors).

    python -m voxbackend.models.qwen3_tts.tiny_codec --out DIR [--seed N] [--no-encoder]

The tiny size keeps the real structure and timing: 24 kHz, 1920 samples per 12.5 Hz frame (x2 x2 after the
transformer, then x8 x5 x4 x3), 16 codebooks of 2048 (1 semantic + 15 acoustic), the 72-frame attention window,
causal convs throughout. Only widths and depth shrink (and head_dim is not hidden / heads, with grouped KV heads,
so a decoder that assumes either is caught). Deterministic for a seed.

Random init would hide bugs where the reference's own init is degenerate (codebooks at zero, layer scales at
0.01, ConvNeXt gammas at 1e-6, SnakeBeta at its identity-like zeros), so every tensor is drawn: codebooks and
cluster usages, unit-gain convs and linears, scales near 1. The last conv is scaled so that random codes decode
to audio peaking near 0.9, below the decoder's final clamp: absolute tolerances in tests mean what they say.

The encoder half (`encoder.*`, the Mimi encoder that Base checkpoints use for reference audio) is drawn at a tiny
size under the released checkpoint's flat Mimi names (what voxbackend.components.mimi.encoder loads), with the
preprocessor_config.json of its input front end (transformers' EncodecFeatureExtractor: mono 24 kHz, no chunking),
which the reference tokenizer wrapper reads before encoding.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn

from voxbackend.components.mimi.encoder import MimiEncoder
from voxbackend.models.qwen3_tts.codec import DECODER_DEFAULTS, Qwen3TTSCodec

TINY_DECODER = dict(codebook_dim=16, hidden_size=32, latent_dim=32, head_dim=16, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=64, num_hidden_layers=2, decoder_dim=32)
# a tiny Mimi encoder with the released one's timing (24 kHz, 12.5 Hz, 32 codebooks of which the first 16 are used),
# every field stated as in the released config.json
TINY_ENCODER = dict(
    sampling_rate=24000, audio_channels=1, hidden_size=32, num_filters=4, num_residual_layers=1,
    upsampling_ratios=[8, 6, 5, 4], kernel_size=7, last_kernel_size=3, residual_kernel_size=3, dilation_growth_rate=2,
    use_causal_conv=True, pad_mode="constant", compress=2, trim_right_ratio=1.0, codebook_size=2048, codebook_dim=16,
    num_quantizers=32, use_conv_shortcut=False, vector_quantization_hidden_dimension=16, num_semantic_quantizers=1,
    upsample_groups=32, num_hidden_layers=1, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
    head_dim=8, hidden_act="gelu", max_position_embeddings=8000, norm_eps=1e-5, layer_scale_initial_scale=0.01,
    rope_theta=10000.0, sliding_window=250, _frame_rate=12.5,
)


PREPROCESSOR = dict(feature_extractor_type="EncodecFeatureExtractor", feature_size=1, sampling_rate=24000,
                    padding_value=0.0, padding_side="right", return_attention_mask=True, chunk_length_s=None,
                    overlap=None)


def tiny_config(**decoder_overrides) -> dict:
    return {
        "architectures": ["Qwen3TTSTokenizerV2Model"],
        "model_type": "qwen3_tts_tokenizer_12hz",
        "encoder_valid_num_quantizers": 16,
        "input_sample_rate": 24000,
        "output_sample_rate": 24000,
        "decode_upsample_rate": 1920,
        "encode_downsample_rate": 1920,
        "encoder_config": dict(TINY_ENCODER),
        "decoder_config": {**DECODER_DEFAULTS, **TINY_DECODER, **decoder_overrides},
    }


def _fan_in(module: nn.Module) -> float:
    if isinstance(module, nn.ConvTranspose1d):  # each output sees kernel / stride taps of every input channel
        return module.in_channels * module.kernel_size[0] / module.stride[0]
    if isinstance(module, nn.Conv1d):
        return module.in_channels // module.groups * module.kernel_size[0]
    return module.in_features


def _decoder_weights(codec: Qwen3TTSCodec, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Random tensors under the reference decoder's names (Qwen3TTSTokenizerV2Decoder's state dict)."""
    def randn(*shape, std=1.0):
        return torch.randn(*shape, generator=g) * std

    out: dict[str, torch.Tensor] = {}
    for mod_name, m in codec.named_modules():
        for p_name, p in m.named_parameters(recurse=False):
            name = f"{mod_name}.{p_name}"
            if name.startswith(("semantic_proj", "acoustic_proj")):
                continue
            if isinstance(m, (nn.Conv1d, nn.ConvTranspose1d, nn.Linear)):
                # a residual unit's branch adds little, as in a trained vocoder: at unit gain the twelve units
                # would grow the signal to hundreds, where fp32 rounding in SnakeBeta's sin() is 1e-4 of it
                gain = 0.25 if mod_name.endswith(".conv2.conv") else 1.0
                t = randn(*p.shape, std=gain * _fan_in(m) ** -0.5) if p_name == "weight" else randn(*p.shape, std=0.1)
            elif p_name in ("alpha", "beta"):      # SnakeBeta, stored as logs
                t = randn(*p.shape, std=0.1)
            elif p_name in ("scale", "gamma"):     # layer scales, ConvNeXt gammas
                t = torch.rand(p.shape, generator=g) * 0.8 + 0.2
            elif p_name == "weight":               # RMSNorm / LayerNorm
                t = 1 + randn(*p.shape, std=0.1)
            else:                                  # LayerNorm bias
                t = randn(*p.shape, std=0.1)
            out[name] = t.contiguous()
    cfg = codec.config
    dim, dq, bins = cfg["codebook_dim"], cfg["codebook_dim"] // 2, cfg["codebook_size"]
    for part, n in (("rvq_first", 1), ("rvq_rest", cfg["num_quantizers"] - 1)):
        q = f"quantizer.{part}."
        out[q + "input_proj.weight"] = randn(dq, dim, 1, std=dim ** -0.5)  # encoder side; unused when decoding
        out[q + "output_proj.weight"] = randn(dim, dq, 1, std=dq ** -0.5)
        for i in range(n):
            out[q + f"vq.layers.{i}._codebook.embedding_sum"] = randn(bins, dq)
            out[q + f"vq.layers.{i}._codebook.cluster_usage"] = torch.rand(bins, generator=g) * 1.5 + 0.5
    return out


def _calibrate_last_conv(cfg: dict, w: dict[str, torch.Tensor], g: torch.Generator) -> None:
    """Scale the final conv (linear, so the scale is exact before the clamp) for a peak near 0.9."""
    last = f"decoder.{len(cfg['decoder_config']['upsample_rates']) + 2}.conv."
    codes = torch.randint(0, cfg["decoder_config"]["codebook_size"], (1, 8, cfg["decoder_config"]["num_quantizers"]),
                          generator=g)
    for _ in range(20):
        codec = Qwen3TTSCodec(cfg)
        codec.load_official_weights(w)
        peak = codec.decode(codes).abs().max().item()
        scale = 0.9 / peak if peak < 0.99 else 0.05  # clamped at 1: shrink until the true peak shows
        w[last + "weight"] *= scale
        w[last + "bias"] *= scale
        if peak < 0.99:
            return
    raise RuntimeError("could not calibrate the output level")


def _encoder_weights(cfg: dict, g: torch.Generator) -> dict[str, torch.Tensor]:
    """The Mimi encoder half under the released checkpoint's names: `encoder.` + kyutai's flat Mimi names
    (`encoder.layers.*`, `encoder_transformer.*`, `downsample.*`, `quantizer.*`), shaped by our MimiEncoder."""
    enc_cfg = cfg["encoder_config"]
    encoder = MimiEncoder(enc_cfg)
    out: dict[str, torch.Tensor] = {}
    for mod_name, m in encoder.named_modules():
        for p_name, p in m.named_parameters(recurse=False):
            if not mod_name:
                continue  # the quantizer projections, below
            if isinstance(m, (nn.Conv1d, nn.Linear)) and p_name == "weight":
                t = torch.randn(p.shape, generator=g) * _fan_in(m) ** -0.5
            elif isinstance(m, nn.LayerNorm) and p_name == "weight":
                t = 1 + torch.randn(p.shape, generator=g) * 0.1
            elif p_name == "scale":
                t = torch.rand(p.shape, generator=g) * 0.8 + 0.2
            else:
                t = torch.randn(p.shape, generator=g) * 0.1
            out[f"encoder.{mod_name}.{p_name}"] = t.contiguous()
    d, dq, bins = enc_cfg["hidden_size"], enc_cfg["vector_quantization_hidden_dimension"], enc_cfg["codebook_size"]
    n_sem = enc_cfg["num_semantic_quantizers"]
    for part, n in (("semantic", n_sem), ("acoustic", enc_cfg["num_quantizers"] - n_sem)):
        q = f"encoder.quantizer.{part}_residual_vector_quantizer."
        out[q + "input_proj.weight"] = torch.randn(dq, d, 1, generator=g) * d ** -0.5
        out[q + "output_proj.weight"] = torch.randn(d, dq, 1, generator=g) * dq ** -0.5
        for i in range(n):
            out[q + f"layers.{i}.codebook.embed_sum"] = torch.randn(bins, dq, generator=g)
            out[q + f"layers.{i}.codebook.cluster_usage"] = torch.rand(bins, generator=g) * 1.5 + 0.5
            out[q + f"layers.{i}.codebook.initialized"] = torch.ones(1)
    return out


def write_tiny_qwen3_tts_codec(out_dir: str | Path, seed: int = 0, encoder: bool = True,
                               **decoder_overrides) -> Path:
    from safetensors.torch import save_file

    cfg = tiny_config(**decoder_overrides)
    g = torch.Generator().manual_seed(seed)
    weights = _decoder_weights(Qwen3TTSCodec(cfg), g)
    _calibrate_last_conv(cfg, weights, g)
    tensors = {f"decoder.{k}": v for k, v in weights.items()}
    if encoder:
        tensors.update(_encoder_weights(cfg, g))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if encoder:
        (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2) + "\n")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-encoder", action="store_true", help="decoder only")
    args = ap.parse_args()
    print(write_tiny_qwen3_tts_codec(args.out, seed=args.seed, encoder=not args.no_encoder))


if __name__ == "__main__":
    main()
