"""Chatterbox through the engine, on the tiny checkpoint of voxbackend.models.chatterbox.tiny: guided greedy tokens
equal upstream `T3.inference` (chatterbox-tts 0.1.7, multinomial made argmax) alone, continuously batched with
staggered arrivals and through preemptions; a guided request holds two rows of KV pages, cfg_weight 0 one;
bad inputs are refused naming the field; the audio does not depend on the batch.
"""
from __future__ import annotations

import dataclasses
import io
import math

import numpy as np
import pytest
import soundfile as sf
import torch
from safetensors.torch import load_file

from chatterbox_oracle import upstream_t3
from util_engine_drive import run_staggered, stream_audio
from voxbackend.errors import InvalidRequest
from voxbackend.models.chatterbox.model import SPEECH_BASE, ChatterboxFrontend
from voxbackend.models.chatterbox.t3_lm import WEIGHTS_FILE
from voxbackend.models.chatterbox.tiny import write_tiny_chatterbox
from voxbackend.models.chatterbox.voice import ChatterboxVoice
from voxbackend.models.cosyvoice2.tiny import voice_clip
from voxbackend.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = ["Hello there, how are you doing today?", "the quick brown fox...", "Good morning!",
         "It is important to test every part of a system; again and again."]
MAX_NEW = 40


def greedy(cfg_weight: float = 0.5, max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, repetition_penalty=1.2, cfg_weight=cfg_weight, max_tokens=max_tokens,
                          seed=1)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_chatterbox(tmp_path_factory.mktemp("tiny_chatterbox"), seed=0)


@pytest.fixture(scope="module")
def engine(ckpt):
    import voxbackend

    return voxbackend.load(ckpt)


@pytest.fixture(scope="module")
def cloned(ckpt) -> bytes:
    """A second voice: a WAV clip of another synthetic speaker."""
    buf = io.BytesIO()
    sf.write(buf, voice_clip(seconds=2.5, rate=22050, seed=7), 22050, format="WAV")
    return buf.getvalue()


@pytest.fixture(scope="module")
def reference(ckpt):
    import json

    return upstream_t3(json.loads((ckpt / "t3.json").read_text()), load_file(str(ckpt / WEIGHTS_FILE)))


def cases(engine, cloned):
    """(text, prepare options): the built-in voice and a cloned one, neutral and exaggerated."""
    return [(TEXTS[0], {}), (TEXTS[1], {"reference_audio": cloned}), (TEXTS[2], {"exaggeration": 0.9}),
            (TEXTS[3], {"reference_audio": cloned, "exaggeration": 0.3})]


def upstream_tokens(reference, model, text: str, conditioning: dict, cfg_weight: float, monkeypatch) -> list[int]:
    """Upstream T3.inference, greedy, on the same text ids and voice the prompt carries."""
    oracle, t3 = reference
    ids = torch.tensor([255, *model.tokenizer.encode(text), 0])
    cond = oracle.T3Cond(speaker_emb=torch.from_numpy(conditioning["speaker_emb"])[None],
                         cond_prompt_speech_tokens=torch.from_numpy(conditioning["cond_tokens"].astype(np.int64))[None],
                         emotion_adv=float(conditioning["emotion_adv"][0]) * torch.ones(1, 1, 1))
    with monkeypatch.context() as m:
        m.setattr(torch, "multinomial", lambda probs, num_samples=1: probs.argmax(-1, keepdim=True))
        out = t3.inference(t3_cond=cond, text_tokens=torch.stack([ids, ids]), max_new_tokens=MAX_NEW,
                           cfg_weight=cfg_weight, temperature=0.8, top_p=1.0, min_p=0.05, repetition_penalty=1.2)
    return out[0].tolist()


def speech(ids: list[int]) -> list[int]:
    return [i - SPEECH_BASE for i in ids]


def test_checkpoint_is_detected_and_frontend_prompts_the_reference_way(ckpt, engine):
    from voxbackend.models.registry import detect_kind, load_frontend

    assert detect_kind(ckpt).name == "chatterbox"
    front = load_frontend(ckpt)
    assert isinstance(front, ChatterboxFrontend) and front.spec.guidance
    prompt = front.prepare("hello world")
    assert prompt.ids[34] == 255 and prompt.ids[-3] == 0 and prompt.ids[-2:] == [SPEECH_BASE + 6561] * 2
    assert prompt.ids[35:-3] == front.tokenizer.encode("Hello world.")
    builtin = ChatterboxVoice.from_conds(ckpt / "conds.pt")
    assert np.array_equal(prompt.conditioning["cond_tokens"], builtin.cond_tokens.numpy())
    assert prompt.conditioning["emotion_adv"].tolist() == [0.5]
    assert engine.model.default_sampling().cfg_weight == 0.5


def test_greedy_guided_tokens_alone_equal_upstream(engine, cloned, reference, monkeypatch):
    m = engine.model
    for text, options in cases(engine, cloned)[:3]:
        prompt = m.prepare(text, **options)
        got = speech(engine.generate_ids([prompt], greedy())[0])
        want = upstream_tokens(reference, m, text, prompt.conditioning, 0.5, monkeypatch)
        assert got == want, text
        assert len(set(got)) > 5


def test_greedy_guided_tokens_batched_with_staggered_arrivals_equal_upstream(engine, cloned, reference, monkeypatch):
    m = engine.model
    todo = cases(engine, cloned) * 2
    prompts = [m.prepare(text, **options) for text, options in todo]
    got = run_staggered(engine, prompts, greedy())
    for (text, _), prompt, ids in zip(todo, prompts, got):
        assert speech(ids) == upstream_tokens(reference, m, text, prompt.conditioning, 0.5, monkeypatch)


def test_guided_requests_keep_their_tokens_through_preemption(ckpt, cloned, reference, monkeypatch):
    """A pool of 24 pages of 16 positions holds fewer guided requests (two rows each) than are running: the
    engine preempts and resumes them; the tokens stay upstream's."""
    import voxbackend

    small = voxbackend.load(ckpt, kv_pages=24, page_size=16)
    m = small.model
    todo = cases(small, cloned)
    prompts = [m.prepare(text, **options) for text, options in todo]
    got = run_staggered(small, prompts, greedy(), every=1)
    assert small.preemptions > 0
    for (text, _), prompt, ids in zip(todo, prompts, got):
        assert speech(ids) == upstream_tokens(reference, m, text, prompt.conditioning, 0.5, monkeypatch)
    assert small.stats().kv_pages_used == 0


def test_a_guided_request_holds_two_rows_of_pages_and_cfg_weight_zero_one(engine, reference, monkeypatch):
    m = engine.model
    prompt = m.prepare(TEXTS[0])
    pages = engine.pool.pages_for(len(prompt.ids))
    for cfg_weight, rows in ((0.5, 2), (0.0, 1)):
        rid = engine.submit(prompt, greedy(cfg_weight))
        engine.step()  # admitted and prefilled
        assert engine.stats().kv_pages_used == rows * pages
        engine.cancel(rid)
        engine.step()
        assert engine.stats().kv_pages_used == 0
    # w = 0 samples from the conditioned row alone: upstream with a weight too small to move any logit
    got = speech(engine.generate_ids([prompt], greedy(0.0))[0])
    assert got == upstream_tokens(reference, m, TEXTS[0], prompt.conditioning, 1e-30, monkeypatch)
    assert got != speech(engine.generate_ids([prompt], greedy(0.5))[0])


@pytest.mark.parametrize("options, sampling, field", [
    ({"exaggeration": 2.5}, {}, "exaggeration"),
    ({"exaggeration": math.nan}, {}, "exaggeration"),
    ({"voice": "nobody"}, {}, "voice"),
    ({}, {"cfg_weight": -0.1}, "cfg_weight"),
    ({}, {"cfg_weight": math.nan}, "cfg_weight"),
    ({}, {"cfg_weight": 11.0}, "cfg_weight"),
])
def test_bad_inputs_are_refused_naming_the_field(engine, options, sampling, field):
    with pytest.raises(InvalidRequest) as err:
        engine.submit(engine.model.prepare(TEXTS[0], **options), SamplingParams(**sampling))
    assert err.value.field == field


@pytest.mark.parametrize("seconds", [0.5, 31.0])
def test_reference_clips_outside_1_to_30_s_are_refused(engine, seconds):
    buf = io.BytesIO()
    sf.write(buf, voice_clip(seconds=seconds, rate=16000), 16000, format="WAV")
    with pytest.raises(InvalidRequest) as err:
        engine.model.prepare(TEXTS[0], reference_audio=buf.getvalue())
    assert err.value.field == "reference_audio" and "30 s" in str(err.value)


def test_a_model_without_guidance_refuses_cfg_weight(engine, monkeypatch):
    monkeypatch.setattr(engine.model, "spec", dataclasses.replace(engine.model.spec, guidance=False))
    with pytest.raises(InvalidRequest, match="no classifier-free guidance") as err:
        engine.submit(engine.model.prepare(TEXTS[0]), greedy(0.5))
    assert err.value.field == "cfg_weight"
    engine.submit(engine.model.prepare(TEXTS[0]), greedy(0.0), request_id="unguided")
    engine.cancel("unguided")
    engine.step()


def test_audio_does_not_depend_on_the_batch(engine):
    """Sampled (not greedy) requests with their seeds: one at a time, then three at once with staggered arrivals."""
    m = engine.model
    requests = [(m.prepare(TEXTS[i]), dataclasses.replace(m.default_sampling(), max_tokens=120, seed=10 + i))
                for i in range(3)]
    alone = [stream_audio(engine, [req], every=1)[0] for req in requests]
    batched = stream_audio(engine, requests, every=4)
    for a, b in zip(alone, batched):
        assert len(a) > 0 and a.shape == b.shape
        assert np.abs(a - b).max() < 1e-4
