"""Qwen3-TTS end to end against the reference (qwen-tts-hf): the tiny checkpoint that voxbackend writes (without
the reference) loads into `Qwen3TTSForConditionalGeneration` strictly; the reference processor tokenizes the
template to the ids our prompt uses; greedy codes equal the reference `generate(non_streaming_mode=False)` for
CustomVoice speakers (a dialect one), languages, an instruct and a VoiceDesign checkpoint, alone and continuously
batched with staggered arrivals; a repetition penalty bites the same ids as the reference's; and
Engine.synthesize's audio equals the reference decoder on the reference codes.

Length: the reference's codes stop at the first EOS; with max_new_tokens N and no EOS it returns N - 1 frames
(the N-th token is sampled but its frame's codebooks 1-15 are never predicted), where the engine returns N.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from qwen_tts_oracle import import_qwen_tts, reference_codec, reference_rope
from voxbackend import SamplingParams
from voxbackend.attention.base import SeqSlice
from voxbackend.attention.torch_backend import TorchPagedAttention
from voxbackend.config import EngineConfig
from voxbackend.engine.engine import Engine
from voxbackend.engine.kv_pool import KVPool
from voxbackend.models.base import QUEUED
from voxbackend.models.registry import load_model
from voxbackend.models.qwen3_tts.tiny import write_tiny_qwen3_tts

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest

N = 24  # max_new_tokens
GREEDY = dict(temperature=0, repetition_penalty=1.0)
CV_CASES = [  # text, voice, language, instruct
    ("Hello there, this is a test.", "ryan", "english", None),  # stops early (EOS)
    ("The quick brown fox jumps over the lazy dog.", "Vivian", None, None),
    ("She said she would be here by noon.", "eric", "auto", None),  # auto + dialect speaker
    ("Good morning! How are you today?", "ryan", "german", "Speak slowly and clearly."),
    ("A calm narrator reads the evening news.", "vivian", "Japanese", None),
]
VD_CASES = [("Text arrives in pieces while audio plays.", None, "english", "A calm narrator, warm voice."),
            ("Numbers like 12 and 3.5 are read aloud.", None, None, None)]


def _write(tmp_path_factory, variant):
    return write_tiny_qwen3_tts(tmp_path_factory.mktemp(f"qwen3_tts_{variant}"), variant=variant, seed=3)


@pytest.fixture(scope="module")
def cv(tmp_path_factory):
    return _write(tmp_path_factory, "custom_voice")


@pytest.fixture(scope="module")
def vd(tmp_path_factory):
    return _write(tmp_path_factory, "voice_design")


def _reference(folder):
    """The reference model with the folder's weights (strict) and its processor on the folder's tokenizer."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    import_qwen_tts()
    from qwen_tts.core.models import configuration_qwen3_tts, modeling_qwen3_tts
    from qwen_tts.core.models.processing_qwen3_tts import Qwen3TTSProcessor

    config = configuration_qwen3_tts.Qwen3TTSConfig.from_pretrained(folder)
    with reference_rope():
        model = modeling_qwen3_tts.Qwen3TTSForConditionalGeneration(config).eval()
    model.load_state_dict(load_file(str(folder / "model.safetensors")), strict=True)
    processor = Qwen3TTSProcessor(tokenizer=AutoTokenizer.from_pretrained(str(folder)))
    return model, processor


@pytest.fixture(scope="module")
def refs(cv, vd):
    return {"custom_voice": _reference(cv), "voice_design": _reference(vd)}


@pytest.fixture(scope="module")
def ours(cv, vd):
    return {"custom_voice": load_model(cv, None, "cpu", torch.float32),
            "voice_design": load_model(vd, None, "cpu", torch.float32)}


def _tokenize(processor, text: str) -> torch.Tensor:
    return processor(text=text, return_tensors="pt")["input_ids"]


def reference_codes(ref, case, max_new_tokens=N, **kwargs) -> np.ndarray:
    """What the reference's generate_custom_voice / generate_voice_design hand to generate, greedy."""
    model, processor = ref
    text, voice, language, instruct = case
    ids = _tokenize(processor, f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n")
    instruct_ids = [_tokenize(processor, f"<|im_start|>user\n{instruct}<|im_end|>\n") if instruct else None]
    options = dict(do_sample=False, subtalker_dosample=False, repetition_penalty=1.0)
    options.update(kwargs)
    with torch.no_grad():
        codes, _ = model.generate(input_ids=[ids], instruct_ids=instruct_ids, languages=[language or "auto"],
                                  speakers=[voice] if voice else None, non_streaming_mode=False,
                                  max_new_tokens=max_new_tokens, **options)
    return codes[0].numpy()


def _our_codes(steps: list[list[int]], eos: int) -> np.ndarray:
    frames = [s[:16] for s in steps if s[0] != eos]
    return np.asarray(frames, dtype=np.int64).reshape(-1, 16)


def _assert_same(ours: np.ndarray, ref: np.ndarray, steps: list, eos: int, max_new_tokens=N) -> None:
    if steps[-1][0] == eos:  # both stopped on EOS
        np.testing.assert_array_equal(ours, ref)
    else:
        assert len(ref) == max_new_tokens - 1 and len(ours) == max_new_tokens
        np.testing.assert_array_equal(ours[:-1], ref)


def _prompt(model, case):
    text, voice, language, instruct = case
    return model.prepare(text, voice, language=language, instruct=instruct)


def test_reference_loads_the_tiny_checkpoint_and_its_logits_match(cv, refs, ours):
    """Strict load (in the fixture) + the talker's logits on a real prompt and decode rows, paged, 1e-4."""
    ref_model, _ = refs["custom_voice"]
    model = ours["custom_voice"]
    rows = [r for r in _prompt(model, CV_CASES[3]) if r[0] != QUEUED]
    g = torch.Generator().manual_seed(0)
    for t in range(3):  # three generated frames with their text ids
        rows.append([*torch.randint(0, 2048, (16,), generator=g).tolist(), 5 + t])
    x = torch.tensor(rows)
    talker = ref_model.talker
    embeds = torch.zeros(len(rows), talker.config.hidden_size)
    with torch.no_grad():
        for t, row in enumerate(rows):
            if row[0] >= 0:
                embeds[t] += talker.get_input_embeddings()(torch.tensor(row[0]))
            for j in range(1, 16):
                if row[j] >= 0:
                    embeds[t] += talker.code_predictor.get_input_embeddings()[j - 1](torch.tensor(row[j]))
            embeds[t] += talker.text_projection(talker.get_text_embeddings()(torch.tensor([row[-1]])))[0]
        hidden = talker.model(inputs_embeds=embeds[None], use_cache=False).last_hidden_state
        want = talker.codec_head(hidden)[0]
    geo = model.spec.geometry
    pool = KVPool(geo, 8, 16, "cpu", torch.float32)
    pages = pool.allocate("r", len(rows))
    attention = TorchPagedAttention(pool.cache, pool.page_size, pool.scratch_page, geo.head_dim**-0.5)
    attention.plan([SeqSlice(0, len(rows), 0, pages)])
    with torch.no_grad():
        got = model.logits(model.forward(x, torch.arange(len(rows)), attention))
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4


@pytest.mark.parametrize("text", ["Hello there.", " leading space", "two\nlines", "\nnewline first", "trailing \n",
                                  "ünïcödé 12 3.5"])
def test_template_ids_equal_the_reference_processor(refs, ours, text):
    _, processor = refs["custom_voice"]
    model = ours["custom_voice"]
    ids = _tokenize(processor, f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n")[0].tolist()
    rows = model.prepare(text, "ryan")
    spoken = [r[-1] for r in rows if r[0] == -1] + [rows[[r[0] for r in rows].index(model.codec_ids["bos"])][-1]]
    assert spoken == ids[:4]
    assert [r[-1] for r in rows if r[0] == QUEUED] == ids[4:-5]
    assert [r[-1] for r in model.prepare("x", instruct=text) if r[0] == -1][:-3] == _tokenize(
        processor, f"<|im_start|>user\n{text}<|im_end|>\n")[0].tolist()


@pytest.mark.parametrize("variant,index", [("custom_voice", i) for i in range(len(CV_CASES))]
                         + [("voice_design", i) for i in range(len(VD_CASES))])
def test_greedy_codes_equal_reference_generate(refs, ours, variant, index):
    case = (CV_CASES if variant == "custom_voice" else VD_CASES)[index]
    model = ours[variant]
    steps = Engine(model, EngineConfig(kv_pages=64)).generate_ids([_prompt(model, case)],
                                                                   SamplingParams(**GREEDY, max_tokens=N))[0]
    _assert_same(_our_codes(steps, model.eos), reference_codes(refs[variant], case), steps, model.eos)


def test_repetition_penalty_applies_to_generated_codebook_0_as_in_the_reference(refs, ours):
    """HF generate from inputs_embeds penalizes the generated codebook-0 ids only (no prompt ids, and the code
    predictor's own generate none): a strong penalty under greedy gives the reference's codes exactly."""
    model = ours["custom_voice"]
    case = CV_CASES[1]
    steps = Engine(model, EngineConfig(kv_pages=64)).generate_ids(
        [_prompt(model, case)], SamplingParams(temperature=0, repetition_penalty=3.0, max_tokens=N))[0]
    plain = Engine(model, EngineConfig(kv_pages=64)).generate_ids(
        [_prompt(model, case)], SamplingParams(**GREEDY, max_tokens=N))[0]
    assert steps != plain  # the penalty bites
    ref = reference_codes(refs["custom_voice"], case, repetition_penalty=3.0)
    _assert_same(_our_codes(steps, model.eos), ref, steps, model.eos)


def test_continuous_batching_with_staggered_arrivals_equals_reference(refs, ours):
    model = ours["custom_voice"]
    engine = Engine(model, EngineConfig(kv_pages=64, max_batch=8))
    done: dict[str, list] = {}
    ids = []
    for case in CV_CASES:  # a new request every 3 steps, joining those mid-generation
        ids.append(engine.submit(_prompt(model, case), SamplingParams(**GREEDY, max_tokens=N),
                                 lambda e: done.__setitem__(e.request_id, e.token_ids) if e.final else None))
        for _ in range(3):
            engine.step()
    while len(done) < len(ids):
        engine.step()
    for rid, case in zip(ids, CV_CASES):
        steps = done[rid]
        _assert_same(_our_codes(steps, model.eos), reference_codes(refs["custom_voice"], case), steps, model.eos)


def _reference_decoder(folder):
    _, official = reference_codec(folder)
    return lambda codes: official(torch.as_tensor(codes)[None])[0].numpy()


def test_synthesize_audio_equals_reference_decode_of_reference_codes(cv, refs, ours):
    model = ours["custom_voice"]
    decode = _reference_decoder(cv / "speech_tokenizer")
    engine = Engine(model, EngineConfig(kv_pages=64))
    for case in CV_CASES[:2]:
        text, voice, language, instruct = case
        audio, rate = engine.synthesize(text, voice, SamplingParams(**GREEDY, max_tokens=N), language=language,
                                        instruct=instruct)
        assert rate == 24000
        ref = decode(reference_codes(refs["custom_voice"], case))
        assert len(ref) > 0 and len(audio) in (len(ref), len(ref) + 1920)  # + the frame the reference drops
        assert np.abs(audio[: len(ref)] - ref).max() < 1e-5
        assert np.abs(ref).max() > 0.05  # not silence


def test_default_sampling_is_the_official_one(cv, ours):
    p = ours["custom_voice"].default_sampling()
    gen = json.loads((cv / "generation_config.json").read_text())
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty, p.max_tokens) == (
        gen["temperature"], gen["top_k"], gen["top_p"], gen["repetition_penalty"], gen["max_new_tokens"])
    # a sampled stream runs and is reproducible from its seed
    engine = Engine(ours["custom_voice"], EngineConfig(kv_pages=64))
    prompt = _prompt(ours["custom_voice"], CV_CASES[1])
    a = engine.generate_ids([prompt], SamplingParams(**{**p.__dict__, "max_tokens": 8, "seed": 5}))[0]
    b = engine.generate_ids([prompt], SamplingParams(**{**p.__dict__, "max_tokens": 8, "seed": 5}))[0]
    assert a == b and len(a) == 8
