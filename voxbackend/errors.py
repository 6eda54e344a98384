"""Errors the engine raises to callers. Bad input is a ValueError subclass so callers can catch either."""


class InvalidRequest(ValueError):
    """The request itself is wrong (names the field and the allowed range)."""


class EngineOverloaded(RuntimeError):
    """The admission queue is full; the client should retry later."""


class EngineDead(RuntimeError):
    """The engine loop failed and stopped; no further requests are served."""
