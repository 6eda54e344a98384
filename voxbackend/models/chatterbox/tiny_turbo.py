"""A deterministic random-weight Chatterbox-Turbo checkpoint folder, in the official layout.

    python -m voxbackend.models.chatterbox.tiny_turbo --out DIR [--seed N]

writes DIR/t3_turbo_v1.safetensors (upstream T3's names over a tiny GPT-2 backbone, DIR/t3_turbo.json its config),
DIR/s3gen_meanflow.safetensors (meanflow flow + HiFT, and the S3 tokenizer + CAMPPlus of the voice front end;
DIR/s3gen.json and DIR/voice.json their shrunken sizes), DIR/ve.safetensors (the voice encoder), a GPT-2 style
byte-level BPE tokenizer as transformers' slow files (vocab.json, merges.txt, added_tokens.json,
special_tokens_map.json, tokenizer_config.json: bytes, a few English merges, <|endoftext|> and paralinguistic
tags) and DIR/conds.pt, the built-in voice, cloned by that front end from a synthetic clip.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from voxbackend.models.checkpoint_cache import build_once, cache_root
from voxbackend.models.chatterbox.s3gen import CONFIG_NAME as S3GEN_CONFIG
from voxbackend.models.chatterbox.s3gen import MEANFLOW_FILE
from voxbackend.models.chatterbox.tiny_s3gen import tiny_s3gen
from voxbackend.models.chatterbox.tiny_voice import tiny_voice
from voxbackend.models.chatterbox.turbo import GPT2_CONFIG, GPT2_MEDIUM, SPEECH_VOCAB, TurboVoiceCloner
from voxbackend.models.chatterbox.turbo_lm import SPEAKER_EMBED, STOP_SPEECH, WEIGHTS_FILE
from voxbackend.models.chatterbox.voice import VoiceConfig
from voxbackend.models.cosyvoice2.tiny import voice_clip

# merges over GPT-2's byte symbols (Ġ is a space), in rank order: enough that common words are several tokens
MERGES = ("Ġ t", "h e", "Ġt he", "Ġ a", "i n", "e r", "o u", "Ġ s", "r e", "o n", "Ġ w", "Ġ h", "a n", "l l",
          "Ġ b", "e n", "Ġ o", "i s", "Ġ f", "o r", "Ġ d", "a t", "in g", "Ġ m", "e s", "o w", "Ġthe re", "H e",
          "He ll", "Hell o", "Ġh ow", "Ġa re", "Ġ y", "Ġy ou", "Ġd o", "Ġdo ing", "Ġt o", "Ġto d", "Ġtod a",
          "Ġtoda y", "Ġ q", "u i", "c k", "Ġb r", "Ġf o", "Ġs y", "s t", "e m")
END_OF_TEXT = "<|endoftext|>"
TAGS = ("[laugh]", "[chuckle]", "[cough]", "[sigh]", "[gasp]", "[clear throat]")
TINY_GPT2 = {**GPT2_MEDIUM, "n_embd": 64, "hidden_size": 64, "n_head": 4, "n_layer": 2, "torch_dtype": "float32"}
GAIN = 1.5  # matrices a bit above unit gain: sharper logits, so greedy decoding meets no near-ties
# the stop token's head row scaled up: random weights then end some greedy streams within tens of tokens, others
# after a few hundred
STOP_GAIN = 1.3


def byte_symbols() -> list[str]:
    """GPT-2's stand-in character for each byte, in its vocab order: printable bytes are themselves, the others
    (space, control bytes, ...) take code points from 256 on."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    symbol = {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}
    return [symbol[b] for b in keep] + [symbol[b] for b in range(256) if b not in keep]


def write_tokenizer(out: Path) -> int:
    """The slow GPT-2 tokenizer files; returns the vocabulary size with the added tokens."""
    vocab = {s: i for i, s in enumerate(byte_symbols())}
    for merge in MERGES:
        a, b = merge.split()
        if a not in vocab or b not in vocab:
            raise ValueError(f"merge {merge!r} joins a symbol that is not in the vocabulary yet")
        vocab[a + b] = len(vocab)
    vocab[END_OF_TEXT] = len(vocab)
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(MERGES) + "\n")
    tags = {tag: len(vocab) + i for i, tag in enumerate(TAGS)}
    (out / "added_tokens.json").write_text(json.dumps(tags, indent=1))
    specials = {"bos_token": END_OF_TEXT, "eos_token": END_OF_TEXT, "unk_token": END_OF_TEXT}
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=1))
    flags = {"lstrip": False, "rstrip": False, "single_word": False, "normalized": False}
    decoder = {str(vocab[END_OF_TEXT]): {"content": END_OF_TEXT, **flags, "special": True},
               **{str(i): {"content": tag, **flags, "special": False} for tag, i in tags.items()}}
    config = {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False, "model_max_length": 1024,
              "added_tokens_decoder": decoder, **specials}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return len(vocab) + len(tags)


def t3_shapes(cfg: dict, text_vocab: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of upstream T3 (GPT-2 backbone as `tfmr.`, Conv1D weights [in, out]), in drawing order."""
    h, positions = cfg["n_embd"], cfg["n_positions"]
    out: dict[str, tuple[int, ...]] = {"tfmr.wte.weight": (cfg["vocab_size"], h), "tfmr.wpe.weight": (positions, h)}
    for i in range(cfg["n_layer"]):
        p = f"tfmr.h.{i}."
        out.update({p + "ln_1.weight": (h,), p + "ln_1.bias": (h,),
                    p + "attn.c_attn.weight": (h, 3 * h), p + "attn.c_attn.bias": (3 * h,),
                    p + "attn.c_proj.weight": (h, h), p + "attn.c_proj.bias": (h,),
                    p + "ln_2.weight": (h,), p + "ln_2.bias": (h,),
                    p + "mlp.c_fc.weight": (h, 4 * h), p + "mlp.c_fc.bias": (4 * h,),
                    p + "mlp.c_proj.weight": (4 * h, h), p + "mlp.c_proj.bias": (h,)})
    out.update({"tfmr.ln_f.weight": (h,), "tfmr.ln_f.bias": (h,),
                "cond_enc.spkr_enc.weight": (h, SPEAKER_EMBED), "cond_enc.spkr_enc.bias": (h,),
                "text_emb.weight": (text_vocab, h), "speech_emb.weight": (SPEECH_VOCAB, h),
                "text_head.weight": (text_vocab, h),
                "speech_head.weight": (SPEECH_VOCAB, h), "speech_head.bias": (SPEECH_VOCAB,)})
    return out


def draw(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    if len(shape) == 1 and ".ln_" in name and name.endswith("weight"):
        return 1.0 + 0.2 * torch.randn(shape, generator=g)  # LayerNorm scales away from 1: a skipped one shows
    if len(shape) == 1:
        return 0.1 * torch.randn(shape, generator=g)  # biases away from 0
    if name.endswith(("wte.weight", "wpe.weight", "emb.weight")):
        # token and position rows at comparable scales, so a wrong position moves the output visibly
        return (0.5 if "wpe" in name else 1.0) * torch.randn(shape, generator=g)
    fan_in = shape[0] if name.startswith("tfmr.") else shape[1]  # GPT-2's Conv1D is [in, out], nn.Linear [out, in]
    return GAIN * torch.randn(shape, generator=g) * fan_in**-0.5


def tiny_t3_turbo(text_vocab: int, seed: int = 0) -> tuple[dict, dict[str, torch.Tensor]]:
    # GPT-2's wte is unused (T3 feeds embeddings) but kept, as upstream's checkpoint has it; <|endoftext|> as
    # bos / eos, as the official config has them
    end = text_vocab - len(TAGS) - 1
    cfg = {**TINY_GPT2, "vocab_size": text_vocab, "bos_token_id": end, "eos_token_id": end}
    g = torch.Generator().manual_seed(seed)
    weights = {name: draw(name, shape, g) for name, shape in t3_shapes(cfg, text_vocab).items()}
    weights["speech_head.weight"][STOP_SPEECH] *= STOP_GAIN
    return cfg, weights


def write_tiny_chatterbox_turbo(out: str | Path, seed: int = 0) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    text_vocab = write_tokenizer(out)
    gpt2, t3 = tiny_t3_turbo(text_vocab, seed)
    save_file({k: v.contiguous() for k, v in t3.items()}, str(out / WEIGHTS_FILE))
    (out / GPT2_CONFIG).write_text(json.dumps(gpt2, indent=1))
    s3gen_cfg, s3gen = tiny_s3gen(seed, meanflow=True)
    voice_cfg, ve, front = tiny_voice(seed)
    save_file({k: v.contiguous() for k, v in {**s3gen, **front}.items()}, str(out / MEANFLOW_FILE))
    (out / S3GEN_CONFIG).write_text(json.dumps(s3gen_cfg, indent=1))
    save_file({k: v.contiguous() for k, v in ve.items()}, str(out / "ve.safetensors"))
    (out / VoiceConfig.CONFIG_NAME).write_text(json.dumps(voice_cfg, indent=1))
    cloner = TurboVoiceCloner.from_folder(out)
    cloner.clone(voice_clip(seconds=8.0, seed=seed), 16000).to_conds(out / "conds.pt")
    return out


def ensure_default_chatterbox_turbo(root: str | Path | None = None) -> tuple[Path, None]:
    """(model_dir, None): the tiny Chatterbox-Turbo the `chatterbox_turbo` Triton models serve when no checkpoint is
    configured, built once into `<VOXBACKEND_CACHE>-chatterbox_turbo`."""
    root = cache_root("-chatterbox_turbo") if root is None else root
    return build_once(root, lambda out: write_tiny_chatterbox_turbo(out / "chatterbox_turbo", seed=0)) / \
        "chatterbox_turbo", None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_tiny_chatterbox_turbo(args.out, args.seed))


if __name__ == "__main__":
    main()
