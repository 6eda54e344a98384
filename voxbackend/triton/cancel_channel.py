"""Cancellation from the ensemble's postprocess step back to the engine instance that owns the stream.

Triton 2.51 does not pass an ensemble's cancellation to a decoupled step that is already running: the engine's
is_cancelled() stays False while the ensemble checks cancellation only when it schedules the next step, so
each later audio_postprocess request sees request.is_cancelled() == True. The postprocess then sends the
engine's stream id as one datagram to the engine instance's abstract Unix socket (named inside the id), and
the instance cancels the request in its engine. Same host only, which is where ensemble steps always run.
"""
from __future__ import annotations

import socket
import threading
import uuid
from typing import Callable

SEP = "#"


class CancelListener:
    """One per engine instance: receives request ids and hands them to on_cancel (from its own thread)."""

    def __init__(self, on_cancel: Callable[[str], None]):
        self.address = f"voxbackend-cancel-{uuid.uuid4().hex}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind("\0" + self.address)  # abstract namespace: no file to clean up
        self._on_cancel = on_cancel
        self._thread = threading.Thread(target=self._run, name="voxbackend-cancel", daemon=True)
        self._thread.start()

    def stream_id(self, request_id: str) -> str:
        return f"{self.address}{SEP}{request_id}"

    def _run(self) -> None:
        while True:
            try:
                data = self._sock.recv(4096)
            except OSError:
                return  # closed
            if data:
                self._on_cancel(data.decode("utf-8", "replace"))

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def send_cancel(stream_id: str) -> bool:
    """Ask the owning engine instance to cancel; False when the id is malformed or the instance is gone."""
    address, sep, request_id = stream_id.partition(SEP)
    if not sep or not address.startswith("voxbackend-cancel-"):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        try:
            s.sendto(request_id.encode(), "\0" + address)
            return True
        except OSError:
            return False
