"""Messages to an engine instance from outside Triton: a stream's cancellation, and the launcher's shutdown.

A model that chains `<model>_preprocess` and `<model>_engine` by BLS cannot cancel its BLS request in Triton
2.51, so the engine's is_cancelled() stays False when that model's client goes away. It can send the engine's
stream id (its STREAM_ID output) as one datagram to the engine instance's abstract Unix socket (named inside the
id), and the instance cancels the request in its engine. A queued stream has sent no audio yet, so for such
callers (CANCEL_PROBES) the engine sends probes (streams.PROBE) that tell them the id.

On SIGINT Triton waits for every in-flight request before it unloads a model, so the launcher first sends
SHUTDOWN to each engine instance of its server (the socket names carry the server's pid): the instance ends
every stream with a final response and refuses new ones. Same host only, which is where a model's parts and the
launcher run.
"""
from __future__ import annotations

import os
import socket
import threading
import uuid
from pathlib import Path
from typing import Callable

SEP = "#"
PREFIX = "voxbackend-cancel-"
SHUTDOWN = b"\0shutdown"  # never a request id


class CancelListener:
    """One per engine instance: receives request ids and hands them to on_cancel (from its own thread)."""

    def __init__(self, on_cancel: Callable[[str], None], on_shutdown: Callable[[], None] = lambda: None):
        # the stub's parent is the tritonserver process: its pid lets the launcher find this socket
        self.address = f"{PREFIX}{os.getppid()}-{uuid.uuid4().hex}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind("\0" + self.address)  # abstract namespace: no file to clean up
        self._on_cancel = on_cancel
        self._on_shutdown = on_shutdown
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
            if data == SHUTDOWN:
                self._on_shutdown()
            elif data:
                self._on_cancel(data.decode("utf-8", "replace"))

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def _send(address: str, data: bytes) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        try:
            s.sendto(data, "\0" + address)
            return True
        except OSError:
            return False


def send_cancel(stream_id: str) -> bool:
    """Ask the owning engine instance to cancel; False when the id is malformed or the instance is gone."""
    address, sep, request_id = stream_id.partition(SEP)
    if not sep or not address.startswith(PREFIX):
        return False
    return _send(address, request_id.encode())


def server_listeners(server_pid: int) -> list[str]:
    """Addresses of the engine instances of one tritonserver process (from /proc/net/unix)."""
    try:
        lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return []
    want = f"@{PREFIX}{server_pid}-"
    return sorted({line.split()[-1][1:] for line in lines if line.split()[-1].startswith(want)})


def send_shutdown(server_pid: int) -> int:
    """Tell every engine instance of that server to end its streams; returns how many were told."""
    return sum(_send(address, SHUTDOWN) for address in server_listeners(server_pid))
