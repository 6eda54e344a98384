"""The chatterbox_turbo deployment end to end, on the run's shared committed-repository server: concurrent streams
(the built-in voice and a cloned clip) equal Engine.synthesize on the tiny Turbo checkpoint the server built; a
non-zero CFG_WEIGHT (Turbo has no guidance) and a clip under Turbo's 5 s are refused naming the tensor."""
from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest

from tests.test_triton_chatterbox import Case, assert_nonempty_match, wav
from tests.triton_util import COMMITTED, run_concurrently
from voxbackend.stream_client import stream_request

pytestmark = pytest.mark.xdist_group(COMMITTED)

CASES = [
    Case("Hello there, how are you doing today?", seed=500, fmt="pcm16"),
    Case("Good morning! Good evening!", audio=wav(6.0, 24000, 11), seed=501),
    Case("It is important to test every part of a system.", seed=502),
]


@contextlib.contextmanager
def reference_engine():
    import voxbackend
    from voxbackend.models.chatterbox.tiny_turbo import ensure_default_chatterbox_turbo

    model_dir, _ = ensure_default_chatterbox_turbo()  # the server's build (the run's cache)
    engine = voxbackend.load(model_dir)
    engine.start()

    def synthesize(case: Case) -> np.ndarray:
        sampling = dataclasses.replace(engine.model.default_sampling(), max_tokens=case.max_tokens, seed=case.seed)
        return engine.synthesize(case.text, case.voice, sampling, reference_audio=case.audio)[0]

    try:
        yield synthesize
    finally:
        engine.shutdown()


def test_concurrent_turbo_streams_match_engine_synthesize(committed_server):
    jobs = [lambda c=c, i=i: stream_request(committed_server.grpc_url, "chatterbox_turbo", c.inputs(), c.fmt,
                                            timeout=240, request_id=f"cbt{i}") for i, c in enumerate(CASES)]
    outs = run_concurrently(jobs)
    with reference_engine() as synthesize:
        for i, (case, out) in enumerate(zip(CASES, outs)):
            assert_nonempty_match(out, synthesize(case), case.fmt, f"chatterbox_turbo stream {i}")


@pytest.mark.parametrize("case, message", [
    (Case("Hello there.", cfg_weight=0.5), "CFG_WEIGHT: chatterbox_turbo has no classifier-free guidance"),
    (Case("Hello there.", audio=wav(3.0, 16000, 12)), "REFERENCE_AUDIO is 3.00 s"),
])
def test_turbo_refuses_guidance_and_short_clips_naming_the_tensor(committed_server, case, message):
    out = stream_request(committed_server.grpc_url, "chatterbox_turbo", case.inputs(), timeout=60, linger_s=0.2)
    assert out.error and message in out.error and not out.chunks, out.error
