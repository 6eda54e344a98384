"""A stand-in for the Triton response sender (streams.Responder) that records what the response loop sends."""
from __future__ import annotations

import threading

import numpy as np


class Recorder:
    def __init__(self, cancelled: bool = False):
        self.sent: list[tuple[dict | None, str | None, bool]] = []
        self.cancelled = cancelled
        self.done = threading.Event()

    def send(self, outputs, error, final):
        self.sent.append((outputs, error, final))
        if final:
            self.done.set()

    def is_cancelled(self):
        return self.cancelled

    @property
    def audio(self) -> np.ndarray:
        chunks = [o["AUDIO"] for o, _, final in self.sent if o is not None and not final]
        return np.concatenate(chunks) if chunks else np.zeros(0, np.float32)

    @property
    def final(self) -> tuple[dict | None, str | None, bool]:
        """The last send, once the final one has come (within 10 s)."""
        assert self.done.wait(10), "no final response"
        return self.sent[-1]
