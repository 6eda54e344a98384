"""Chatterbox's text front end: the reference's punctuation clean-up, then its tokenizer.json (an English letter-level
tokenizer whose spaces are the "[SPACE]" token; 704 ids, start-of-text 255 and end-of-text 0 added around the text).
"""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

START_TEXT, STOP_TEXT = 255, 0
SPACE = "[SPACE]"
# characters the model rarely saw in training, as the reference rewrites them (LLM-written text is full of them)
REWRITES = (("...", ", "), ("…", ", "), (":", ","), (" - ", ", "), (";", ", "), ("—", "-"), ("–", "-"),
            (" ,", ","), ("“", '"'), ("”", '"'), ("‘", "'"), ("’", "'"))
SENTENCE_ENDS = (".", "!", "?", "-", ",")


def normalize_text(text: str) -> str:
    """Capital first letter, single spaces, common punctuation, and a full stop when the text ends without one."""
    if text[:1].islower():
        text = text[0].upper() + text[1:]
    text = " ".join(text.split())
    for old, new in REWRITES:
        text = text.replace(old, new)
    text = text.rstrip(" ")
    return text if text.endswith(SENTENCE_ENDS) else text + "."


class ChatterboxTokenizer:
    def __init__(self, path: str | Path):
        self.tokenizer = Tokenizer.from_file(str(path))
        vocab = self.tokenizer.get_vocab()
        for special in ("[START]", "[STOP]", SPACE):
            if special not in vocab:
                raise ValueError(f"{path} is not a Chatterbox tokenizer: it has no {special} token")

    def encode(self, text: str) -> list[int]:
        """Normalized text -> ids, without the start and end ids."""
        return self.tokenizer.encode(normalize_text(text).replace(" ", SPACE)).ids
