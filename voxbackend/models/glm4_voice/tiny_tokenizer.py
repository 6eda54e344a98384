"""A deterministic random-weight glm-4-voice-tokenizer folder, in the official layout.

    python -m voxbackend.models.glm4_voice.tiny_tokenizer --out DIR [--seed N]

writes DIR/config.json (WhisperVQConfig's keys, the released values but tiny sizes and a block of 8 rows, so that
short clips span several blocks), DIR/preprocessor_config.json (whisper-large-v3's feature extractor) and
DIR/model.safetensors under the released names (`model.encoder.`), with what the tokenizer must skip: a block past
`quantize_position`, the final norm, the positions after the quantizer, the EMA buffers and a decoder tensor.
The codebook keeps the official 16384 ids.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from voxbackend.models.glm4_voice.speech_tokenizer import CHECKPOINT_PREFIX, Block, SpeechTokenizer, TokenizerConfig
from voxbackend.models.tiny_weights import perturb_default_inits

TINY = TokenizerConfig(d_model=64, encoder_attention_heads=4, encoder_ffn_dim=128, encoder_layers=3,
                       quantize_position=2, pooling_position=2, quantize_causal_block_size=8)
# the keys of the released config.json that the tokenizer does not read, at their released values
OTHER_KEYS = dict(architectures=["WhisperVQEncoder"], model_type="whisper", quantize_encoder_only=True,
                  quantize_commit_coefficient=0.25, quantize_ema_decay=0.99, quantize_loss_scale=10.0,
                  quantize_restart_interval=100, skip_language_detection=True, scale_embedding=False,
                  torch_dtype="float32")
PREPROCESSOR = dict(chunk_length=30, feature_extractor_type="WhisperFeatureExtractor", feature_size=128,
                    hop_length=160, n_fft=400, n_samples=480000, nb_max_frames=3000, padding_side="right",
                    padding_value=0.0, processor_class="WhisperProcessor", return_attention_mask=False,
                    sampling_rate=16000)


def tiny_tokenizer(seed: int = 0, cfg: TokenizerConfig = TINY) -> SpeechTokenizer:
    """The tokenizer with seeded random weights: codewords at unit scale, norms and biases off their defaults."""
    torch.manual_seed(seed)
    model = SpeechTokenizer(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    perturb_default_inits(model, g)
    with torch.no_grad():
        model.codebook.weight.copy_(torch.randn(model.codebook.weight.shape, generator=g))
    return model


def checkpoint_tensors(model: SpeechTokenizer, seed: int = 0) -> dict[str, torch.Tensor]:
    """The tokenizer's tensors under the released names, plus tensors of the full model it must not read."""
    cfg, g = model.cfg, torch.Generator().manual_seed(seed + 2)
    tensors = {CHECKPOINT_PREFIX + k: v.contiguous() for k, v in model.state_dict().items()}
    for k, v in Block(cfg).state_dict().items():
        tensors[f"{CHECKPOINT_PREFIX}layers.{cfg.encoder_layers - 1}.{k}"] = torch.randn(v.shape, generator=g)
    pooled = -(-cfg.max_source_positions // max(cfg.pool, 1))
    for name, shape in (("layer_norm.weight", (cfg.d_model,)), ("layer_norm.bias", (cfg.d_model,)),
                        ("embed_positions2.weight", (pooled, cfg.d_model)), ("ema_count", (cfg.quantize_vocab_size,)),
                        ("ema_weight", (cfg.quantize_vocab_size, cfg.d_model))):
        tensors[CHECKPOINT_PREFIX + name] = torch.randn(shape, generator=g)
    tensors["model.decoder.layer_norm.weight"] = torch.randn(cfg.d_model, generator=g)
    return tensors


def write_tiny_tokenizer(out: str | Path, seed: int = 0, cfg: TokenizerConfig = TINY) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**OTHER_KEYS, **dataclasses.asdict(cfg)}, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
    save_file(checkpoint_tensors(tiny_tokenizer(seed, cfg), seed), str(out / "model.safetensors"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_tiny_tokenizer(args.out, args.seed))


if __name__ == "__main__":
    main()
