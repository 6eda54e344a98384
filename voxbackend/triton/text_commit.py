"""The exact commit rule for text that arrives in pieces cut anywhere (inside words, at punctuation).

BPE runs on each pre-token alone, so the ids of a text are the ids of its pre-tokens in order. Only the last
pre-token of the text received so far can still change when the next piece arrives ("Hel" + "lo", "don" + "'t",
trailing spaces that join the next word), so everything before it is final: we commit the ids of that prefix
and hold the last pre-token back until the next piece or the end. The ids committed over a whole utterance are
then exactly the ids of the whole text, however it was cut.

Normalization runs on the whole accumulated text (NFC may join a letter with an accent sent in the next piece);
only normalizers that are idempotent and leave a prefix's normal form unchanged are accepted (Unicode normal
forms, lowercasing): a normalizer that prepends, replaces or strips would make the committed prefix wrong.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from voxbackend.models.text_tokens import TextTokenizer

PREFIX_STABLE_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase"})


def check_normalizer(tokenizer: TextTokenizer) -> None:
    unsupported = [t for t in tokenizer.normalizer_types() if t not in PREFIX_STABLE_NORMALIZERS]
    if unsupported:
        raise ValueError(f"text streaming needs a prefix-stable normalizer; this tokenizer has {unsupported} "
                         f"(supported: {sorted(PREFIX_STABLE_NORMALIZERS)})")


@dataclass
class TextCommitter:
    """One utterance's text so far and the ids already committed to the engine.

    `encode(text) -> ids` is the model's `text_piece_ids` (the same ids the whole text would get)."""

    tokenizer: TextTokenizer
    encode: Callable[[str], list[int]]
    text: str = ""  # every piece so far, as received
    committed: str = ""  # normalized prefix whose ids are committed
    ids: list[int] = field(default_factory=list)  # the committed ids
    segments: list[tuple[str, int]] = field(default_factory=list)  # each committed pre-token and its id count

    def __post_init__(self) -> None:
        check_normalizer(self.tokenizer)

    def add(self, piece: str) -> list[int]:
        """Take one more piece; returns the ids that became final (maybe none)."""
        self.text += piece
        return self._commit(final=False)

    def close(self) -> list[int]:
        """The end of the text: every remaining id."""
        return self._commit(final=True)

    def _commit(self, final: bool) -> list[int]:
        normalized = self.tokenizer.normalize(self.text)
        starts = self.tokenizer.pre_token_starts(normalized)
        done = len(self.committed)
        if not normalized.startswith(self.committed) or (done and done not in starts):
            raise RuntimeError("the committed text is no longer a prefix of whole pre-tokens "
                               "(an unsupported normalizer or pre-tokenizer)")
        # Each pre-token is encoded on its own, as BPE sees it in the whole text: encoding the prefix as one
        # string would pre-tokenize its end differently (a run of spaces or newlines before the next word).
        bounds = [s for s in starts if s > done] + ([len(normalized)] if final else [])
        new: list[int] = []
        for a, b in zip([done, *bounds], bounds):
            ids = self.encode(normalized[a:b])
            self.segments.append((normalized[a:b], len(ids)))
            new += ids
        if bounds:
            self.committed = normalized[:bounds[-1]]
            self.ids += new
        return new

    def head(self) -> tuple[str, list[int]]:
        """The longest committed text that encodes as one string to its own ids (a model's prepare() tokenizes
        its text in one go), and the committed ids after it, to append once the request exists."""
        best, n_best, text, n = "", 0, "", 0
        for segment, count in self.segments:
            text, n = text + segment, n + count
            if self.encode(text) == self.ids[:n]:
                best, n_best = text, n
        return best, self.ids[n_best:]
