"""Last on the run's shared committed-repository server (tests/conftest.py): docker stop / Kubernetes while every
family streams. SIGTERM once each open stream has had its first audio; the streams through each family's front
model and engine model (CosyVoice2's and Chatterbox's with a cloned voice) finish with the whole audio they would
have had, and tritonserver exits 0 within the drain grace period."""
from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest

from tests import test_triton_chatterbox as chatterbox
from tests import test_triton_cosyvoice2 as cosyvoice2
from tests import test_triton_csm as csm
from tests import test_triton_e2e as e2e
from tests import test_triton_qwen3_tts as qwen3_tts
from tests.triton_util import COMMITTED, assert_matches, drain_streams
from voxbackend.stream_client import make_inputs

pytestmark = [pytest.mark.xdist_group(COMMITTED), pytest.mark.stops_committed_server]

# (family module, the first three cases at these lengths, their models); shorter than each family's own tests
# would need: twelve streams of four engines share the 2 cores and the 15 s grace period (drain_grace_s)
DRAINED = [
    (csm, 40, ["csm", "csm", "csm_engine"]),
    (qwen3_tts, 75, ["qwen3_tts", "qwen3_tts", "qwen3_tts_engine"]),
    (cosyvoice2, 90, ["cosyvoice2", "cosyvoice2_engine", "cosyvoice2"]),
    (chatterbox, 60, ["chatterbox", "chatterbox_engine", "chatterbox"]),
]


# Orpheus: (model, text, voice, format, seed); MIN_TOKENS keeps the tiny random model from stopping early
ORPHEUS = [("orpheus", "Hello there, a drained stream.", "tara", "pcm16", 7),
           ("orpheus", "The quick brown fox jumps over the lazy dog.", None, "fp32", 8),
           ("orpheus_engine", "See you tomorrow, my friend.", "leo", "fp32", 9)]
ORPHEUS_TOKENS = 140  # 20 frames, 1.7 s


def orpheus_sampling(seed: int) -> dict:
    return {"MAX_TOKENS": ORPHEUS_TOKENS, "MIN_TOKENS": ORPHEUS_TOKENS, "SEED": seed, "TOP_K": e2e.TOP_K}


def orpheus_references() -> list[np.ndarray]:
    """Engine.synthesize on the checkpoint the server built (the run's cache), one request at a time."""
    import voxbackend
    from voxbackend.models.orpheus.tiny import ensure_default_checkpoint

    engine = voxbackend.load(*ensure_default_checkpoint())
    engine.start()
    try:
        base = engine.model.default_sampling()
        return [engine.synthesize(text, voice, dataclasses.replace(
            base, max_tokens=ORPHEUS_TOKENS, min_tokens=ORPHEUS_TOKENS, seed=seed, top_k=e2e.TOP_K))[0]
            for _, text, voice, _, seed in ORPHEUS]
    finally:
        engine.shutdown()


def test_sigterm_lets_every_familys_open_streams_finish_with_their_whole_audio_and_exit_0(committed_server):
    streams = [(family, dataclasses.replace(case, max_tokens=length), model)
               for family, length, models in DRAINED for case, model in zip(family.CASES[:3], models)]
    orpheus = [(model, make_inputs(text, voice, fmt, **orpheus_sampling(seed)), fmt)
               for model, text, voice, fmt, seed in ORPHEUS]
    outs = drain_streams(committed_server, orpheus + [(model, case.inputs(), case.fmt) for _, case, model in streams])
    for (model, _, fmt), out, expected in zip(orpheus, outs, orpheus_references()):
        assert_matches(out, expected, fmt, f"drained stream ({model})")
    outs = outs[len(orpheus):]
    with contextlib.ExitStack() as engines:
        references = {family: engines.enter_context(family.reference_engine()) for family, _, _ in DRAINED}
        for i, ((family, case, model), out) in enumerate(zip(streams, outs)):
            expected = references[family](case)
            what = f"drained stream {i} ({model})"
            if family in (cosyvoice2, chatterbox):
                family.assert_nonempty_match(out, expected, case.fmt, what)
            else:
                assert_matches(out, expected, case.fmt, what, family.RATE)
