"""How windows travel between the engines and the codec stage: a Unix socket per codec instance, under a folder
named after the server process and the codec model, which the engines of that server find and connect to.

Not a Triton request per window. Triton 2.51 refuses new requests to every model once it begins to stop, so the
engines' streams could not finish during a drain (docs/triton.md, "Stopping"); and its Python backend builds BLS
responses without the GIL, racing an engine model's own threads. The socket carries only bytes (wire.py, loaded
with weights_only), its folder is the user's own (mode 0700), and the stage's unload waits for the engines to
leave, so a drain finishes its streams' audio.
"""
from __future__ import annotations

import itertools
import logging
import os
import socket
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path

from voxbackend.codec_stage.urgent_queue import UrgentWindows
from voxbackend.codec_stage.wire import pack, unpack

log = logging.getLogger("voxbackend.codec_stage")


class CodecStageError(RuntimeError):
    pass


def socket_dir(codec_model: str, server_pid: int | None = None) -> Path:
    """Where one server's instances of `codec_model` listen: a Triton model's stub is a child of its server."""
    return (Path(tempfile.gettempdir()) / f"voxbackend-codec-{os.getuid()}" / str(server_pid or os.getppid())
            / codec_model)


class CodecServer:
    """One codec instance's listener: every connected engine's window groups go into its UrgentWindows."""

    def __init__(self, path: Path, windows: UrgentWindows, device: str = "cpu"):
        self.path = Path(path)
        self.windows = windows
        self.device = device
        self._ids = itertools.count(1)
        self._engines: dict[int, Connection] = {}
        self._changed = threading.Condition()
        self._listener: Listener | None = None
        self._closed = False

    def start(self) -> "CodecServer":
        for folder in reversed([self.path.parent, *self.path.parent.parents][:3]):
            folder.mkdir(mode=0o700, exist_ok=True)  # voxbackend-codec-<uid>/<server pid>/<model>
        self.path.unlink(missing_ok=True)  # a socket left by a killed server whose pid came round again
        self._listener = Listener(str(self.path), family="AF_UNIX")
        threading.Thread(target=self._accept, name="codec-stage-accept", daemon=True).start()
        return self

    @property
    def engines(self) -> int:
        return len(self._engines)

    def wait_for_engines(self, timeout_s: float) -> bool:
        """Until every engine has disconnected (they do when they unload), at most timeout_s; whether they did."""
        end = time.monotonic() + timeout_s
        with self._changed:
            while self._engines and time.monotonic() < end:
                self._changed.wait(timeout=max(0.0, end - time.monotonic()))
            return not self._engines

    def close(self) -> None:
        with self._changed:  # an engine accepted from now on is hung up at once (_accept)
            self._closed = True
            engines = list(self._engines.values())
        if self._listener is not None:
            self._listener.close()
        self.path.unlink(missing_ok=True)
        for folder in (self.path.parent, self.path.parent.parent):  # the model's and the server's, once empty
            try:
                folder.rmdir()
            except OSError:
                pass
        for conn in engines:
            _hang_up(conn)  # its reader thread sees the end and closes it

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except OSError:
                return
            source = next(self._ids)
            with self._changed:
                if self._closed:  # accepted while close() ran: it did not see this one
                    conn.close()
                    return
                self._engines[source] = conn
            threading.Thread(target=self._serve, args=(source, conn), name=f"codec-stage-engine-{source}",
                             daemon=True).start()

    def _serve(self, source: int, conn: Connection) -> None:
        send_lock = threading.Lock()
        try:
            while True:
                data = conn.recv_bytes()
                try:
                    msg = unpack(data, self.device)
                    group_id, jobs, slack_s = int(msg["id"]), list(msg["jobs"]), float(msg["slack_s"])
                except Exception as exc:  # noqa: BLE001 - not from one of our engines, or broken: drop this link
                    log.error("codec stage: unreadable message from engine %d (%s); closing its link", source, exc)
                    return
                self.windows.put(jobs, slack_s, partial(self._reply, conn, send_lock, group_id), source)
        except (EOFError, OSError):
            pass  # the engine went away
        finally:
            conn.close()
            with self._changed:
                self._engines.pop(source, None)
                self._changed.notify_all()

    @staticmethod
    def _reply(conn: Connection, send_lock: threading.Lock, group_id: int, audio, state, error) -> None:
        data = pack({"id": group_id, "audio": audio, "state": state, "error": error})
        with send_lock:
            conn.send_bytes(data)


@dataclass
class _Link:
    path: Path
    conn: Connection
    pending: dict[int, tuple[Future, int]] = field(default_factory=dict)  # group id -> (its future, its windows)
    windows: int = 0  # outstanding on this link
    lock: threading.Lock = field(default_factory=threading.Lock)


class SocketCodecClient:
    """An engine's links to every instance of one codec stage (engine/remote_codec.py's CodecClient). Each group
    goes to the instance with the fewest windows outstanding, ties taken in turn (so an idle stage's instances share
    the work too); a link that breaks fails its own groups only."""

    RESCAN_S = 1.0

    def __init__(self, folder: Path, device: str = "cpu"):
        self.folder = Path(folder)
        self.device = device
        self._ids = itertools.count(1)
        self._links: dict[Path, _Link] = {}
        self._lock = threading.Lock()
        self._scanned_at = float("-inf")
        self._turn = itertools.count()
        self._closed = False

    def decode(self, jobs: list, slack_s: float) -> Future:
        future: Future = Future()
        link = self._pick()
        if link is None:
            future.set_exception(CodecStageError(f"no codec stage instance is listening under {self.folder}"))
            return future
        group_id = next(self._ids)
        data = pack({"id": group_id, "jobs": jobs, "slack_s": float(slack_s)})
        with link.lock:
            link.pending[group_id] = (future, len(jobs))
            link.windows += len(jobs)
            try:
                link.conn.send_bytes(data)
            except OSError as exc:
                link.pending.pop(group_id)
                link.windows -= len(jobs)
                future.set_exception(CodecStageError(f"codec stage {link.path.name}: {exc}"))
        return future

    def close(self) -> None:
        self._closed = True
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            _hang_up(link.conn)

    def _pick(self) -> _Link | None:
        with self._lock:
            now = time.monotonic()
            if not self._links or now - self._scanned_at > self.RESCAN_S:
                self._scanned_at = now
                for path in sorted(self.folder.glob("*.sock")) if self.folder.is_dir() else []:
                    if path not in self._links:
                        self._connect(path)
            links = list(self._links.values())
            if not links:
                return None
            first = next(self._turn) % len(links)
            return min(links[first:] + links[:first], key=lambda link: link.windows)

    def _connect(self, path: Path) -> None:
        try:
            conn = Client(str(path), family="AF_UNIX")
        except OSError:
            return  # a socket left by a stage that is gone
        link = self._links[path] = _Link(path, conn)
        threading.Thread(target=self._read, args=(link,), name=f"codec-link-{path.stem}", daemon=True).start()

    def _read(self, link: _Link) -> None:
        reason = "closed the connection"
        try:
            while True:
                msg = unpack(link.conn.recv_bytes(), self.device)
                with link.lock:
                    future, windows = link.pending.pop(int(msg["id"]))
                    link.windows -= windows
                if msg["error"] is not None:
                    future.set_exception(CodecStageError(msg["error"]))
                else:
                    future.set_result((msg["audio"], msg["state"]))
        except (EOFError, OSError) as exc:  # a reset: the stage closed before it read what this link sent
            reason = "closed the connection" if isinstance(exc, (EOFError, ConnectionResetError)) else str(exc)
        except Exception as exc:  # noqa: BLE001 - an unreadable reply ends this link, not the engine
            reason = f"sent an unreadable reply ({exc})"
        with self._lock:
            if self._links.get(link.path) is link:
                del self._links[link.path]
        with link.lock:
            pending, link.pending = link.pending, {}
        for future, _ in pending.values():
            if not self._closed:
                future.set_exception(CodecStageError(f"codec stage {link.path.name} {reason}"))
        link.conn.close()


def _hang_up(conn: Connection) -> None:
    """End a link that another thread is reading: that thread gets EOF and closes it (closing the descriptor
    under it instead could close a descriptor reused meanwhile)."""
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed
