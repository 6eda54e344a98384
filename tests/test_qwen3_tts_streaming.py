"""Qwen3-TTS in the engine: the dual text track, text streaming (Engine.append_text), request inputs refused by
field, and a preempted request that recomputes exactly the rows it was fed. Tiny checkpoint from
voxbackend.models.qwen3_tts.tiny; greedy throughout, so runs compare exactly."""
from __future__ import annotations

import json
import shutil
import threading
import time

import numpy as np
import pytest

from voxbackend import SamplingParams
from voxbackend.config import EngineConfig
from voxbackend.engine.engine import Engine
from voxbackend.errors import InvalidRequest
from voxbackend.events import EventKind
from voxbackend.models.base import QUEUED
from voxbackend.models.registry import detect_kind, load_frontend, load_model
from voxbackend.models.qwen3_tts.tiny import write_tiny_qwen3_tts

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest

GREEDY = dict(temperature=0, repetition_penalty=1.0)
TEXT = "The quick brown fox jumps over the lazy dog."  # greedy speaks past its text track (no early EOS)
PIECES = ["The quick", " brown fox", " jumps over", " the lazy", " dog."]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_qwen3_tts(tmp_path_factory.mktemp("qwen3_tts_cv"), seed=0)


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint, None, "cpu", __import__("torch").float32)


def _engine(model, **overrides) -> Engine:
    return Engine(model, EngineConfig(**{"kv_pages": 64, "page_size": 16, "first_chunk_s": 0.0, **overrides}))


def _run(engine: Engine, submit) -> dict:
    """Submit through `submit(on_event)`, drive the (unstarted) engine until the request ends."""
    out = {"audio": [], "final": None}

    def on_event(e):
        if e.kind is EventKind.AUDIO:
            out["audio"].append(e.audio)
        else:
            out["final"] = e

    rid = submit(on_event)
    while out["final"] is None:
        engine.step()
    out["id"] = rid
    return out


def test_registry_detects_and_prompt_follows_the_template(checkpoint, model):
    assert detect_kind(checkpoint).name == "qwen3_tts"
    fe = load_frontend(checkpoint)
    rows = fe.prepare(TEXT, "Ryan", language="English")
    assert rows == model.prepare(TEXT, "ryan", language="english")
    text = [r[-1] for r in rows]
    codec = [r[0] for r in rows]
    spoken = [fe.im_start, *fe.encode("assistant\n" + TEXT)]
    assert text[:3] == spoken[:3] and codec[:3] == [-1, -1, -1]  # the role rows
    c = fe.codec_ids
    assert codec[3:10] == [c["think"], c["think_bos"], fe.languages["english"], c["think_eos"], fe.speakers["ryan"],
                           c["pad"], c["bos"]]
    assert text[3:10] == [fe.tts_pad] * 5 + [fe.tts_bos, spoken[3]]
    assert codec[10:] == [QUEUED] * len(spoken[4:]) and text[10:] == spoken[4:]
    # auto language with a dialect speaker: the dialect's language id; plain auto: nothink
    eric = [r[0] for r in fe.prepare(TEXT, "ERIC")]
    assert eric[3:7] == [c["think"], c["think_bos"], fe.languages["sichuan_dialect"], c["think_eos"]]
    assert [r[0] for r in fe.prepare(TEXT, "ryan")][3:6] == [c["nothink"], c["think_bos"], c["think_eos"]]
    assert model.spec.window.first_frames == 1 and model.spec.max_tokens == 2048


def test_bad_inputs_are_refused_naming_the_field(checkpoint, tmp_path):
    fe = load_frontend(checkpoint)
    for kwargs, field in [
        (dict(text=TEXT, voice="nobody"), "voice"),
        (dict(text=TEXT, voice="ryan", language="klingon"), "language"),
        (dict(text=TEXT, voice="ryan", language="sichuan_dialect"), "language"),  # dialects come from the speaker
        (dict(text="   "), "text"),
        (dict(text="x" * 5000), "text"),
        (dict(text=TEXT, instruct=7), "instruct"),
    ]:
        with pytest.raises(InvalidRequest) as err:
            fe.prepare(**kwargs)
        assert err.value.field == field, kwargs
    small = tmp_path / "cv06"
    shutil.copytree(checkpoint, small)
    cfg = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**cfg, "tts_model_size": "0b6"}))
    with pytest.raises(InvalidRequest) as err:
        load_frontend(small).prepare(TEXT, instruct="Speak slowly.")
    assert err.value.field == "instruct"
    vd = write_tiny_qwen3_tts(tmp_path / "vd", variant="voice_design")
    with pytest.raises(InvalidRequest) as err:
        load_frontend(vd).prepare(TEXT, "ryan")
    assert err.value.field == "voice"
    assert len(load_frontend(vd).prepare(TEXT, instruct="A calm narrator.")) > len(load_frontend(vd).prepare(TEXT))
    (small / "config.json").write_text(json.dumps({**cfg, "tts_model_type": "base"}))
    with pytest.raises(InvalidRequest) as err:  # Base clones: it needs a reference clip (tests/test_qwen3_tts_base.py)
        load_frontend(small).prepare(TEXT)
    assert err.value.field == "reference_audio"


def test_text_sent_in_pieces_gives_the_same_codes_and_audio(model):
    alone = _engine(model)
    whole = _run(alone, lambda cb: alone.submit(model.prepare(TEXT, "vivian"), SamplingParams(**GREEDY, max_tokens=40),
                                                cb))
    assert whole["final"].finish_reason == "length"  # it speaks past the text: the track's end is exercised
    ids = [i for p in PIECES[1:] for i in model.text_piece_ids(p)]
    first = model.prepare(PIECES[0], "vivian", text_open=True)
    assert [r[-1] for r in first if r[0] == QUEUED] + ids == [r[-1] for r in model.prepare(TEXT, "vivian")
                                                               if r[0] == QUEUED]
    engine = _engine(model).start()
    done = threading.Event()
    pieces = {"audio": [], "final": None}

    def on_event(e):
        if e.kind is EventKind.AUDIO:
            pieces["audio"].append(e.audio)
        else:
            pieces["final"] = e
            done.set()

    try:
        rid = engine.submit(first, SamplingParams(**GREEDY, max_tokens=40), on_event, text_open=True)
        for k, piece in enumerate(PIECES[1:]):
            time.sleep(0.15)  # the track runs dry between pieces: the request waits, emitting no tts_eos
            engine.append_text(rid, model.text_piece_ids(piece), final=k == len(PIECES) - 2)
        assert done.wait(120)
        with pytest.raises(InvalidRequest) as err:
            engine.append_text(rid, model.text_piece_ids(" more"), final=True)  # after final
        assert err.value.field == "text"
    finally:
        engine.shutdown()
    assert pieces["final"].token_ids == whole["final"].token_ids
    np.testing.assert_array_equal(np.concatenate(pieces["audio"]), np.concatenate(whole["audio"]))


def test_waiting_open_request_holds_no_lm_slot_and_others_play(model):
    engine = _engine(model)
    events = {"open": [], "other": []}
    rid = engine.submit(model.prepare("The", "ryan", text_open=True), SamplingParams(**GREEDY, max_tokens=40),
                        events["open"].append, text_open=True)
    other = engine.submit(model.prepare(TEXT, "vivian"), SamplingParams(**GREEDY, max_tokens=40),
                          events["other"].append)
    for _ in range(4):
        engine.step()
    req = {r.id: r for r in engine.running}
    waiting, playing = req[rid], req[other]
    assert waiting.lm.awaiting_input and len(waiting.lm.output_ids) == 1  # the prompt's one text token was all it had
    pages, before = list(waiting.lm.pages), len(playing.lm.output_ids)
    for _ in range(6):
        assert all(r is not waiting for r, _ in engine.scheduler.schedule_lm(engine.running, engine.clock()))
        engine.step()
    assert len(waiting.lm.output_ids) == 1 and waiting.lm.pages == pages  # keeps its pages, takes no LM step
    assert len(playing.lm.output_ids) == before + 6
    assert any(e.kind is EventKind.AUDIO for e in events["other"])
    engine.append_text(rid, model.text_piece_ids(" end."), final=False)
    engine.step()
    assert len(waiting.lm.output_ids) == 2  # fed again as soon as text came
    with pytest.raises(InvalidRequest) as err:
        engine.append_text("no-such-request", [1], final=True)
    assert err.value.field == "text"
    with pytest.raises(InvalidRequest) as err:
        engine.append_text(rid, [10**6], final=True)  # not a text token
    assert err.value.field == "text"
    engine.cancel(rid)  # cancel while it waits: every page back
    engine.cancel(other)
    engine.step()
    assert engine.pool.used_pages == 0 and not engine.running
    assert events["open"][-1].finish_reason == "cancelled"
    with pytest.raises(InvalidRequest):
        engine.append_text(rid, [1], final=True)  # finished


def test_preempted_requests_recompute_the_rows_they_were_fed(model):
    """A pool too small for three streams: preemption and resume (recomputing prompt + fed rows, text ids
    included, one request preempted while it waits for text) give the same codes as each request alone."""
    prompts = [model.prepare(t, v) for t, v in [(TEXT, "vivian"), ("She said she would be here.", "ryan"),
                                               ("Good morning! How are you?", "eric")]]
    params = SamplingParams(**GREEDY, max_tokens=40)
    alone = [Engine(model, EngineConfig(kv_pages=64, page_size=16)).generate_ids([p], params)[0]
             for p in prompts]
    engine = Engine(model, EngineConfig(kv_pages=10, page_size=8, prefill_budget=64))
    assert engine.generate_ids(prompts, params) == alone
    assert engine.preemptions > 0
    # an open request preempted while it waits recomputes and then continues where it was
    engine = Engine(model, EngineConfig(kv_pages=64, page_size=8))
    first = model.prepare(PIECES[0], "vivian", text_open=True)
    out = []
    rid = engine.submit(first, params, out.append, text_open=True)
    for _ in range(3):
        engine.step()
    r = engine.running[0]
    assert r.lm.awaiting_input
    engine.admission.preempt(r)
    engine.step()  # re-admitted and recomputed; it samples nothing new while it waits
    assert not r.lm.preempted and r.lm.awaiting_input and r.uncached == 0
    engine.append_text(rid, [i for p in PIECES[1:] for i in model.text_piece_ids(p)], final=True)
    while not out or not out[-1].final:
        engine.step()
    assert out[-1].token_ids == alone[0]


def test_text_open_needs_a_streaming_model(tiny_csm):
    import torch

    csm = load_model(tiny_csm, None, "cpu", torch.float32)
    with pytest.raises(InvalidRequest) as err:
        Engine(csm, EngineConfig(kv_pages=16)).submit(csm.prepare("hi"), text_open=True)
    assert err.value.field == "text"


def test_release_layout_tokenizer_files_give_the_same_prompt(checkpoint, tmp_path):
    """The official release ships vocab.json + merges.txt (no tokenizer.json): the same ids either way."""
    bare = tmp_path / "bare"
    shutil.copytree(checkpoint, bare)
    (bare / "tokenizer.json").unlink()
    for text in (TEXT, "two\nlines 12 3.5", " spaced  out "):
        assert load_frontend(bare).prepare(text, "ryan", instruct="Speak slowly.") == load_frontend(
            checkpoint).prepare(text, "ryan", instruct="Speak slowly.")


def test_an_append_the_model_refuses_on_the_engine_thread_ends_that_request_only(model, monkeypatch):
    engine = _engine(model)
    events = {"a": [], "b": []}
    a = engine.submit(model.prepare("The", "ryan", text_open=True), SamplingParams(**GREEDY, max_tokens=10),
                      events["a"].append, text_open=True)
    engine.submit(model.prepare(TEXT, "vivian"), SamplingParams(**GREEDY, max_tokens=10), events["b"].append)
    engine.step()

    def refuse(track, ids, final):
        raise InvalidRequest("text refused by the model", field="text")

    monkeypatch.setattr(model, "extend_track", refuse)
    engine.append_text(a, [5], final=False)
    while not events["b"] or not events["b"][-1].final:
        engine.step()
    assert events["a"][-1].kind is EventKind.ERROR and "refused by the model" in events["a"][-1].error
    assert events["b"][-1].finish_reason == "length" and engine.pool.used_pages == 0


def test_codebook_0_candidates_and_the_first_frames_without_eos(model, monkeypatch):
    """Only the 2048 codes and EOS are candidates; EOS is masked in the first 2 frames (min_new_tokens 2): a talker
    that always wants EOS still speaks 2 frames, then stops."""
    import torch

    hidden = torch.randn(3, model.talker.cfg.hidden_size)
    logits, ids = model.candidate_logits(hidden, [0, 16, 32])
    assert ids.shape == (3, 2049) and ids[0, -1].item() == model.eos and torch.equal(ids[0, :2048], torch.arange(2048))
    assert torch.isinf(logits[:2, -1]).all() and torch.isfinite(logits[2]).all()
    full = model.logits

    def wants_eos(h):
        out = full(h).clone()
        out[:, model.eos] = 1e4
        out[:, 2151:] = 2e4  # a suppressed special above it must never be sampled
        return out

    monkeypatch.setattr(model, "logits", wants_eos)
    steps = _engine(model).generate_ids([model.prepare(TEXT, "ryan")], SamplingParams(**GREEDY, max_tokens=20))[0]
    assert [s[0] for s in steps][2] == model.eos and len(steps) == 3
    assert all(0 <= s[0] < 2048 for s in steps[:2])
