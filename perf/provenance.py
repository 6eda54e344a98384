"""Provenance of a benchmark result: what code, on what machine, with what software, when.

docs/metrics.md asks every result to record the git commit and the machine; the benchmark adds model, weights,
dataset, arrival process and seed itself. Nothing here fails: a missing git or /proc/cpuinfo gives "unknown".

    from perf.provenance import collect, markdown_lines, machine_slug
    info = collect()                      # dict of plain strings
    print("\n".join(markdown_lines(info)))
"""
from __future__ import annotations

import datetime as _dt
import os
import platform
import re
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
UNKNOWN = "unknown"


def _git(*args: str, repo: Path = REPO_ROOT) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.rstrip() if out.returncode == 0 else None  # keep leading blanks: porcelain columns


def git_commit(repo: Path = REPO_ROOT, short: bool = False) -> str:
    return _git("rev-parse", "--short=8" if short else "--verify", "HEAD", repo=repo) or UNKNOWN


def git_modified(repo: Path = REPO_ROOT) -> list[str]:
    """Tracked files that differ from HEAD (staged or not). Untracked files are not counted: they are not
    imported by the package unless something tracked imports them, and other people's scratch files would
    otherwise mark every run dirty."""
    out = _git("status", "--porcelain", "--untracked-files=no", repo=repo)
    if out is None:
        return []
    return [line[3:].strip() for line in out.splitlines() if line.strip()]


def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine() or UNKNOWN
    m = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return m.group(1).strip() if m else (platform.machine() or UNKNOWN)


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return UNKNOWN


def torch_info() -> tuple[str, int | None]:
    try:
        import torch
    except ImportError:
        return UNKNOWN, None
    return torch.__version__, torch.get_num_threads()


def gpu_name() -> str | None:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - provenance must never fail a run
        pass
    return None


def machine_slug() -> str:
    """Short filename-safe machine name: the accelerator if there is one, else CPU model + core count."""
    gpu = gpu_name()
    base = gpu if gpu else f"{cpu_model()}-{cpu_count()}c"
    slug = re.sub(r"[^a-z0-9]+", "-", base.lower()).strip("-")
    return slug[:48] or "machine"


def collect(repo: Path = REPO_ROOT) -> dict[str, str]:
    modified = git_modified(repo)
    torch_version, threads = torch_info()
    now = _dt.datetime.now(_dt.timezone.utc)
    info = {
        "date": now.strftime("%Y-%m-%d %H:%M:%S UTC"),
        "date_slug": now.strftime("%Y-%m-%d"),
        "commit": git_commit(repo),
        "commit_short": git_commit(repo, short=True),
        "dirty": ("yes: " + ", ".join(modified[:10]) + (" ..." if len(modified) > 10 else "")) if modified else "no",
        "cpu": f"{cpu_model()} ({cpu_count()} cores available to this process)",
        "gpu": gpu_name() or "none",
        "load_average_at_start": load_average(),
        "python": platform.python_version(),
        "torch": torch_version + (f" ({threads} intra-op threads)" if threads else ""),
        "host_os": f"{platform.system()} {platform.release()}",
    }
    return info


def markdown_lines(info: dict[str, str], keys: list[str] | None = None) -> list[str]:
    keys = keys or [k for k in info if not k.endswith("_slug") and k != "commit_short"]
    return [f"- {k.replace('_', ' ')}: {info[k]}" for k in keys if k in info]


def result_filename(tool: str, info: dict[str, str] | None = None) -> str:
    """<date>-<commit>-<machine>-<tool>.md (commit gets a -dirty suffix when tracked files were modified)."""
    info = info or collect()
    commit = info["commit_short"] + ("-dirty" if info["dirty"] != "no" else "")
    return f"{info['date_slug']}-{commit}-{machine_slug()}-{tool}.md"


if __name__ == "__main__":
    print("\n".join(markdown_lines(collect())))
    print(result_filename("example"))
