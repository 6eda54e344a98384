"""Find, start, wait for and stop a tritonserver that serves a voxbackend model repository.

Works with the NGC container (/opt/tritonserver) and with the `nvidia-pytriton` wheel (CPU machines, tests).
What the wheel needs (docs/triton.md, Launcher): a backend directory holding the Python stub built for this Python,
the current interpreter's bin/ first on PATH (the stub takes sys.prefix from the first python3 there and
ignores PYTHONPATH), and the wheel's bundled libraries on LD_LIBRARY_PATH.
"""
from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from voxbackend.triton.cancel_channel import send_shutdown

NGC_ROOT = Path("/opt/tritonserver")


@dataclass
class TritonInstall:
    binary: Path
    backends: Path  # folder holding python/libtriton_python.so
    stub: Path | None  # the wheel's per-Python stub; None where the backend folder already has one (NGC)
    lib_dirs: list[Path] = field(default_factory=list)


def find_tritonserver() -> TritonInstall:
    """$TRITONSERVER_ROOT, then /opt/tritonserver (NGC), then the nvidia-pytriton wheel."""
    for root in (os.environ.get("TRITONSERVER_ROOT"), NGC_ROOT):
        if root and (Path(root) / "bin" / "tritonserver").is_file():
            root = Path(root)
            return TritonInstall(root / "bin" / "tritonserver", root / "backends", None, [root / "lib"])
    try:
        import pytriton
    except ImportError:
        raise FileNotFoundError(
            "no tritonserver: not in /opt/tritonserver or $TRITONSERVER_ROOT, and nvidia-pytriton is not installed "
            "(pip install 'voxbackend[triton]')") from None
    root = Path(pytriton.__file__).parent / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise FileNotFoundError(f"nvidia-pytriton has no Python backend stub for Python {version} ({stub})")
    libs = Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs"
    return TritonInstall(root / "bin" / "tritonserver", root / "backends", stub, [libs])


def prepare_backend_dir(install: TritonInstall, dest: Path) -> Path:
    """A backend directory whose python/ backend has the stub matching this interpreter."""
    if install.stub is None:
        return install.backends
    python = Path(dest) / "python"
    python.mkdir(parents=True, exist_ok=True)
    for item in (install.backends / "python").iterdir():
        if item.is_file() and not (python / item.name).exists():
            os.symlink(item, python / item.name)
    target = python / "triton_python_backend_stub"
    if not target.exists():
        shutil.copy2(install.stub, target)  # a copy, not a link: the backend resolves the stub's own folder
    return Path(dest)


def server_env(install: TritonInstall, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", "")])
    libs = [str(p) for p in install.lib_dirs if p.is_dir()]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p])
    return env


IDLE_TICKS_PER_S = 5  # CPU clock ticks (1/100 s) per second below which a stub counts as idle


def stub_states(server_pid: int) -> dict[int, tuple[str, int]]:
    """pid -> (model it serves, user + system CPU ticks so far), for each stub of the server."""
    states = {}
    for pid, model in stub_pids(server_pid).items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            states[pid] = (model, int(fields[11]) + int(fields[12]))  # utime, stime (fields 14 and 15 of stat)
        except (OSError, IndexError, ValueError):
            continue
    return states


def stub_pids(server_pid: int) -> dict[int, str]:
    """pid -> model, for the Python backend stubs the server started (its children running
    triton_python_backend_stub <repository>/<model>/<version>/model.py ...).

    Reads the server's own /proc children lists (cheap: this runs while a loaded machine unloads models)."""
    pids = {}
    for children in Path(f"/proc/{server_pid}/task").glob("*/children"):
        try:
            for pid in children.read_text().split():
                args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if b"triton_python_backend_stub" in args[0]:
                    pids[int(pid)] = Path(args[1].decode(errors="replace")).parts[-3] if len(args) > 1 else "?"
        except (OSError, IndexError):
            continue  # exited while we looked
    return pids


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie holds no memory and runs nothing)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


SHM_DIR = Path("/dev/shm")


_PORT_PICKER = random.Random()  # its own: a test seeding the global random must not make two servers pick alike


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on, for a server to bind a moment later. Picked below the ephemeral range: a port
    from bind(port 0) lies inside it, where any outgoing connection (a client's, on a busy machine) may take it
    first, and the server then fails to start."""
    low = ephemeral_ports()[0]
    for _ in range(200):
        port = _PORT_PICKER.randrange(max(1024, low - 16384), low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # that span is full: let the kernel pick
        s.bind((host, 0))
        return s.getsockname()[1]


# what Triton 2.51 prints when its Python backend aborts while starting stubs (seen under load on 2 cores)
LOAD_RACE = "boost::interprocess::lock_exception"
_LOADING = re.compile(r'"loading: (.+):\d+"')  # tritonserver's log lines, at every --log-verbose
_LOADED = re.compile(r"\"successfully loaded '([^']+)'")


class LoadProgress:
    """How far a starting tritonserver is with loading its models, read from its log: Triton opens its HTTP port,
    repository index included, only once every model has loaded, so the log is the one place that shows it.

    poll() says a line when the number of ready models changed, or every every_s seconds otherwise, e.g.
    `loading models: 3/11 ready (orpheus, orpheus_engine, csm) 24 s`: the names are those ready since the last line.
    """

    def __init__(self, log_file: Path, offset: int, say: Callable[[str], None], every_s: float = 5.0) -> None:
        self.log_file, self.offset, self.say, self.every_s = Path(log_file), offset, say, every_s
        self.t0 = self.said_at = time.monotonic()
        self.models: set[str] = set()
        self.ready: list[str] = []
        self.shown = -1  # ready models at the last line (-1: none yet; the first says the total at once)

    def poll(self) -> None:
        with open(self.log_file, "rb") as f:
            f.seek(self.offset)
            text = f.read()
        text = text[:text.rfind(b"\n") + 1]  # whole lines only: the server may be writing one
        self.offset += len(text)
        for line in text.decode(errors="replace").splitlines():
            if m := _LOADING.search(line):
                self.models.add(m.group(1))
            elif (m := _LOADED.search(line)) and m.group(1) not in self.ready:
                self.ready.append(m.group(1))
        now = time.monotonic()
        if self.models and (len(self.ready) != self.shown or now - self.said_at >= self.every_s):
            new = self.ready[max(self.shown, 0):]
            self.say(f"loading models: {len(self.ready)}/{len(self.models | set(self.ready))} ready"
                     + (f" ({', '.join(new)})" if new else "") + f" {now - self.t0:.0f} s")
            self.shown, self.said_at = len(self.ready), now


@dataclass
class TritonServer:
    """One tritonserver process. Ports of 0 are replaced by free ones at start."""

    model_repository: Path
    host: str = "127.0.0.1"
    http_port: int = 0
    grpc_port: int = 0
    metrics_port: int = 0
    log_file: Path | None = None  # default: a temporary file (shown when startup fails)
    log_verbose: int = 0
    extra_args: list[str] = field(default_factory=list)
    work_dir: Path | None = None  # backend directory lives here (default: a temporary folder)
    remove_work_dir: bool = False  # close() removes work_dir (a temporary one given by the caller)
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the server and its stubs
    # told how model loading goes while start() waits (LoadProgress lines; `voxbackend serve` on a terminal)
    progress: Callable[[str], None] | None = None

    def __post_init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None

    @property
    def grpc_url(self) -> str:
        return f"{self._client_host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"{self._client_host}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self._client_host}:{self.metrics_port}/metrics"

    @property
    def _client_host(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host

    def command(self, install: TritonInstall, backend_dir: Path) -> list[str]:
        return [
            str(install.binary), f"--model-repository={self.model_repository}",
            f"--backend-directory={backend_dir}",
            f"--http-address={self.host}", f"--http-port={self.http_port}",
            f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
            "--allow-gpu-metrics=false" if not Path("/dev/nvidia0").exists() else "--allow-gpu-metrics=true",
            "--exit-timeout-secs=30", f"--log-verbose={self.log_verbose}",
            # the configs are complete: without this the Python backend starts one extra stub per model at load
            # just to ask it for config additions (about 3 s of a core each)
            "--disable-auto-complete-config",
            # a stub that answers its first message later than this fails its model's load; the default 30 s was
            # seen to bring the whole server down (a boost lock_exception) while 26 stubs loaded on 2 busy cores
            "--backend-config=python,stub-timeout-seconds=120",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}", *self.extra_args,
        ]

    @property
    def shm_prefix(self) -> str:
        """The names of this server's Python-backend shared-memory regions in /dev/shm start with this (unique
        while it runs: its gRPC port), so stop() can find what a killed stub or server left behind."""
        return f"voxbackend_{os.getpid()}_{self.grpc_port}_"

    def start(self, timeout: float = 300.0) -> "TritonServer":
        install = find_tritonserver()
        if self.work_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="voxbackend-triton-")
            self.work_dir = Path(self._tmp.name)
        backend_dir = prepare_backend_dir(install, Path(self.work_dir) / "backends")
        for name in ("http_port", "grpc_port", "metrics_port"):
            if not getattr(self, name):
                setattr(self, name, free_port(self._client_host))
        if self.log_file is None:
            self.log_file = Path(self.work_dir) / "tritonserver.log"
        for attempt in range(2):
            self._log = open(self.log_file, "ab")
            self._log_start = Path(self.log_file).stat().st_size  # this run's lines follow those of earlier runs
            self.proc = subprocess.Popen(
                self.command(install, backend_dir), env={**server_env(install), **self.env}, stdout=self._log,
                stderr=subprocess.STDOUT, start_new_session=True)  # own process group: stop() can end the stubs too
            try:
                self.wait_ready(timeout)
                return self
            except BaseException:
                aborted = self.proc.poll() == -signal.SIGABRT and self._log_since(self._log_start, LOAD_RACE)
                self.stop()
                if not aborted or attempt:
                    raise
            # Triton 2.51's Python backend now and then aborts while its stubs start (docs/triton.md): once more
            print(f"tritonserver aborted while loading its models ({LOAD_RACE}); starting it again", file=sys.stderr)
        return self

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        loading = LoadProgress(self.log_file, self._log_start, self.progress) if self.progress else None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.proc.returncode}:\n{self.log_tail()}")
            up = self.ready()
            if loading is not None:  # after ready(): the last line shows every model ready
                try:
                    loading.poll()
                except Exception:
                    loading = None  # progress is a courtesy: it never holds up or breaks a start
            if up:
                return
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def _log_since(self, offset: int, text: str) -> bool:
        try:
            with open(self.log_file, "rb") as f:
                f.seek(offset)
                return text.encode() in f.read()
        except OSError:
            return False

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(Path(self.log_file).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 30.0, drain: bool = False) -> int | None:
        """End every stream, SIGINT (models are unloaded, finalize() runs), SIGKILL to the group if it hangs.

        drain: stop as Docker and Kubernetes do, with SIGTERM and no SHUTDOWN: Triton refuses new requests and
        the engines let their open streams finish within their drain_grace_s (docs/triton.md, "Stopping").

        Returns the exit code, or 0 when every stream ended and every model that can unload did, and only
        Triton's own bookkeeping kept the process alive: in 2.51 a request Triton refused (wrong dtype or shape)
        and the client then cancelled keeps its model from unloading, and the process would
        wait out --exit-timeout-secs and exit 1.
        """
        if self.proc is None:
            return None
        code = None
        t0 = time.monotonic()
        stopping = self.proc.poll() is None
        if stopping:
            had_stubs = bool(stub_pids(self.proc.pid))
            since = Path(self.log_file).stat().st_size
            if drain:
                self.proc.send_signal(signal.SIGTERM)
                closed = self._wait_streams_closed(timeout)
                self._note("SIGTERM: " + (f"every stream ended after {closed:.1f} s" if closed is not None
                                          else "streams still open"))
            else:
                told = send_shutdown(self.proc.pid)  # streams end now: SIGINT would wait for every one
                if told:
                    closed = self._wait_streams_closed()
                    self._note(f"SHUTDOWN to {told} engine instance(s): " + (
                        f"every stream ended after {closed:.1f} s" if closed is not None else "streams still open"))
                self.proc.send_signal(signal.SIGINT)
            code = self._wait_unloaded(timeout, had_stubs, since)
        left = list(stub_pids(self.proc.pid)) if self.proc.poll() is None else []  # killed below
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # stray stubs of this server's group, if any
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        # a killed stub outlives the server by a moment (its memory is torn down): return once none runs
        deadline = time.monotonic() + 10
        while any(_running(pid) for pid in left) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._remove_shm_regions()
        if stopping:
            self._note(f"stopped {time.monotonic() - t0:.1f} s after the stop began")
        self._log.close()
        code = self.proc.returncode if code is None else code
        self.proc = None
        return code

    def _remove_shm_regions(self) -> None:
        """The Python backend unlinks its regions when a stub exits normally; a stub killed (above, or by anyone)
        leaves them in /dev/shm, which is memory, for good: a few MB per stopped server."""
        left = sorted(SHM_DIR.glob(self.shm_prefix + "*"))
        for path in left:
            path.unlink(missing_ok=True)
        if left:
            self._note(f"removed {len(left)} shared-memory region(s) that killed stubs left in {SHM_DIR}")

    def _wait_streams_closed(self, timeout: float = 5.0, settle_s: float = 0.3) -> float | None:
        """Until every engine (the front models' included) reports no open stream, and a moment more. Returns the
        seconds it took, None if streams were still open at the timeout."""
        t0 = time.monotonic()
        took = None
        while time.monotonic() - t0 < timeout and self.proc.poll() is None:
            try:
                text = urllib.request.urlopen(self.metrics_url, timeout=2).read().decode()
            except OSError:
                break
            open_streams = sum(float(v) for v in re.findall(
                r"^voxbackend_active_streams(?:\{[^}]*\})? (\S+)$", text, re.MULTILINE))
            if open_streams == 0:
                took = time.monotonic() - t0
                break
            time.sleep(0.1)
        time.sleep(settle_s)
        return took

    def _note(self, text: str) -> None:
        """A line of ours in the server's log (the log an operator reads)."""
        with open(self.log_file, "a") as log:
            log.write(f"voxbackend: {text}\n")

    def _wait_unloaded(self, timeout: float, had_stubs: bool, log_offset: int, settle_s: float = 2.0) -> int | None:
        """Wait for the process to exit. 0 (clean) if it is still there once Triton has no request in flight and
        every model that still has stubs has had the same stubs, idle, for settle_s (a model Triton keeps alive
        for a leaked request; one that unloads loses a stub within ~1.3 s: Triton finalizes a model's instances
        one after another, each about a second after the last): every stream has ended and every model that can
        unload has. Each model is judged on its own, so the slowest unload is not followed by a full settle_s."""
        deadline = time.monotonic() + timeout
        windows: dict[str, tuple[float, dict[int, int]]] = {}  # model -> (since, pid -> CPU ticks then)
        none_since: float | None = None  # no stub left, and the process is still there
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return None
            if not had_stubs or not self._log_since(log_offset, "Found 0 model versions that have in-flight"):
                time.sleep(0.25)
                continue
            now = time.monotonic()
            by_model: dict[str, dict[int, int]] = {}
            for pid, (model, ticks) in stub_states(self.proc.pid).items():
                by_model.setdefault(model, {})[pid] = ticks
            for model in set(windows) - set(by_model):
                del windows[model]  # unloaded
            settled = True
            for model, ticks in by_model.items():
                since, before = windows.get(model, (now, {}))
                used = sum(ticks[p] - before[p] for p in ticks) if set(before) == set(ticks) else None
                if used is None or used > IDLE_TICKS_PER_S * max(settle_s, now - since) * len(ticks):
                    windows[model] = (now, ticks)  # new, changed or busy: unloading, judged again from now
                    settled = False
                elif now - since < settle_s:
                    settled = False
            none_since = (none_since or now) if not by_model else None
            if by_model and settled or none_since is not None and now - none_since >= settle_s:
                kept = sorted(by_model)
                self._note("every stream ended and every model that can unload did; " + (
                    f"{sum(map(len, by_model.values()))} idle stub(s) of {', '.join(kept)}, which Triton 2.51 "
                    "keeps alive for a request it refused and the client cancelled" if kept else
                    "only stub-less models are left") + "; ending the server")
                return 0
            time.sleep(0.25)
        return None  # timed out: killed below, its code reported

    def close(self, drain: bool = False) -> int | None:
        """stop() and remove the temporary work folder (log included) if this object made one."""
        code = self.stop(drain=drain)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        elif self.remove_work_dir and self.work_dir is not None:
            shutil.rmtree(self.work_dir, ignore_errors=True)
        return code

    def __enter__(self) -> "TritonServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.close()
