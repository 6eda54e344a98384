"""The cache of tiny default checkpoints: each is written once into its own folder under VOXBACKEND_CACHE and
reused afterwards. Several processes (the Triton stubs of one repository, tests) ask for the same one at the same
time: they take turns on a lock of the cache folder, so one builds and the others find its build (a plain
tritonserver on the committed repository had up to four stubs per model building the same checkpoint at once).
A build still goes to a temporary folder renamed into place atomically, so a crashed build leaves nothing
half-written where a complete one is expected."""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

COMPLETE = ".complete"


def cache_root(suffix: str = "") -> Path:
    """`<VOXBACKEND_CACHE><suffix>` (default ~/.cache/voxbackend/default<suffix>)."""
    base = Path(os.environ.get("VOXBACKEND_CACHE") or Path.home() / ".cache" / "voxbackend" / "default")
    return base.with_name(base.name + suffix) if suffix else base


def build_once(root: str | Path, write: Callable[[Path], object]) -> Path:
    """`root`, filled by `write(folder)` unless a complete build is there already."""
    root = Path(root)
    if (root / COMPLETE).exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with _locked(root.parent):
        if not (root / COMPLETE).exists():  # built by whoever held the lock before us
            _build(root, write)
    return root


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """An exclusive lock on the folder itself (no lock file is left behind), released on close or process exit."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _build(root: Path, write: Callable[[Path], object]) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
    try:
        write(tmp)
        (tmp / COMPLETE).write_text("ok\n")
        try:
            os.rename(tmp, root)  # atomic; fails when a process that took no lock (an older one) put one there
        except OSError:
            if not (root / COMPLETE).exists():
                raise RuntimeError(f"{root} exists but is not a complete checkpoint; delete it and retry")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
