"""Chatterbox-Turbo's text front end: the reference's punctuation clean-up (`tts_turbo.punc_norm`, a shorter list
than Chatterbox's), then its GPT-2 byte-level BPE tokenizer with the added paralinguistic tags ([laugh], ...).

The reference loads the tokenizer with transformers' AutoTokenizer from the checkpoint folder (vocab.json +
merges.txt, added tokens in tokenizer_config.json / added_tokens.json) and adds no start or end ids. Here the same
tokenizer is built with `tokenizers` alone (the serving image has no transformers): a tokenizer.json if the folder
has one, else the BPE of vocab.json + merges.txt with GPT-2's byte-level pre-tokenizer and the added tokens at
their ids. User text goes through the full tokenizer, added tokens included, as upstream: the tags are the point,
and a text id can only ever reach the text embedding, never a speech or control id.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

# characters the model rarely saw in training, as the reference rewrites them
REWRITES = (("…", ", "), (":", ","), ("—", "-"), ("–", "-"), (" ,", ","), ("“", '"'), ("”", '"'), ("‘", "'"),
            ("’", "'"))
SENTENCE_ENDS = (".", "!", "?", "-", ",")
TOKEN_FLAGS = ("lstrip", "rstrip", "single_word", "normalized", "special")


def normalize_turbo_text(text: str) -> str:
    """Capital first letter, single spaces, common punctuation, and a full stop when the text ends without one."""
    if text[:1].islower():
        text = text[0].upper() + text[1:]
    text = " ".join(text.split())
    for old, new in REWRITES:
        text = text.replace(old, new)
    text = text.rstrip(" ")
    return text if text.endswith(SENTENCE_ENDS) else text + "."


def added_tokens(folder: Path) -> dict[int, dict]:
    """id -> {content, flags} of the tokens transformers adds on top of vocab.json: tokenizer_config.json's
    added_tokens_decoder, else added_tokens.json (plain tokens) and special_tokens_map.json (special ones)."""
    config = folder / "tokenizer_config.json"
    decoder = json.loads(config.read_text()).get("added_tokens_decoder") if config.is_file() else None
    if decoder:
        return {int(i): dict(spec) for i, spec in decoder.items()}
    out: dict[int, dict] = {}
    legacy = folder / "added_tokens.json"
    if legacy.is_file():
        out.update({int(i): {"content": c, "special": False} for c, i in json.loads(legacy.read_text()).items()})
    specials = folder / "special_tokens_map.json"
    if specials.is_file():
        vocab = json.loads((folder / "vocab.json").read_text())
        for value in json.loads(specials.read_text()).values():
            content = value["content"] if isinstance(value, dict) else value
            if isinstance(content, str) and content in vocab:
                out[vocab[content]] = {"content": content, "special": True}
    return out


def load_gpt2_tokenizer(folder: str | Path) -> Tokenizer:
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file():
        return Tokenizer.from_file(str(folder / "tokenizer.json"))
    vocab, merges = folder / "vocab.json", folder / "merges.txt"
    if not (vocab.is_file() and merges.is_file()):
        raise FileNotFoundError(f"no tokenizer.json or vocab.json + merges.txt in {folder}")
    tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    for token_id, spec in sorted(added_tokens(folder).items()):  # in id order: new ones get the next free id
        token = AddedToken(spec["content"], **{k: bool(spec[k]) for k in TOKEN_FLAGS if k in spec})
        (tok.add_special_tokens if spec.get("special") else tok.add_tokens)([token])
        if tok.token_to_id(spec["content"]) != token_id:
            raise ValueError(f"{folder}: added token {spec['content']!r} should have id {token_id}, got "
                             f"{tok.token_to_id(spec['content'])}")
    return tok


class TurboTokenizer:
    def __init__(self, folder: str | Path):
        self.tokenizer = load_gpt2_tokenizer(folder)
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)  # upstream's len(tokenizer)

    def encode(self, text: str) -> list[int]:
        """Normalized text -> ids (no start or end ids: Turbo has none)."""
        return self.tokenizer.encode(normalize_turbo_text(text), add_special_tokens=False).ids
