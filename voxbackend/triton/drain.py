"""Noticing, from inside a model, that the server began to stop.

A plain tritonserver that gets SIGTERM (or SIGINT) tells its models nothing until it finalizes them, which for a
decoupled Python model comes after its last stream ended. Early on, though, it closes its HTTP endpoint (just
after readiness starts failing) and refuses new requests at each model's scheduler; running streams and started
text sequences go on. DrainWatch connects to the server's HTTP port (read from the server's command line: the
stub's parent) every
poll_s, and again whenever the model calls check() (as each request arrives), and calls on_drain once, when the
port that accepted connections refuses them, so the engine model refuses new streams and bounds how long its
open ones may still run (drain_grace_s). Without an HTTP endpoint (--allow-http=false) it
never fires: streams then run until they end or Triton's --exit-timeout-secs.

Not pb_utils.is_model_ready: in 2.51 the stub's call raised once the server was stopping and then hung the stub's
message thread (responses and logs stopped), seen on this machine.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
from pathlib import Path
from typing import Callable

log = logging.getLogger("voxbackend.triton")
DRAINING = "draining: the server is stopping and takes no new streams; retry on another instance"


def grace_expired(grace_s: float) -> str:
    return (f"draining: the server is stopping and this stream did not finish within its drain grace period "
            f"({grace_s:g} s); retry on another instance")


def server_http_address(server_pid: int | None = None) -> tuple[str, int] | None:
    """(host, port) of a tritonserver's HTTP endpoint from its command line; None when HTTP is off or unknown."""
    try:
        args = Path(f"/proc/{server_pid or os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    options: dict[str, str] = {}
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            key, eq, value = arg.partition("=")
            options[key] = value if eq else (args[i + 1] if i + 1 < len(args) else "")
    if options.get("--allow-http", "true").lower() in ("false", "0", "no", "off"):
        return None
    host = options.get("--http-address", "0.0.0.0")
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    try:
        return host, int(options.get("--http-port", "8000"))
    except ValueError:
        return None


def http_port_open(address: tuple[str, int], timeout: float = 0.5) -> bool | None:
    """True if the port accepts a connection, False if it refuses one, None if unknown (a busy host)."""
    try:
        socket.create_connection(address, timeout=timeout).close()
        return True
    except ConnectionRefusedError:
        return False
    except OSError:
        return None


class DrainWatch:
    def __init__(self, on_drain: Callable[[], None], address: tuple[str, int] | None = None, poll_s: float = 0.25):
        self._address = address if address is not None else server_http_address()
        self._on_drain = on_drain
        self._poll_s = poll_s
        self._seen_open = False  # the endpoint starts after the models load: only open -> refused is a stop
        self._fired = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="voxbackend-drain-watch", daemon=True)
        if self._address is not None:
            self._thread.start()

    def check(self) -> bool:
        """Look now (a loopback connect): True once the server is stopping. The model calls it as a request
        arrives, so a request sent after readiness failed is refused even between two polls."""
        if self._fired or self._address is None:
            return self._fired
        state = http_port_open(self._address)
        with self._lock:
            if state:
                self._seen_open = True
            elif state is False and self._seen_open and not self._fired:
                self._fired = True
                log.info("the server is stopping: draining")
                self._on_drain()
        return self._fired

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            if self.check():
                return

    def close(self) -> None:
        self._stop.set()
