"""Find, start, wait for and stop a tritonserver that serves a voxbackend model repository.

Works with the NGC container (/opt/tritonserver) and with the `nvidia-pytriton` wheel (CPU machines, tests).
What the wheel needs (docs/triton.md, Launcher): a backend directory holding the Python stub built for this Python,
the current interpreter's bin/ first on PATH (the stub takes sys.prefix from the first python3 there and
ignores PYTHONPATH), and the wheel's bundled libraries on LD_LIBRARY_PATH.
"""
from __future__ import annotations

import os
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


def stub_cpu_ticks(server_pid: int) -> dict[int, int]:
    """pid -> user + system CPU ticks so far, for each stub of the server."""
    ticks = {}
    for pid in stub_pids(server_pid):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks[pid] = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
        except (OSError, IndexError, ValueError):
            continue
    return ticks


def stub_pids(server_pid: int) -> list[int]:
    """The Python backend stubs the server started (its children running triton_python_backend_stub).

    Reads the server's own /proc children lists (cheap: this runs while a loaded machine unloads models)."""
    pids = []
    for children in Path(f"/proc/{server_pid}/task").glob("*/children"):
        try:
            for pid in children.read_text().split():
                if b"triton_python_backend_stub" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    pids.append(int(pid))
        except OSError:
            continue  # exited while we looked
    return pids


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the server and its stubs

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
            "--exit-timeout-secs=15", f"--log-verbose={self.log_verbose}", *self.extra_args,
        ]

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
        self._log = open(self.log_file, "ab")
        self.proc = subprocess.Popen(
            self.command(install, backend_dir), env={**server_env(install), **self.env}, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True)  # own process group: stop() can end the stubs too
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.ready():
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

    def stop(self, timeout: float = 30.0) -> int | None:
        """End every stream, SIGINT (models are unloaded, finalize() runs), SIGKILL to the group if it hangs.

        Returns the exit code, or 0 when every stream ended and every model that can unload did, and only
        Triton's own bookkeeping kept the process alive: in 2.51 a request Triton refused (wrong dtype or shape)
        and the client then cancelled keeps its model (ensemble or not) from unloading, and the process would
        wait out --exit-timeout-secs and exit 1.
        """
        if self.proc is None:
            return None
        code = None
        if self.proc.poll() is None:
            had_stubs = bool(stub_pids(self.proc.pid))
            if send_shutdown(self.proc.pid):  # streams end now: SIGINT would wait for every in-flight request
                self._wait_streams_closed()
            since = Path(self.log_file).stat().st_size
            self.proc.send_signal(signal.SIGINT)
            code = self._wait_unloaded(timeout, had_stubs, since)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # stray stubs of this server's group, if any
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self._log.close()
        code = self.proc.returncode if code is None else code
        self.proc = None
        return code

    def _wait_streams_closed(self, timeout: float = 5.0, settle_s: float = 0.3) -> None:
        """Until the engines report no open stream, then a moment for the final responses to pass the ensemble's
        postprocess (once SIGINT arrives, Triton refuses new step requests, final ones included)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                text = urllib.request.urlopen(self.metrics_url, timeout=2).read().decode()
            except OSError:
                break
            open_streams = sum(float(v) for v in re.findall(r"^voxbackend_active_streams(?:\{[^}]*\})? (\S+)$",
                                                            text, re.MULTILINE))
            if open_streams == 0:
                break
            time.sleep(0.1)
        time.sleep(settle_s)

    def _wait_unloaded(self, timeout: float, had_stubs: bool, log_offset: int, settle_s: float = 2.0) -> int | None:
        """Wait for the process to exit. 0 (clean) if it is still there once Triton has no request in flight and
        its remaining model stubs (none, or those of models it keeps alive for a leaked request) sat idle for
        settle_s: every stream has ended and every model that can unload has."""
        deadline = time.monotonic() + timeout
        window: tuple[float, dict[int, int]] | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return None
            busy = stub_cpu_ticks(self.proc.pid)
            if not had_stubs or not self._log_since(log_offset, "Found 0 model versions that have in-flight"):
                window = None
            elif window is None or set(window[1]) != set(busy):
                window = (time.monotonic(), busy)
            elif time.monotonic() - window[0] >= settle_s:
                used = sum(busy[p] - window[1][p] for p in busy)
                if used <= IDLE_TICKS_PER_S * settle_s * max(1, len(busy)):
                    with open(self.log_file, "a") as log:
                        log.write(f"voxbackend: every stream ended and every model that can unload did; "
                                  f"{len(busy)} idle stub(s) of models Triton 2.51 keeps alive for a request it "
                                  "refused and the client cancelled; ending the server\n")
                    return 0
                window = (time.monotonic(), busy)
            time.sleep(0.25)
        return None  # timed out: killed below, its code reported

    def close(self) -> int | None:
        """stop() and remove the temporary work folder (log included) if this object made one."""
        code = self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        return code

    def __enter__(self) -> "TritonServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.close()
