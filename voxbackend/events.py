"""What the engine hands back for a request: audio chunks (and, from a model that also answers in text, pieces of
its text as they are said), then one final event."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np


class EventKind(str, Enum):
    AUDIO = "audio"  # one chunk of float32 mono audio
    TEXT = "text"  # the next piece of the reply's text (SpeechModel.text_output)
    FINISHED = "finished"  # last event of a successful stream; finish_reason says why
    ERROR = "error"  # last event of a failed stream; error says why


@dataclass
class Event:
    request_id: str
    kind: EventKind
    index: int = 0  # chunk index for AUDIO; number of chunks sent for FINISHED/ERROR
    audio: np.ndarray | None = None
    finish_reason: str | None = None  # "stop", "length", "cancelled"
    error: str | None = None
    token_ids: list[int] | None = None  # on the final event: every LM token the request generated
    text: str | None = None  # TEXT: the new characters

    @property
    def final(self) -> bool:
        return self.kind in (EventKind.FINISHED, EventKind.ERROR)
