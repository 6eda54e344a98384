"""Run the speech API (uvicorn) in a background thread next to a tritonserver, until stop()."""
from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field


@dataclass
class ApiServer:
    triton_url: str  # Triton's gRPC host:port
    metrics_url: str | None = None  # Triton's http://host:port/metrics
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port, chosen at start
    log_level: str = "warning"
    prefetch_voices: bool = True
    _thread: threading.Thread | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 120.0, wait_healthy: bool = True) -> "ApiServer":
        import uvicorn

        from voxbackend.api.app import create_app
        from voxbackend.deploy.server import free_port

        if not self.port:
            self.port = free_port(self.host if self.host not in ("0.0.0.0", "") else "127.0.0.1")
        app = create_app(self.triton_url, self.metrics_url, prefetch_voices=self.prefetch_voices)
        self._server = uvicorn.Server(uvicorn.Config(app, host=self.host, port=self.port, log_level=self.log_level,
                                                     ws="websockets-sansio", lifespan="on"))
        self._thread = threading.Thread(target=self._server.run, name="voxbackend-api", daemon=True)
        self._thread.start()
        self.wait(timeout, healthy=wait_healthy)
        return self

    def health(self) -> int | None:
        """GET /health's status code, or None when nothing answers."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return None

    def wait(self, timeout: float, healthy: bool = True) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._thread.is_alive():
                raise RuntimeError(f"the API server on port {self.port} stopped while starting")
            code = self.health()
            if code == 200 or (code is not None and not healthy):
                return
            time.sleep(0.3)
        raise TimeoutError(f"GET {self.url}/health did not answer 200 within {timeout:.0f} s (last: {self.health()})")

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():  # streams still open after the graceful period: drop them
            self._server.force_exit = True
            self._thread.join(timeout)
        self._thread = None

    def __enter__(self) -> "ApiServer":
        return self.start() if self._thread is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
