"""The codec as its own Triton model: two `orpheus` engine instances sharing one `orpheus_codec` instance, through a
real tritonserver with the tiny default checkpoint. Streams match the colocated engine in this process, windows of
both engines share codec batches, a client calling the codec model gets an error naming why, and SIGTERM drains:
the streams that were playing finish with their whole audio (the codec stage stays until its engines leave)."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tritonclient.grpc as tritonclient  # noqa: E402

from tests.triton_util import assert_matches, metric, run_concurrently, sigterm_while_streaming  # noqa: E402
from voxbackend.deploy import configs  # noqa: E402
from voxbackend.deploy.server import TritonServer  # noqa: E402
from voxbackend.stream_client import make_inputs, stream_request  # noqa: E402

SETTINGS = {"instances": "2", "codec_instances": "1"}
MAX_TOKENS = 63
TOP_K = 8  # as test_triton_e2e: real sampling without near-ties on the tiny model's flat distribution
TEXTS = ["Hello there, how are you doing today?", "The quick brown fox jumps over the lazy dog.",
         "A streaming server sends the first audio chunk as soon as it is ready.", "Good morning! Good evening!",
         "Please read this sentence slowly and clearly.", "See you tomorrow, my friend."]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Only the front model and its codec stage: the engine and preprocess folders are left out to load faster."""
    repo = configs.write_repository(tmp_path_factory.mktemp("repo") / "model_repository", SETTINGS,
                                    models=["orpheus"])
    for folder in ("orpheus_engine", "orpheus_preprocess"):
        for path in sorted((repo / folder).rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        (repo / folder).rmdir()
    work = tmp_path_factory.mktemp("triton")
    srv = TritonServer(repo, log_file=work / "tritonserver.log", work_dir=work).start(300)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def reference():
    import voxbackend
    from voxbackend.models.orpheus.tiny import ensure_default_checkpoint

    engine = voxbackend.load(*ensure_default_checkpoint()).start()

    def synthesize(text: str, seed: int, max_tokens: int = MAX_TOKENS) -> np.ndarray:
        sampling = dataclasses.replace(engine.model.default_sampling(), max_tokens=max_tokens, seed=seed, top_k=TOP_K)
        return engine.synthesize(text, None, sampling)[0]

    yield synthesize
    engine.shutdown()


def test_the_repository_places_the_codec_stage_and_points_every_engine_at_it(server):
    text = (server.model_repository / "orpheus_codec" / "config.pbtxt").read_text()
    assert "instance_group [ { count: 1 kind: KIND_CPU } ]" in text and "input [" not in text
    front = (server.model_repository / "orpheus" / "config.pbtxt").read_text()
    assert 'key: "codec_model" value: { string_value: "orpheus_codec" }' in front
    assert "count: 2" in front


def test_streams_on_two_engines_match_the_colocated_engine_and_share_codec_batches(server, reference):
    batches = metric(server, "voxbackend_codec_batches_total", model="orpheus_codec")
    jobs = [lambda i=i: stream_request(server.grpc_url, "orpheus", make_inputs(
        TEXTS[i], None, "fp32", MAX_TOKENS=MAX_TOKENS, SEED=200 + i, TOP_K=TOP_K), "fp32", timeout=240)
        for i in range(len(TEXTS))]
    outs = run_concurrently(jobs)
    for i, out in enumerate(outs):
        assert_matches(out, reference(TEXTS[i], 200 + i), "fp32", f"stream {i}")
    windows = sum(len(o.audio) for o in outs) // 2048  # Orpheus: 2048 samples per window
    assert metric(server, "voxbackend_codec_windows_total", model="orpheus_codec") >= windows
    assert metric(server, "voxbackend_codec_batches_total", model="orpheus_codec") > batches
    # both engines got streams, and at least one codec batch held windows of both
    assert all(metric(server, "voxbackend_ttfa_seconds_count", model="orpheus", instance=f"orpheus_0_{k}") > 0
               for k in range(2))
    assert metric(server, "voxbackend_codec_mixed_batches_total", model="orpheus_codec") > 0


def test_a_client_calling_the_codec_stage_gets_an_error_naming_it(server):
    client = tritonclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(tritonclient.InferenceServerException, match="takes its windows from the engines"):
        client.infer("orpheus_codec", [])


def test_sigterm_drains_streams_whose_windows_go_through_the_codec_stage(server, reference):
    """Last: it stops the module's server. SIGTERM once every stream has its first audio."""
    texts = TEXTS[:3]
    jobs = [lambda i=i: stream_request(server.grpc_url, "orpheus", make_inputs(
        texts[i], None, "fp32", MAX_TOKENS=140, MIN_TOKENS=140, SEED=300 + i, TOP_K=TOP_K), "fp32", timeout=120)
        for i in range(len(texts))]
    code, signalled, outs = sigterm_while_streaming(server, jobs)
    assert code == 0, server.log_tail()
    for i, out in enumerate(outs):
        assert_matches(out, reference(texts[i], 300 + i, 140), "fp32", f"drained stream {i}")
    assert all(out.end_time > signalled for out in outs)  # they were still playing: a drain, not an end
