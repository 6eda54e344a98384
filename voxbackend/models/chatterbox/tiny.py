"""A deterministic random-weight Chatterbox checkpoint folder, in the official layout.

    python -m voxbackend.models.chatterbox.tiny --out DIR [--seed N]

writes DIR/t3_cfg.safetensors (upstream T3's names over a tiny Llama backbone, DIR/t3.json its config),
DIR/s3gen.safetensors (flow + HiFT, and the S3 tokenizer + CAMPPlus of the voice front end, under upstream's
prefixes; DIR/s3gen.json and DIR/voice.json their shrunken sizes), DIR/ve.safetensors (the voice encoder),
DIR/tokenizer.json (letters, digits, punctuation and Chatterbox's special tokens: start 255, end 0) and
DIR/conds.pt, the built-in voice, cloned by that front end from a synthetic clip.
"""
from __future__ import annotations

import argparse
import json
import string
from pathlib import Path

from safetensors.torch import save_file

from voxbackend.models.checkpoint_cache import build_once, cache_root
from voxbackend.models.chatterbox.s3gen import CONFIG_NAME as S3GEN_CONFIG
from voxbackend.models.chatterbox.t3_lm import TEXT_VOCAB, WEIGHTS_FILE
from voxbackend.models.chatterbox.text import SPACE, START_TEXT, STOP_TEXT
from voxbackend.models.chatterbox.tiny_s3gen import tiny_s3gen
from voxbackend.models.chatterbox.tiny_t3 import tiny_t3
from voxbackend.models.chatterbox.tiny_voice import tiny_voice
from voxbackend.models.chatterbox.voice import VoiceCloner, VoiceConfig
from voxbackend.models.cosyvoice2.tiny import voice_clip


def build_tokenizer():
    """A letter-level tokenizer in the official tokenizer's shape: [STOP] is 0, [START] 255, spaces are [SPACE]."""
    from tokenizers import Tokenizer, models

    symbols = [*string.ascii_letters, *string.digits, *".,!?-'\"()&%$#@/"]
    specials = ["[UNK]", SPACE, "[PAD]", "[SEP]", "[CLS]", "[MASK]"]
    vocab = {"[STOP]": STOP_TEXT, "[START]": START_TEXT}
    free = (i for i in range(TEXT_VOCAB) if i not in vocab.values())
    vocab.update({tok: next(free) for tok in specials + symbols})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]"))
    tok.add_special_tokens(["[START]", "[STOP]", *specials])
    return tok


def write_tiny_chatterbox(out: str | Path, seed: int = 0) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    llama, t3 = tiny_t3(seed)
    save_file({k: v.contiguous() for k, v in t3.items()}, str(out / WEIGHTS_FILE))
    (out / "t3.json").write_text(json.dumps(llama, indent=1))
    s3gen_cfg, s3gen = tiny_s3gen(seed)
    voice_cfg, ve, front = tiny_voice(seed)
    save_file({k: v.contiguous() for k, v in {**s3gen, **front}.items()}, str(out / "s3gen.safetensors"))
    (out / S3GEN_CONFIG).write_text(json.dumps(s3gen_cfg, indent=1))
    save_file({k: v.contiguous() for k, v in ve.items()}, str(out / "ve.safetensors"))
    (out / VoiceConfig.CONFIG_NAME).write_text(json.dumps(voice_cfg, indent=1))
    build_tokenizer().save(str(out / "tokenizer.json"))
    cloner = VoiceCloner.from_folder(out)
    cloner.clone(voice_clip(seconds=3.0, seed=seed), 16000).to_conds(out / "conds.pt")
    return out


def ensure_default_chatterbox(root: str | Path | None = None) -> tuple[Path, None]:
    """(model_dir, None): the tiny Chatterbox the `chatterbox` Triton models serve when no checkpoint is configured,
    built once into `<VOXBACKEND_CACHE>-chatterbox`."""
    root = cache_root("-chatterbox") if root is None else root
    return build_once(root, lambda out: write_tiny_chatterbox(out / "chatterbox", seed=0)) / "chatterbox", None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_tiny_chatterbox(args.out, args.seed))


if __name__ == "__main__":
    main()
