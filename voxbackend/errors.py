"""Errors the engine raises to callers. Bad input is a ValueError subclass so callers can catch either."""
from __future__ import annotations


class InvalidRequest(ValueError):
    """The request itself is wrong. The message names the field and the allowed range; `field` is the engine-side
    name of that field (e.g. "max_tokens", "text", "voice"), so a front end can map it to its own input name."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class EngineOverloaded(RuntimeError):
    """The admission queue is full; the client should retry later."""


class EngineDead(RuntimeError):
    """The engine loop failed and stopped; no further requests are served."""
