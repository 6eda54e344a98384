"""Incremental text -> whole sentences, for models without text-input streaming: each sentence is one request.

A sentence ends at . ! ? or an ellipsis followed by whitespace (so "3.14" and a period still being typed do
not end one), at CJK full stops, or at a line break. A run of text longer than `max_chars` without a boundary
is cut at its last space, so a client that never sends punctuation still hears audio.
"""
from __future__ import annotations

import re

_BOUNDARY = re.compile(r"""(?:[.!?…]+["'”’)\]]*\s+)|(?:[。！？]+["'”’)\]]*\s*)|(?:\s*\n\s*)""")


class SentenceBuffer:
    def __init__(self, max_chars: int = 300):
        self.max_chars = max_chars
        self._text = ""

    def add(self, piece: str) -> list[str]:
        """Append a piece; return the sentences it completed (stripped, non-empty), in order."""
        self._text += piece
        out = []
        while True:
            match = _BOUNDARY.search(self._text)
            if match:
                cut = match.end()
            elif len(self._text) > self.max_chars:
                space = self._text.rfind(" ", 0, self.max_chars)
                cut = space + 1 if space > 0 else self.max_chars
            else:
                break
            sentence, self._text = self._text[:cut].strip(), self._text[cut:]
            if sentence:
                out.append(sentence)
        return out

    def flush(self) -> list[str]:
        """The rest, as the last sentence (the client said it has no more text)."""
        rest, self._text = self._text.strip(), ""
        return [rest] if rest else []
