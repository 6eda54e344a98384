"""The cache of tiny default checkpoints: each is written once into its own folder under VOXBACKEND_CACHE and
reused afterwards. Several processes (Triton stubs, tests) may build the same one at the same time, so a build
goes to a temporary folder that is renamed into place atomically; the loser of the race uses the winner's."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

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
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
    try:
        write(tmp)
        (tmp / COMPLETE).write_text("ok\n")
        try:
            os.rename(tmp, root)  # atomic; fails when another process already put a complete one there
        except OSError:
            if not (root / COMPLETE).exists():
                raise RuntimeError(f"{root} exists but is not a complete checkpoint; delete it and retry")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root
