"""User text -> token ids that can never be a control token.

A tokenizer matches its added tokens (special ones such as <|eot_id|> and plain added ones such as Orpheus'
<custom_token_N>) anywhere in the input, so text that spells one out would become that control id and could
end a prompt early or forge audio codes. `Tokenizer.encode_special_tokens` only turns off the special ones,
so user text goes through a copy of the tokenizer without any added tokens and without the post-processor:
the strings are then split like any other text, and the prompt template adds its control ids in code.
"""
from __future__ import annotations

import json

from tokenizers import Tokenizer


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer):
        spec = json.loads(tokenizer.to_str())
        # ids from here on are the added (control) tokens; text split by the base model stays below
        self.first_added_id = tokenizer.get_vocab_size(with_added_tokens=False)
        spec["added_tokens"] = []
        spec["post_processor"] = None
        self._plain = Tokenizer.from_str(json.dumps(spec))
        self._full = tokenizer

    def encode(self, text: str) -> list[int]:
        return self._plain.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._full.decode(ids, skip_special_tokens=False)

    # --- what a commit rule for text arriving in pieces needs (voxbackend/triton/text_commit.py) ---
    def normalize(self, text: str) -> str:
        normalizer = self._plain.normalizer
        return normalizer.normalize_str(text) if normalizer is not None else text

    def pre_token_starts(self, normalized: str) -> list[int]:
        """Where each pre-token of already normalized text begins (character offsets); BPE never merges across
        these boundaries, so the ids of a text are the ids of its pre-tokens, one after another."""
        pre = self._plain.pre_tokenizer
        if pre is None:
            return [0] if normalized else []
        return [start for _, (start, _) in pre.pre_tokenize_str(normalized)]

    def normalizer_types(self) -> list[str]:
        """The normalizer's steps by type name (a Sequence flattened); empty when there is none."""
        def flat(spec) -> list[str]:
            if not spec:
                return []
            if spec.get("type") == "Sequence":
                return [t for s in spec.get("normalizers", []) for t in flat(s)]
            return [spec.get("type", "?")]

        return flat(json.loads(self._plain.to_str()).get("normalizer"))
