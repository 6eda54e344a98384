"""A tiny random Qwen3-TTS-12Hz checkpoint in the official Hugging Face layout (CustomVoice, VoiceDesign or Base).

    python -m voxbackend.models.qwen3_tts.tiny --out DIR [--variant custom_voice|voice_design|base] [--seed N]

Writes config.json (`Qwen3TTSForConditionalGeneration` with a talker_config and its code_predictor_config, the
released 12 Hz codec ids), generation_config.json (the official sampling defaults), model.safetensors under the
reference's parameter names, a byte-level BPE tokenizer trained here with `tokenizers` on a fixed corpus (Qwen2's
pre-tokenizer; tokenizer.json plus vocab.json / merges.txt / tokenizer_config.json) with the Qwen control tokens
the template and the text track use, and `speech_tokenizer/` from tiny_qwen3_tts_codec. Nothing here imports the
reference (serving never needs qwen-tts); the tests load the result into it strictly.

Weights are drawn at unit scale (std 1.5 / sqrt(fan_in) for matrices, unit embeddings, norms near 1, biases at
0.1), so logits spread over several units: greedy decoding meets no near-tie that float rounding could flip.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from voxbackend.models.checkpoint_cache import build_once, cache_root
from voxbackend.models.qwen3_tts.tiny_codec import write_tiny_qwen3_tts_codec

PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                     r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
# control tokens after the trained vocabulary, in this order (the Qwen2 tokenizer's and Qwen3-TTS's text specials)
CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>")
BPE_VOCAB = 480
TEXT_VOCAB = 512  # talker text_vocab_size (the embedding table): covers the BPE vocabulary and the control tokens
CORPUS = [
    "Hello there, this is a streaming speech server.", "The quick brown fox jumps over the lazy dog.",
    "She said she would be here by noon, and she was.", "Speak slowly and clearly, with a warm voice.",
    "A calm narrator reads the evening news.", "Numbers like 12, 2048 and 3.5 are read aloud.",
    "assistant", "user", "Good morning! How are you today?", "Text arrives in pieces while audio plays.",
]
CODEC = dict(codec_eos_token_id=2150, codec_pad_id=2148, codec_bos_id=2149, codec_think_id=2154,
             codec_nothink_id=2155, codec_think_bos_id=2156, codec_think_eos_id=2157)
SPEAKERS = {"vivian": 3065, "ryan": 3061, "eric": 2875}
DIALECTS = {"vivian": False, "ryan": False, "eric": "sichuan_dialect"}
LANGUAGES = {"chinese": 2055, "english": 2050, "german": 2053, "japanese": 2058, "sichuan_dialect": 2062}
TALKER = dict(vocab_size=3072, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=24, hidden_act="silu", max_position_embeddings=1024, rms_norm_eps=1e-6,
              rope_theta=1e6, rope_scaling={"mrope_section": [4, 4, 4], "interleaved": True, "rope_type": "default"},
              num_code_groups=16, text_hidden_size=48, text_vocab_size=TEXT_VOCAB, attention_bias=False)
PREDICTOR = dict(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, hidden_act="silu", num_code_groups=16, rope_theta=1e6,
                 max_position_embeddings=64, rms_norm_eps=1e-6, attention_bias=False)
# the released Base speaker encoder's structure (4 TDNN/SE-Res2Net widths + the aggregation width, Res2Net scale 8,
# kernels and dilations as released), narrowed; enc_dim is set to the talker's hidden size in tiny_config
SPEAKER_ENCODER = dict(mel_dim=128, enc_channels=[32, 32, 32, 32, 96], enc_kernel_sizes=[5, 3, 3, 3, 1],
                       enc_dilations=[1, 2, 3, 4, 1], enc_attention_channels=16, enc_res2net_scale=8,
                       enc_se_channels=16, sample_rate=24000)
VARIANTS = ("custom_voice", "voice_design", "base")
GENERATION = dict(do_sample=True, top_k=50, top_p=1.0, temperature=0.9, repetition_penalty=1.05,
                  subtalker_dosample=True, subtalker_top_k=50, subtalker_top_p=1.0, subtalker_temperature=0.9,
                  max_new_tokens=2048)


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    tok.add_special_tokens(list(CONTROL_TOKENS))
    return tok


def _write_tokenizer(out: Path) -> dict[str, int]:
    tok = build_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    model = json.loads(tok.to_str())["model"]
    (out / "vocab.json").write_text(json.dumps(model["vocab"], ensure_ascii=False))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    ids = {t: tok.token_to_id(t) for t in CONTROL_TOKENS}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": None, "bos_token": None, "clean_up_tokenization_spaces": False, "model_max_length": 32768,
        "split_special_tokens": False, "errors": "replace",
        "added_tokens_decoder": {str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                          "normalized": False, "single_word": False} for t, i in ids.items()},
    }, indent=2))
    if max(ids.values()) >= TEXT_VOCAB:
        raise RuntimeError(f"tokenizer ids reach {max(ids.values())}; the text vocabulary is {TEXT_VOCAB}")
    return ids


def tiny_config(variant: str, ids: dict[str, int], model_size: str = "1b7") -> dict:
    talker = dict(TALKER, **CODEC, code_predictor_config=dict(PREDICTOR),
                  spk_id=dict(SPEAKERS) if variant == "custom_voice" else {},
                  spk_is_dialect=dict(DIALECTS) if variant == "custom_voice" else {},
                  codec_language_id=dict(LANGUAGES))
    cfg = {
        "architectures": ["Qwen3TTSForConditionalGeneration"], "model_type": "qwen3_tts",
        "tts_model_type": variant, "tts_model_size": model_size, "tokenizer_type": "qwen3_tts_tokenizer_12hz",
        "im_start_token_id": ids["<|im_start|>"], "im_end_token_id": ids["<|im_end|>"],
        "tts_pad_token_id": ids["<tts_pad>"], "tts_bos_token_id": ids["<tts_text_bos>"],
        "tts_eos_token_id": ids["<tts_text_eod>"], "talker_config": talker, "torch_dtype": "float32",
    }
    if variant == "base":
        cfg["speaker_encoder_config"] = dict(SPEAKER_ENCODER, enc_dim=TALKER["hidden_size"])
    return cfg


def _decoder_shapes(prefix: str, cfg: dict) -> dict[str, tuple[int, ...]]:
    """A Qwen3 decoder stack (QK-norm, no biases) under `prefix`, as the reference's state dict names it."""
    h, heads, kv, hd, inter = (cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                 "head_dim", "intermediate_size"))
    shapes: dict[str, tuple[int, ...]] = {}
    for n in range(cfg["num_hidden_layers"]):
        p = f"{prefix}layers.{n}."
        shapes.update({
            p + "self_attn.q_proj.weight": (heads * hd, h), p + "self_attn.k_proj.weight": (kv * hd, h),
            p + "self_attn.v_proj.weight": (kv * hd, h), p + "self_attn.o_proj.weight": (h, heads * hd),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
    shapes[prefix + "norm.weight"] = (h,)
    return shapes


def weight_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    t = cfg["talker_config"]
    p = t["code_predictor_config"]
    h, text_h = t["hidden_size"], t["text_hidden_size"]
    shapes = _decoder_shapes("talker.model.", t)
    shapes.update({
        "talker.model.codec_embedding.weight": (t["vocab_size"], h),
        "talker.model.text_embedding.weight": (t["text_vocab_size"], text_h),
        "talker.text_projection.linear_fc1.weight": (text_h, text_h),
        "talker.text_projection.linear_fc1.bias": (text_h,),
        "talker.text_projection.linear_fc2.weight": (h, text_h), "talker.text_projection.linear_fc2.bias": (h,),
        "talker.codec_head.weight": (t["vocab_size"], h),
    })
    shapes.update(_decoder_shapes("talker.code_predictor.model.", p))
    for j in range(t["num_code_groups"] - 1):
        shapes[f"talker.code_predictor.model.codec_embedding.{j}.weight"] = (p["vocab_size"], h)
        shapes[f"talker.code_predictor.lm_head.{j}.weight"] = (p["vocab_size"], p["hidden_size"])
    if p["hidden_size"] != h:  # the reference uses an identity when the widths match
        shapes["talker.code_predictor.small_to_mtp_projection.weight"] = (p["hidden_size"], h)
        shapes["talker.code_predictor.small_to_mtp_projection.bias"] = (p["hidden_size"],)
    if "speaker_encoder_config" in cfg:
        shapes.update(speaker_encoder_shapes(cfg["speaker_encoder_config"]))
    return shapes


def speaker_encoder_shapes(se: dict) -> dict[str, tuple[int, ...]]:
    """The ECAPA-TDNN speaker encoder under `speaker_encoder.`, as the reference's state dict names it: a TDNN,
    SE-Res2Net blocks (1x1 TDNN, scale - 1 dilated TDNNs on channel groups, 1x1 TDNN, squeeze-excitation), the
    aggregation TDNN over the blocks' concatenated outputs, attentive statistics pooling and a 1x1 projection.
    Every TDNN is one conv with a bias."""
    ch, ks, scale, se_ch = se["enc_channels"], se["enc_kernel_sizes"], se["enc_res2net_scale"], se["enc_se_channels"]
    shapes: dict[str, tuple[int, ...]] = {}

    def conv(name: str, cout: int, cin: int, kernel: int) -> None:
        shapes[f"speaker_encoder.{name}.weight"] = (cout, cin, kernel)
        shapes[f"speaker_encoder.{name}.bias"] = (cout,)

    conv("blocks.0.conv", ch[0], se["mel_dim"], ks[0])
    for i in range(1, len(ch) - 1):
        b = f"blocks.{i}."
        conv(b + "tdnn1.conv", ch[i], ch[i - 1], 1)
        for j in range(scale - 1):
            conv(b + f"res2net_block.blocks.{j}.conv", ch[i] // scale, ch[i] // scale, ks[i])
        conv(b + "tdnn2.conv", ch[i], ch[i], 1)
        conv(b + "se_block.conv1", se_ch, ch[i], 1)
        conv(b + "se_block.conv2", ch[i], se_ch, 1)
    conv("mfa.conv", ch[-1], sum(ch[1:-1]), ks[-1])
    conv("asp.tdnn.conv", se["enc_attention_channels"], ch[-1] * 3, 1)
    conv("asp.conv", ch[-1], se["enc_attention_channels"], 1)
    conv("fc", se["enc_dim"], ch[-1] * 2, 1)
    return shapes


def _draw(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        if "norm" in name:
            t = torch.rand(shape, generator=g) * 0.5 + 0.75
        elif len(shape) == 1:
            t = torch.randn(shape, generator=g) * 0.1
        elif "embedding" in name:
            t = torch.randn(shape, generator=g)
        elif len(shape) == 3:  # conv [out, in, kernel]
            t = torch.randn(shape, generator=g) * 1.5 * (shape[1] * shape[2]) ** -0.5
        else:
            t = torch.randn(shape, generator=g) * 1.5 * shape[-1] ** -0.5
        out[name] = t.contiguous()
    return out


def write_tiny_qwen3_tts(out_dir: str | Path, variant: str = "custom_voice", seed: int = 0,
                         model_size: str = "1b7") -> Path:
    """`model_size` is the tts_model_size tag: "0b6" CustomVoice takes no instruct (the architecture stays tiny)."""
    from safetensors.torch import save_file

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(variant, _write_tokenizer(out), model_size)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(GENERATION, indent=2) + "\n")
    save_file(_draw(weight_shapes(cfg), seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    write_tiny_qwen3_tts_codec(out / "speech_tokenizer", seed=seed)
    return out


def ensure_default_qwen3_tts(root: str | Path | None = None) -> tuple[Path, None]:
    """(model_dir, None): the tiny CustomVoice checkpoint the `qwen3_tts` Triton models serve by default (tagged
    0.6B, so INSTRUCT is refused there; the parity tests cover 1.7B CustomVoice and VoiceDesign), built
    once into `<VOXBACKEND_CACHE>-qwen3-tts` through a temporary folder and an atomic rename. The codec is the
    checkpoint's speech_tokenizer/ folder, so there is no codec folder."""
    root = cache_root("-qwen3-tts") if root is None else root
    root = build_once(root, lambda out: write_tiny_qwen3_tts(out / "qwen3_tts", seed=0, model_size="0b6"))
    return root / "qwen3_tts", None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--variant", default="custom_voice", choices=VARIANTS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-size", default="1b7", choices=("1b7", "0b6"), help="tts_model_size tag")
    args = ap.parse_args()
    print(write_tiny_qwen3_tts(args.out, variant=args.variant, seed=args.seed, model_size=args.model_size))


if __name__ == "__main__":
    main()
