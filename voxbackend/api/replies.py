"""The transcripts of the spoken replies this API gave, by their audio id, until they expire.

OpenAI's multi-turn form sends an earlier spoken reply back as `{"role": "assistant", "audio": {"id": ...}}`, and a
conversation model takes an assistant turn by its text: the id is looked up here. Kept in this process's memory
only (no audio: the model does not take it back), bounded, the oldest dropped first.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

TTL_S = 3600  # a reply's `expires_at`: an hour, as OpenAI keeps them


@dataclass
class Transcripts:
    ttl_s: int = TTL_S
    limit: int = 10_000  # ids held at once; each is a short string
    _items: OrderedDict[str, tuple[str, int]] = field(default_factory=OrderedDict)

    def add(self, audio_id: str, transcript: str) -> int:
        """Keep one reply's transcript; returns its expires_at (Unix seconds)."""
        expires_at = int(time.time()) + self.ttl_s
        self._items[audio_id] = (transcript, expires_at)
        while len(self._items) > self.limit:
            self._items.popitem(last=False)
        return expires_at

    def get(self, audio_id: str) -> str | None:
        """The transcript, or None when the id is unknown here or expired."""
        item = self._items.get(audio_id)
        if item is None or item[1] < time.time():
            return None
        return item[0]
