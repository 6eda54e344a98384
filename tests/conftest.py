"""Shared fixtures. Tests never touch the network: the checkpoints are built locally from a seed."""
import functools
import os
import re
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One intra-op thread in every process of the run: the xdist workers (they inherit the controller's environment)
# and every tritonserver stub, launcher and bench they start. Two workers plus a server's stubs share two cores;
# with torch's default of one thread per core each, CPU tests ran up to 3x slower (test_mimi_parity: 22 s beside
# a busy two-thread process, 8 s with one thread). Set it to run the suite with more.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

# One tiny-checkpoint cache for the whole run: the xdist workers inherit the controller's environment (it imports
# this file before starting them) and so does every tritonserver a test starts; each default checkpoint is built
# once (atomically, voxbackend.models.checkpoint_cache) and removed with the folder at the end of the run.
_OWNS_CACHE = "VOXBACKEND_TEST_CACHE" not in os.environ
if _OWNS_CACHE:
    os.environ["VOXBACKEND_TEST_CACHE"] = tempfile.mkdtemp(prefix="voxbackend-test-cache-")
os.environ["VOXBACKEND_CACHE"] = str(Path(os.environ["VOXBACKEND_TEST_CACHE"]) / "default")

from tests.triton_util import COMMITTED  # noqa: E402  (after the cache is set: voxbackend may read it on import)


def pytest_unconfigure(config):
    if _OWNS_CACHE and not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ["VOXBACKEND_TEST_CACHE"], ignore_errors=True)


def _torch_threads(n: int):
    """For `yield from` in a fixture: torch's intra-op threads set to n, restored afterwards."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def default_threads():
    """For modules whose checks are bit for bit against a reference that was shown equal at torch's default
    intra-op threads (one per core), not at the run's one thread. Restored after the module."""
    yield from _torch_threads(os.cpu_count() or 1)


@pytest.fixture(scope="module")
def one_thread():
    """For modules of tiny tensors (`pytestmark = pytest.mark.usefixtures("one_thread")`): with intra-op threads
    every small op pays a fan-out, and on a shared 2-core machine a stalled thread (measured: 1-frame Qwen3-TTS
    codec windows 20x slower with 2 threads than with 1). Restored after the module."""
    yield from _torch_threads(1)


@pytest.fixture(scope="session")
def tiny_orpheus():
    """(model_dir, codec_dir): tiny random Orpheus LM + SNAC 24 kHz (decoder_dim 64), seed 0: the run's cached
    default, the one the Triton models build when no checkpoint is configured."""
    from voxbackend.models.orpheus.tiny import ensure_default_checkpoint

    return ensure_default_checkpoint()


@pytest.fixture(scope="session")
def tiny_csm():
    """A tiny random CSM-1B-architecture checkpoint (HF layout, Mimi inside), seed 0: the run's cached default."""
    from voxbackend.models.csm.tiny import ensure_default_csm

    return ensure_default_csm()[0]


# Three tiers, by module: `triton` starts a tritonserver (directly, through the launcher, or through a perf script);
# `parity` compares with a reference package (transformers, snac, moshi, qwen_tts, the CosyVoice oracles...);
# `unit` is the rest. `scripts/test.sh --quick` runs unit + parity, `--unit` only unit.
_STARTS_TRITON = re.compile(r"TritonServer|start_serve|start_server|triton_util|\"serve\",|\"demo\"|"
                            r"run_cpu_suite|reliability|serving_ab|run_block\(|gpu/run\.sh")
_USES_REFERENCE = re.compile(r"^\s*(import|from) (transformers|snac|moshi|qwen_tts|cosyvoice|flashcosyvoice|"
                             r"s3tokenizer|kaldi_native_fbank|diffusers|tests\.\w*oracle)\b|oracle", re.M)


@functools.cache
def _tier(path: Path) -> str:
    source = path.read_text(encoding="utf-8")
    return "triton" if _STARTS_TRITON.search(source) else "parity" if _USES_REFERENCE.search(source) else "unit"


# One tritonserver for the committed model_repository (what users copy, no checkpoint configured: the engine models
# build the run's cached tiny defaults), shared by the modules that only need it running: they are marked
# xdist_group(COMMITTED), and one xdist worker runs them all, in order, with the test that stops the server with
# SIGTERM (marked stops_committed_server) last. Every other file stays whole on one worker.


@pytest.fixture(scope="session")
def committed_server(tmp_path_factory):
    from tests.triton_util import serve
    from voxbackend.deploy import configs

    yield from serve(configs.DEFAULT_REPOSITORY, tmp_path_factory.mktemp("committed_server"), stop_within_s=30)


_IN_COMMITTED_GROUP = re.compile(r"^pytestmark = .*xdist_group\(COMMITTED\)", re.M)


@functools.cache
def _work_unit(path: str) -> str:
    """A test file's unit of xdist work: the file, or COMMITTED for the files on the shared server."""
    source = (Path(__file__).resolve().parents[1] / path).read_text(encoding="utf-8")
    return COMMITTED if _IN_COMMITTED_GROUP.search(source) else path


def pytest_xdist_make_scheduler(config, log):
    """Whole files per worker, except the committed group, which is one unit of work. (xdist's own loadgroup marks
    a test's group in its node id, which pytest 9 no longer lets a plugin change.)"""
    from xdist.scheduler import LoadScopeScheduling

    class FilesAndCommittedGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid.split("::", 1)[0])

    return FilesAndCommittedGroup(config, log)


def _run_order(item) -> tuple[int, int]:
    """The committed group first, then the other server modules, parity, unit (xdist hands out its largest units
    first anyway; this is the order of a run without workers), and the test that stops the shared server last."""
    shared = any(m.args == (COMMITTED,) for m in item.iter_markers("xdist_group"))
    tier = {"triton": 1, "parity": 2, "unit": 3}[_tier(item.path)]
    return 0 if shared else tier, int(item.get_closest_marker("stops_committed_server") is not None)


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(getattr(pytest.mark, _tier(item.path)))
    items.sort(key=_run_order)  # stable: each module stays whole and in its order
