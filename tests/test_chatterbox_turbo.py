"""Chatterbox-Turbo through the engine, on the tiny checkpoint of voxbackend.models.chatterbox.tiny_turbo: greedy
tokens with the repetition penalty equal upstream `T3.inference_turbo` (chatterbox-tts 0.1.7, multinomial made
argmax, top-k / top-p off: see voxbackend.models.chatterbox.turbo) for the built-in voice and cloned ones, alone and
continuously batched with staggered arrivals; the tokenizer is upstream's AutoTokenizer; cfg_weight is refused;
S3Gen gets the silence tail; the audio does not depend on the batch.
"""
from __future__ import annotations

import dataclasses
import io
import json

import numpy as np
import pytest
import soundfile as sf
import torch
from safetensors.torch import load_file

from chatterbox_oracle import load_t3
from util_engine_drive import run_staggered, stream_audio
from voxbackend.errors import InvalidRequest
from voxbackend.models.base import FEATURE, Prompt
from voxbackend.models.chatterbox.tiny_turbo import write_tiny_chatterbox_turbo
from voxbackend.models.chatterbox.turbo import (GPT2_CONFIG, MAX_SPEECH_TOKENS, SILENCE, ChatterboxTurboFrontend,
                                                TurboVoice)
from voxbackend.models.chatterbox.turbo_lm import COND_PROMPT_LEN, START_SPEECH, STOP_SPEECH, WEIGHTS_FILE
from voxbackend.models.chatterbox.turbo_text import normalize_turbo_text
from voxbackend.models.cosyvoice2.tiny import voice_clip
from voxbackend.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = ["Hello there, how are you doing today?", "the quick brown fox: it jumps [laugh] over", "Good morning… [sigh]"]
MAX_GEN_LEN = 60  # upstream's max_gen_len: it samples one token more (the cloned voice's stream stops before)


def greedy(penalty: float = 1.2) -> SamplingParams:
    return SamplingParams(temperature=0.0, repetition_penalty=penalty, max_tokens=MAX_GEN_LEN + 1, seed=1)


def wav(seconds: float, seed: int, rate: int = 22050) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, voice_clip(seconds=seconds, rate=rate, seed=seed), rate, format="WAV")
    return buf.getvalue()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_chatterbox_turbo(tmp_path_factory.mktemp("tiny_chatterbox_turbo"), seed=0)


@pytest.fixture(scope="module")
def engine(ckpt):
    import voxbackend

    return voxbackend.load(ckpt)


@pytest.fixture(scope="module")
def reference(ckpt):
    """Upstream T3 as tts_turbo.from_local configures it, over the tiny GPT-2 backbone, the checkpoint loaded
    strictly (names and shapes must be upstream's)."""
    oracle = load_t3()
    name = "GPT2_tiny_turbo_test"
    oracle.LLAMA_CONFIGS[name] = json.loads((ckpt / GPT2_CONFIG).read_text())
    weights = load_file(str(ckpt / WEIGHTS_FILE))
    try:
        hp = oracle.T3Config(text_tokens_dict_size=weights["text_emb.weight"].shape[0])
        hp.llama_config_name = name
        hp.speech_tokens_dict_size = 6563
        hp.input_pos_emb = None
        hp.speech_cond_prompt_len = COND_PROMPT_LEN
        hp.use_perceiver_resampler = False
        hp.emotion_adv = False
        t3 = oracle.T3(hp).eval()
    finally:
        del oracle.LLAMA_CONFIGS[name]
    t3.load_state_dict(weights)
    return oracle, t3


def cases():
    """(text, prepare options): the built-in voice and two cloned clips (a 6 s WAV at 22.05 kHz, a 16 s one whose
    T3 prompt tokens stop at 15 s)."""
    return [(TEXTS[0], {}), (TEXTS[1], {"reference_audio": wav(6.0, seed=7)}),
            (TEXTS[2], {"reference_audio": wav(16.0, seed=11, rate=16000)})]


def split(model, text: str, prompt) -> tuple[list[int], list[int]]:
    """The prompt's cond tokens (as S3 tokens) and text ids."""
    text_ids = model.tokenizer.encode(text)
    base = model.speech_base
    assert prompt.ids[0] == FEATURE and prompt.ids[-1] == base + START_SPEECH
    assert prompt.ids[-1 - len(text_ids):-1] == text_ids
    return [i - base for i in prompt.ids[1:-1 - len(text_ids)]], text_ids


def upstream_tokens(reference, model, text: str, prompt, monkeypatch, penalty: float = 1.2) -> list[int]:
    """Upstream inference_turbo, greedy, on the same voice and text ids as the prompt."""
    oracle, t3 = reference
    cond, text_ids = split(model, text, prompt)
    t3_cond = oracle.T3Cond(speaker_emb=torch.from_numpy(prompt.conditioning["speaker_emb"])[None],
                            cond_prompt_speech_tokens=torch.tensor(cond)[None])
    with monkeypatch.context() as m, torch.inference_mode():
        m.setattr(torch, "multinomial", lambda probs, num_samples=1: probs.argmax(-1, keepdim=True))
        out = t3.inference_turbo(t3_cond, torch.tensor(text_ids)[None], temperature=0.8, top_k=0, top_p=1.0,
                                 repetition_penalty=penalty, max_gen_len=MAX_GEN_LEN)
    return out[0].tolist()


def speech(model, ids: list[int]) -> list[int]:
    """Engine ids -> upstream's tokens: S3 ids, the stop dropped as upstream drops it."""
    tokens = [i - model.speech_base for i in ids]
    return tokens[:-1] if tokens and tokens[-1] == STOP_SPEECH else tokens


def test_checkpoint_is_detected_and_the_frontend_prompts_the_reference_way(ckpt, engine):
    from transformers import AutoTokenizer

    from voxbackend.models.registry import detect_kind, load_frontend

    assert detect_kind(ckpt).name == "chatterbox_turbo"
    front = load_frontend(ckpt)
    assert isinstance(front, ChatterboxTurboFrontend) and not front.spec.guidance
    assert front.spec.max_tokens == MAX_SPEECH_TOKENS and not front.spec.penalty_on_prompt
    assert engine.model.default_sampling() == SamplingParams(temperature=0.8, top_k=1000, top_p=0.95,
                                                             repetition_penalty=1.2, max_tokens=MAX_SPEECH_TOKENS)
    prompt = front.prepare(TEXTS[0])
    cond, _ = split(front, TEXTS[0], prompt)
    assert cond == TurboVoice.from_conds(ckpt / "conds.pt").cond_tokens.tolist() and len(cond) > 150
    # upstream: AutoTokenizer on the folder, pad = eos, over its punc_norm
    ref = AutoTokenizer.from_pretrained(str(ckpt))
    ref.pad_token = ref.eos_token
    for text in [*TEXTS, "x<|endoftext|>y [clear throat]  ok", "Wait—what? “Quoted”: ‘yes’ ,fine"]:
        want = ref(normalize_turbo_text(text), return_tensors="pt", padding=True, truncation=True).input_ids
        assert front.tokenizer.encode(text) == want[0].tolist(), text
    assert len(ref) == front.speech_base


@pytest.mark.parametrize("penalty", [1.2, 100.0])
def test_greedy_tokens_alone_equal_inference_turbo(engine, reference, monkeypatch, penalty):
    """Penalty 100 all but rules out every token in the history: any difference from upstream's history shows."""
    m = engine.model
    for text, options in cases():
        prompt = m.prepare(text, **options)
        got = speech(m, engine.generate_ids([prompt], greedy(penalty))[0])
        assert got == upstream_tokens(reference, m, text, prompt, monkeypatch, penalty), text
        assert len(set(got)) > 5  # the penalty at work on a model that does not just repeat one token


@pytest.mark.parametrize("penalty", [1.2, 100.0])
def test_the_voice_cond_tokens_are_not_in_the_penalty_history(engine, reference, monkeypatch, penalty):
    """A voice whose last cond tokens are the tokens the built-in voice's stream starts with: the stream from it
    starts with them too, so a history holding the prompt (upstream's has none of it) would turn them away."""
    m = engine.model
    prompt = m.prepare(TEXTS[0])
    cond, text_ids = split(m, TEXTS[0], prompt)
    first = speech(m, engine.generate_ids([prompt], greedy(penalty))[0])[:8]
    ids = list(prompt.ids)
    ids[1 + len(cond) - len(first):1 + len(cond)] = [m.speech_base + t for t in first]
    crafted = Prompt(ids, prompt.conditioning, max_tokens=prompt.max_tokens)
    got = speech(m, engine.generate_ids([crafted], greedy(penalty))[0])
    assert got == upstream_tokens(reference, m, TEXTS[0], crafted, monkeypatch, penalty)
    assert len(set(got[:8]) & set(first)) >= 2  # the case the test is about: cond tokens sampled again


def test_greedy_tokens_batched_with_staggered_arrivals_equal_inference_turbo(engine, reference, monkeypatch):
    m = engine.model
    todo = cases() * 2
    prompts = [m.prepare(text, **options) for text, options in todo]
    got = run_staggered(engine, prompts, greedy())
    for (text, _), prompt, ids in zip(todo, prompts, got):
        assert speech(m, ids) == upstream_tokens(reference, m, text, prompt, monkeypatch), text


def test_cfg_weight_is_refused(engine):
    with pytest.raises(InvalidRequest) as err:
        engine.submit(engine.model.prepare(TEXTS[0]), SamplingParams(cfg_weight=0.5))
    assert err.value.field == "cfg_weight"


def test_reference_clips_must_be_longer_than_5_s(engine):
    with pytest.raises(InvalidRequest) as err:
        engine.model.prepare(TEXTS[0], reference_audio=wav(3.0, seed=3))
    assert err.value.field == "reference_audio"


def test_s3gen_gets_three_silence_tokens_after_the_last_code(engine):
    m = engine.model
    state = m.new_codec_state(m.prepare(TEXTS[0]).conditioning)
    m.windows_ready(state, [5, 6, 7], lm_done=False)
    m.windows_ready(state, [5, 6, 7, 8], lm_done=True)
    assert state.tokens == [5, 6, 7, 8, SILENCE, SILENCE, SILENCE] and state.ended
    assert m.codes_from_step(m.speech_base + START_SPEECH, 0) == [] and m.codes_from_step(m.speech_base + 9, 0) == [9]


def test_audio_does_not_depend_on_the_batch(engine):
    """Sampled requests (Turbo's defaults) with their seeds: one at a time, then three at once, staggered."""
    m = engine.model
    requests = [(m.prepare(TEXTS[i]), dataclasses.replace(m.default_sampling(), max_tokens=80, seed=10 + i))
                for i in range(3)]
    alone = [stream_audio(engine, [req], every=1)[0] for req in requests]
    batched = stream_audio(engine, requests, every=4)
    for a, b in zip(alone, batched):
        assert len(a) > 0 and a.shape == b.shape
        assert np.abs(a - b).max() < 1e-4
