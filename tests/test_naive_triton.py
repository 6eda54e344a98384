"""orpheus_naive (perf/naive_triton.py) served by a real tritonserver: one stream comes back as PCM16 audio."""
from __future__ import annotations

import queue
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "perf"))

import naive_triton  # noqa: E402


def test_committed_config_is_rendered_from_the_schema():
    committed = (naive_triton.REPOSITORY / naive_triton.MODEL_NAME / "config.pbtxt").read_text()
    assert committed == naive_triton.render_config(), "run: python perf/naive_triton.py --write-config"


def _stream(url: str, fields: dict[str, object]) -> list:
    import tritonclient.grpc as grpcclient

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    meta = {i.name: i for i in client.get_model_metadata(naive_triton.MODEL_NAME).inputs}
    inputs = []
    for name, value in fields.items():
        dtype = meta[name].datatype
        arr = (np.array([value.encode()], dtype=np.object_) if dtype == "BYTES"
               else np.array([value], dtype={"INT32": np.int32, "INT64": np.int64, "FP32": np.float32}[dtype]))
        inp = grpcclient.InferInput(name, [1], dtype)
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer(naive_triton.MODEL_NAME, inputs, enable_empty_final_response=True)
        got = []
        while True:
            result, error = results.get(timeout=60)
            got.append((result, error))
            if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
                return got
    finally:
        client.stop_stream()
        client.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from voxbackend.models.orpheus.tiny import ensure_default_checkpoint
    model_dir, codec_dir = ensure_default_checkpoint()
    srv = naive_triton.start_server(str(model_dir), str(codec_dir), work_dir=tmp_path_factory.mktemp("naive"))
    yield srv
    srv.stop()


def test_one_stream_returns_pcm16_audio_then_final(server):
    got = _stream(server.grpc_url, {"TEXT": "Hello there.", "VOICE": "leo", "MAX_TOKENS": 42, "SEED": 3})
    assert all(error is None for _, error in got), [str(e) for _, e in got if e is not None]
    final = got[-1][0]
    assert bool(final.as_numpy("FINAL")[0])
    assert final.as_numpy("FINISH_REASON")[0].decode() in ("stop", "length")
    chunks = [r for r, _ in got[:-1]]
    assert chunks, "no audio chunk came back"
    for i, r in enumerate(chunks):
        assert int(r.as_numpy("SAMPLE_RATE")[0]) == 24000 and int(r.as_numpy("CHUNK_INDEX")[0]) == i
        pcm = np.frombuffer(r.as_numpy("AUDIO")[0], dtype="<i2")
        assert pcm.size == 2048  # one 85 ms window, as the official decoder keeps
    assert int(final.as_numpy("CHUNK_INDEX")[0]) == len(chunks)


def test_invalid_request_gets_an_error_not_a_hang(server):
    got = _stream(server.grpc_url, {"TEXT": "Hello.", "VOICE": "nobody"})
    assert got[-1][1] is not None and "unknown voice" in str(got[-1][1])
