"""A tritonserver for one test module: started on loopback ports, stopped and checked at the end."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

from voxbackend.triton.server import TritonServer


def serve(repo: Path, log_dir: Path, env: dict[str, str] | None = None, stop_within_s: float = 20.0,
          clean_exit: bool = True) -> Iterator[TritonServer]:
    """For `yield from` in a fixture: the running server, then a stop that must be quick (and clean)."""
    srv = TritonServer(repo, env=env or {}, log_file=log_dir / "tritonserver.log")
    srv.start(timeout=300)
    yield srv
    t0 = time.monotonic()
    code = srv.stop()
    if clean_exit:
        assert code == 0, f"tritonserver exited with {code}:\n{srv.log_tail()}"
    assert time.monotonic() - t0 < stop_within_s, "tritonserver took too long to stop (a stream left open?)"
