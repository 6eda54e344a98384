"""Orpheus on a tiny random checkpoint: official prompt format, streaming equal to the official window decode."""
import numpy as np
import pytest
import torch

import voxbackend
from voxbackend import EventKind, InvalidRequest, SamplingParams
from voxbackend.engine.detokenize import window_seed

import snac  # noqa: E402


@pytest.fixture(scope="module")
def engine(tiny_orpheus):
    return voxbackend.load(*tiny_orpheus, max_batch=8, page_size=16, kv_pages=256)


def _run(engine, texts_and_params):
    """Submit all, drive the loop on this thread, return (token_ids, audio) per request."""
    events = {}
    ids = [engine.submit(engine.model.prepare(t, v), sp, lambda e: events.setdefault(e.request_id, []).append(e))
           for t, v, sp in texts_and_params]
    while any(not events.get(i) or not events[i][-1].final for i in ids):
        engine.step()
    out = []
    for i in ids:
        assert events[i][-1].kind is EventKind.FINISHED
        chunks = [e.audio for e in events[i] if e.kind is EventKind.AUDIO]
        out.append((events[i][-1].token_ids, np.concatenate(chunks) if chunks else np.zeros(0, np.float32)))
    return out


def test_prompt_format_is_official(engine, tiny_orpheus):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_orpheus[0]))
    ids = engine.model.prepare("Hello world.", "leo")
    assert ids == [128259] + tok("leo: Hello world.").input_ids + [128009, 128260, 128261, 128257]
    assert ids[1] == 128000
    assert engine.model.prepare("Hi") == engine.model.prepare("Hi", "tara")
    assert engine.model.default_sampling() == SamplingParams(
        temperature=0.6, top_p=0.8, repetition_penalty=1.3, max_tokens=1200
    )


@pytest.mark.parametrize(
    "text, voice, match",
    [("", None, "empty"), ("   ", None, "empty"), ("hi", "darth", "unknown voice"), ("x" * 5000, None, "limit"),
     (b"bytes", None, "string")],
)
def test_bad_input(engine, text, voice, match):
    with pytest.raises(InvalidRequest, match=match):
        engine.model.prepare(text, voice)


def _official_decode(ref, tokens: list[int], seed: int) -> np.ndarray:
    """The official Orpheus decoder loop (tokens_decoder + convert_to_audio) with snac's own model."""
    codes, out, windows = [], [], 0
    for t in tokens:
        code = t - 128266 - 4096 * (len(codes) % 7)
        if not 0 <= code < 4096:
            continue
        codes.append(code)
        if len(codes) % 7 == 0 and len(codes) > 27:
            f = torch.tensor(codes[-28:]).view(4, 7)
            layers = [f[:, 0][None], f[:, [1, 4]].reshape(1, -1), f[:, [2, 3, 5, 6]].reshape(1, -1)]
            torch.manual_seed(window_seed(seed, windows))  # our per-window noise seed
            with torch.inference_mode():
                out.append(ref.decode(layers)[0, 0, 2048:4096].numpy())
            windows += 1
    return np.concatenate(out)


def test_stream_equals_official_window_by_window_decode(engine, tiny_orpheus):
    ref = snac.SNAC.from_pretrained(str(tiny_orpheus[1])).eval()
    sp = SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3, max_tokens=70, seed=21)
    [(tokens, audio)] = _run(engine, [("Streaming is fun.", "tara", sp)])
    assert len(tokens) == 70 and all(128266 <= t < 128266 + 7 * 4096 for t in tokens)
    want = _official_decode(ref, tokens, 21)
    assert len(want) == (70 // 7 - 3) * 2048
    assert audio.shape == want.shape and np.abs(audio - want).max() <= 1e-4


def test_batched_requests_equal_each_alone(engine, tiny_orpheus):
    reqs = [
        ("First sentence.", "tara",
         SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3, max_tokens=50, seed=1)),
        ("A second, longer sentence to synthesize.", "zac",
         SamplingParams(temperature=1.0, top_k=50, max_tokens=64, seed=2)),
        ("Third.", "mia", SamplingParams(temperature=0.0, max_tokens=40, seed=4)),  # seed: codec noise
        ("Fourth one here.", "leah",
         SamplingParams(temperature=0.9, min_p=0.05, repetition_penalty=1.1, max_tokens=57, seed=3)),
    ]
    together = _run(engine, reqs)
    alone = voxbackend.load(*tiny_orpheus, max_batch=1, kv_pages=64)
    for req, (tokens, audio) in zip(reqs, together):
        [(tokens1, audio1)] = _run(alone, [req])
        assert tokens == tokens1
        assert audio.shape == audio1.shape and np.abs(audio - audio1).max() <= 1e-4
    assert engine.pool.used_pages == 0


def test_stream_and_synthesize_on_a_started_engine(tiny_orpheus):
    eng = voxbackend.load(*tiny_orpheus, kv_pages=64).start()
    try:
        sp = SamplingParams(temperature=0.6, top_p=0.8, max_tokens=42, seed=9)
        chunks = list(eng.stream("Hello.", "dan", sp))
        audio, rate = eng.synthesize("Hello.", "dan", sp)
        assert rate == 24000 and len(chunks) >= 1 and np.array_equal(np.concatenate(chunks), audio)
        assert audio.dtype == np.float32 and len(audio) == (42 // 7 - 3) * 2048
    finally:
        eng.shutdown()


def test_frontend_needs_no_weights(engine, tiny_orpheus, tmp_path):
    import shutil

    from voxbackend.models.registry import load_frontend

    model_dir = tmp_path / "orpheus"
    shutil.copytree(tiny_orpheus[0], model_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    front = load_frontend(model_dir, tiny_orpheus[1])
    assert type(front).__name__ == "OrpheusFrontend" and not hasattr(front, "backbone")
    assert front.prepare("Hi there.", "zoe") == engine.model.prepare("Hi there.", "zoe")
    assert front.spec == engine.model.spec and front.voices == engine.model.voices
