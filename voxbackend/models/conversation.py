"""What the spoken-dialogue models (Step-Audio 2, GLM-4-Voice) share about a request: the user's clip and the earlier
turns as request inputs, their limits, and the checks on a history turn before a model renders it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from voxbackend.errors import InvalidRequest
from voxbackend.tensor_spec import TensorSpec

MAX_CLIP_S = 60.0  # one clip (the user's turn, or one turn of the history)
MAX_AUDIO_S = 180.0  # all of a request's clips together
MAX_HISTORY_TURNS = 32

INPUT_AUDIO = TensorSpec("INPUT_AUDIO", "STRING", optional=True, arg="audio", kind="audio",
                         doc="the user's spoken turn: a WAV/FLAC/OGG clip of at most 60 s (any rate: resampled to "
                             "16 kHz)")
HISTORY_INPUTS = (
    TensorSpec("HISTORY_ROLE", "STRING", (-1,), optional=True, arg="role", segment="history",
               doc="earlier turns, oldest first: user or assistant, one per turn"),
    TensorSpec("HISTORY_TEXT", "STRING", (-1,), optional=True, arg="text", segment="history",
               doc="each earlier turn's text (an assistant turn: what it said); empty for none"),
    TensorSpec("HISTORY_AUDIO", "STRING", (-1,), optional=True, arg="audio", segment="history", kind="audio",
               doc="each earlier user turn's clip (WAV/FLAC/OGG bytes; empty for none)"),
)


@dataclass
class HistoryTurn:
    role: str  # "user" or "assistant"
    text: Any
    audio: Any  # file bytes or samples; None for none (an empty HISTORY_AUDIO element included)
    sample_rate: Any


def check_history(history: list | None) -> list:
    history = [] if history is None else history
    if len(history) > MAX_HISTORY_TURNS:
        raise InvalidRequest(f"history has {len(history)} turns; the limit is {MAX_HISTORY_TURNS}", field="history")
    return history


def history_turn(turn: Any, field: str) -> HistoryTurn:
    """One turn of `history` ({"role", "text", "audio", "sample_rate"}), its shape checked; an assistant turn is
    given by its text, so a clip there is refused."""
    if not isinstance(turn, dict):
        raise InvalidRequest(f"{field} must be a dict, got {type(turn).__name__}", field=field)
    unknown = set(turn) - {"role", "text", "audio", "sample_rate"}
    if unknown:
        raise InvalidRequest(f"{field} has unknown keys {sorted(unknown)}", field=field)
    role, audio = turn.get("role"), turn.get("audio")
    audio = None if audio is None or len(audio) == 0 else audio
    if role not in ("user", "assistant"):
        raise InvalidRequest(f"{field}.role must be user or assistant, got {role!r}", field=f"{field}.role")
    if role == "assistant" and audio is not None:
        raise InvalidRequest(f"{field}.audio: an assistant turn is given by its text", field=f"{field}.audio")
    return HistoryTurn(role, turn.get("text"), audio, turn.get("sample_rate"))
