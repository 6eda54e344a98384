"""Qwen3-TTS Base (voice cloning, in-context mode) against the reference (qwen-tts-hf): greedy codes equal
`generate(non_streaming_mode=False)` with voice_clone_prompt {ref_code, ref_spk_embedding, icl_mode, not
x_vector_only} for texts longer than, as long as and shorter than the reference codes, alone and continuously
batched (several references, staggered arrivals, chunked prefill, a preemption); our streamed audio equals the
reference decode of ref_code + codes with the reference part cut off; bad reference inputs are refused naming
the field.

The reference clip mostly enters as arrays (its 12 Hz codes and x-vector), as `voice_clone_prompt` hands them to
generate; a WAV clip through REFERENCE_AUDIO goes through the voice-clone front end
(models/qwen3_tts/voice_clone.py, its own parity tests in tests/test_qwen3_tts_voice_clone.py) into the same prompt.
"""
from __future__ import annotations


import numpy as np
import pytest
import torch

from qwen_tts_oracle import reference_codec, reference_model
from voxbackend import SamplingParams
from voxbackend.config import EngineConfig
from voxbackend.engine.engine import Engine
from voxbackend.errors import InvalidRequest
from voxbackend.events import EventKind
from voxbackend.models.base import FEATURE, QUEUED
from voxbackend.models.registry import load_frontend, load_model
from voxbackend.models.qwen3_tts.tiny import write_tiny_qwen3_tts

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest

N = 24  # max_new_tokens
GREEDY = dict(temperature=0, repetition_penalty=1.0)
REF_TEXT = "Speak slowly and clearly."
# text, language, reference clip frames (seed of its codes and x-vector)
CASES = [
    ("The quick brown fox jumps over the lazy dog.", "english", 4, 0),  # text longer than the codes: queued rest
    ("Hello there.", None, 30, 1),  # shorter: padded with tts_pad, tts_eos inside the prompt
    ("She said she would be here by noon.", "german", 9, 2),
]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_tiny_qwen3_tts(tmp_path_factory.mktemp("qwen3_tts_base"), variant="base", seed=5)


@pytest.fixture(scope="module")
def model(base):
    return load_model(base, None, "cpu", torch.float32)


@pytest.fixture(scope="module")
def ref(base):
    """The reference model (strict load, speaker encoder included) and its processor on the folder's tokenizer."""
    from transformers import AutoTokenizer

    reference = reference_model(base)  # imports qwen_tts with its stand-ins first
    from qwen_tts.core.models.processing_qwen3_tts import Qwen3TTSProcessor

    return reference, Qwen3TTSProcessor(tokenizer=AutoTokenizer.from_pretrained(str(base)))


def clip(frames: int, seed: int, hidden: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """A reference clip as the encoders would give it: codes [frames, 16] and an x-vector [hidden]."""
    g = np.random.default_rng(100 + seed)
    return g.integers(0, 2048, (frames, 16)).astype(np.int32), g.standard_normal(hidden).astype(np.float32)


def _case(case):
    text, language, frames, seed = case
    codes, x_vector = clip(frames, seed)
    return text, language, codes, x_vector


def _prompt(model, case, reference_text=REF_TEXT):
    text, language, codes, x_vector = _case(case)
    return model.prepare(text, language=language, reference_text=reference_text, reference_codes=codes,
                         x_vector=x_vector)


def _tokenize(processor, text: str) -> torch.Tensor:
    return processor(text=text, return_tensors="pt")["input_ids"]


def reference_codes(ref, case, max_new_tokens=N) -> np.ndarray:
    """What the reference's generate_voice_clone hands to generate for an in-context voice clone prompt, greedy."""
    m, processor = ref
    text, language, codes, x_vector = _case(case)
    prompt = {"ref_code": [torch.as_tensor(codes, dtype=torch.long)], "ref_spk_embedding": [torch.from_numpy(x_vector)],
              "x_vector_only_mode": [False], "icl_mode": [True]}
    ids = _tokenize(processor, f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n")
    ref_ids = _tokenize(processor, f"<|im_start|>assistant\n{REF_TEXT}<|im_end|>\n")
    with torch.no_grad():
        out, _ = m.generate(input_ids=[ids], ref_ids=[ref_ids], voice_clone_prompt=prompt,
                            languages=[language or "auto"], non_streaming_mode=False, max_new_tokens=max_new_tokens,
                            do_sample=False, subtalker_dosample=False, repetition_penalty=1.0)
    return out[0].numpy()


def _our_codes(steps, eos):
    return np.asarray([s[:16] for s in steps if s[0] != eos], dtype=np.int64).reshape(-1, 16)


def _assert_same(model, steps, ref):
    ours = _our_codes(steps, model.eos)
    if steps[-1][0] == model.eos:
        np.testing.assert_array_equal(ours, ref)
    else:  # no EOS: the reference drops the last frame (see test_qwen3_tts_parity)
        assert len(ref) == N - 1 and len(ours) == N
        np.testing.assert_array_equal(ours[:-1], ref)


def test_prompt_layout_longer_and_shorter_text(model):
    long, short = _prompt(model, CASES[0]), _prompt(model, CASES[1])
    for prompt, frames in ((long, CASES[0][2]), (short, CASES[1][2])):
        rows = prompt.ids
        feature = [r for r in rows if r[0] == FEATURE]
        assert len(feature) == 1 and feature[0][-1] == model.tts_pad  # the x-vector row, tts_pad on the text track
        assert model.prompt_features(prompt.conditioning).shape == (1, 64)
        bos = [r[0] for r in rows].index(model.codec_ids["bos"])
        codes = [r[:16] for r in rows[bos + 1:] if r[0] != QUEUED]
        assert codes == prompt.conditioning["reference_codes"].tolist() and len(codes) == frames
    assert [r[-1] for r in long.ids if r[0] == QUEUED] and long.ids[-1][-1] != model.tts_eos  # the track says eos
    assert short.ids[-1][-1] == model.tts_pad and model.tts_eos in [r[-1] for r in short.ids]
    assert not any(r[0] == QUEUED for r in short.ids)


@pytest.mark.parametrize("index", range(len(CASES)))
def test_greedy_codes_equal_reference_voice_clone(ref, model, index):
    steps = Engine(model, EngineConfig(kv_pages=64)).generate_ids([_prompt(model, CASES[index])],
                                                                   SamplingParams(**GREEDY, max_tokens=N))[0]
    _assert_same(model, steps, reference_codes(ref, CASES[index]))


def test_text_exactly_as_long_as_the_codes(ref, model):
    """codec rows == text ids: no queued text and no pad in the prompt; the track pads from the first step."""
    text = "Good morning! How are you today?"
    n_text = len(model.encode("assistant\n" + REF_TEXT)) - 2 + len(model.encode("assistant\n" + text)) - 2 + 1
    case = (text, None, n_text - 1, 3)
    rows = _prompt(model, case).ids
    assert rows[-1][-1] == model.tts_eos and not any(r[0] == QUEUED for r in rows)
    steps = Engine(model, EngineConfig(kv_pages=64)).generate_ids([_prompt(model, case)],
                                                                   SamplingParams(**GREEDY, max_tokens=N))[0]
    _assert_same(model, steps, reference_codes(ref, case))


def test_batched_references_staggered_chunked_and_preempted(ref, model):
    """Several references at once, arriving every 2 steps, prompts prefilled in chunks of 7 over pages of 4, and
    each request preempted once mid-generation (its whole prefix, the x-vector row included, recomputed)."""
    engine = Engine(model, EngineConfig(kv_pages=128, page_size=4, prefill_budget=7, max_batch=8))
    done: dict[str, list] = {}

    def step():
        engine.step()
        # at 2 frames (neither may be EOS: min_new_tokens) every request is still on the LM
        for r in [r for r in engine.running if r.on_lm and len(r.lm.output_ids) == 2 and not r.lm.preemptions]:
            engine.admission.preempt(r)

    ids = []
    for case in CASES:
        ids.append(engine.submit(_prompt(model, case), SamplingParams(**GREEDY, max_tokens=N),
                                 lambda e: done.__setitem__(e.request_id, e.token_ids) if e.final else None,
                                 streaming=False))
        for _ in range(2):
            step()
    while len(done) < len(ids):
        step()
    assert engine.preemptions == len(CASES) and engine.pool.used_pages == 0
    for rid, case in zip(ids, CASES):
        _assert_same(model, done[rid], reference_codes(ref, case))


def test_streamed_audio_equals_reference_decode_cut_after_the_reference(ref, model, base):
    """The codec state starts after the reference codes: our windows (the first one a single frame) equal the
    reference's decode of ref_code + codes with the reference part cut off (generate_voice_clone)."""
    _, official = reference_codec(base / "speech_tokenizer")
    engine = Engine(model, EngineConfig(kv_pages=64, first_chunk_s=0.0))
    for case in CASES[:2]:
        text, language, codes, x_vector = _case(case)
        chunks = list(engine.stream(text, None, SamplingParams(**GREEDY, max_tokens=N), language=language,
                                    reference_text=REF_TEXT, reference_codes=codes, x_vector=x_vector))
        assert len(chunks[0]) == 1920 and len(chunks) > 2  # the 1-frame first window, then 4-frame windows
        audio = np.concatenate(chunks)
        generated = reference_codes(ref, case)
        whole = np.concatenate([codes.astype(np.int64), generated])
        wav = official(torch.as_tensor(whole)[None])[0].numpy()
        cut = int(len(codes) / len(whole) * len(wav))
        want = wav[cut:]
        assert len(want) > 0 and len(audio) in (len(want), len(want) + 1920)  # + the frame the reference drops
        assert np.abs(audio[: len(want)] - want).max() < 1e-5
        assert np.abs(want).max() > 0.05
        fresh = model.codec.decode(torch.as_tensor(generated)[None])[0].numpy()  # unprimed: a different start
        assert np.abs(fresh[:1920] - want[:1920]).max() > 1e-3


def test_bad_reference_inputs_are_refused_naming_the_field(base, model, tmp_path):
    codes, x_vector = clip(6, 0)
    front = load_frontend(base)
    cases = [
        (dict(), "reference_audio"),  # Base needs a reference clip
        (dict(reference_text=REF_TEXT), "reference_audio"),  # transcript without a clip
        (dict(reference_codes=codes, x_vector=x_vector), "reference_text"),  # clip without transcript
        (dict(reference_codes=codes, x_vector=x_vector, reference_text="  "), "reference_text"),
        (dict(reference_codes=codes, x_vector=x_vector, reference_text=REF_TEXT, voice="ryan"), "voice"),
        (dict(reference_codes=codes, x_vector=x_vector, reference_text=REF_TEXT, instruct="Warm."), "instruct"),
        (dict(reference_codes=codes, x_vector=x_vector, reference_text=REF_TEXT, text_open=True), "text"),
        (dict(reference_codes=codes[:, :8], x_vector=x_vector, reference_text=REF_TEXT), "reference_codes"),
        (dict(reference_codes=codes + 4000, x_vector=x_vector, reference_text=REF_TEXT), "reference_codes"),
        (dict(reference_codes=codes, x_vector=x_vector[:10], reference_text=REF_TEXT), "x_vector"),
    ]
    for kwargs, field in cases:
        with pytest.raises(InvalidRequest) as err:
            front.prepare("Hello there.", **kwargs)
        assert err.value.field == field, (kwargs.keys(), err.value)
    cv = write_tiny_qwen3_tts(tmp_path / "cv", seed=0)
    for kwargs, field in [(dict(reference_text=REF_TEXT), "reference_text"),
                          (dict(reference_codes=codes, x_vector=x_vector), "reference_codes")]:
        with pytest.raises(InvalidRequest) as err:
            load_frontend(cv).prepare("Hello there.", "ryan", **kwargs)
        assert err.value.field == field
    # arrays that bypass prepare are checked at submission, before the engine thread
    engine = Engine(model, EngineConfig(kv_pages=64))
    prompt = _prompt(model, CASES[0])
    prompt.conditioning["x_vector"] = np.full(64, np.nan, np.float32)
    with pytest.raises(InvalidRequest) as err:
        engine.submit(prompt, SamplingParams(**GREEDY, max_tokens=4))
    assert err.value.field == "x_vector"
    prompt = _prompt(model, CASES[0])
    del prompt.conditioning["x_vector"]
    with pytest.raises(InvalidRequest) as err:
        engine.submit(prompt, SamplingParams(**GREEDY, max_tokens=4))
    assert err.value.field == "x_vector"
    assert not engine.waiting and engine.pool.used_pages == 0
    # a bad request next to a good one: the good one is unharmed
    steps = engine.generate_ids([_prompt(model, CASES[2])], SamplingParams(**GREEDY, max_tokens=N))[0]
    assert len(steps) > 2
    events = []
    engine.submit(_prompt(model, CASES[2]), SamplingParams(**GREEDY, max_tokens=2), events.append)
    while not events or not events[-1].final:
        engine.step()
    assert events[-1].kind is EventKind.FINISHED


def _wav(audio: np.ndarray, rate: int = 24000) -> bytes:
    import io

    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, audio, rate, format="WAV", subtype="FLOAT")
    return buf.getvalue()


def test_reference_audio_goes_through_the_voice_clone_front_end(base, model):
    """A WAV clip gives the prompt and conditioning of its codes and x-vector from Qwen3TTSVoiceClone, and the
    stream's codec state starts after those codes; an unreadable clip is refused naming reference_audio."""
    from voxbackend.models.qwen3_tts.voice_clone import Qwen3TTSVoiceClone

    t = np.arange(int(0.9 * 24000)) / 24000
    audio = (0.3 * np.sin(2 * np.pi * 220 * t * (1 + 0.3 * t))).astype(np.float32)
    clone = Qwen3TTSVoiceClone.from_pretrained(base).clone(audio, 24000)
    front = load_frontend(base)
    got = front.prepare("Hello there.", reference_audio=_wav(audio), reference_text=REF_TEXT)
    want = front.prepare("Hello there.", reference_codes=clone.codes.numpy(), x_vector=clone.x_vector.numpy(),
                         reference_text=REF_TEXT)
    assert got.ids == want.ids and len(clone.codes) == 12  # 0.9 s: 12 frames (the last one partial)
    for k in want.conditioning:
        np.testing.assert_array_equal(got.conditioning[k], want.conditioning[k])
    samples = front.prepare("Hello there.", reference_audio=audio, reference_text=REF_TEXT)  # float samples, 24 kHz
    assert samples.ids == want.ids
    clip_file = _wav(audio)  # (a float WAV's PEAK chunk carries a timestamp: one file, sent twice)
    front.prepare("Hello there.", reference_audio=clip_file, reference_text=REF_TEXT)
    encoded = front.clips_encoded
    again = front.prepare("Good morning!", reference_audio=clip_file, reference_text=REF_TEXT)  # the same file
    assert front.clips_encoded == encoded  # kept by content: not encoded again
    np.testing.assert_array_equal(again.conditioning["reference_codes"], want.conditioning["reference_codes"])
    front.prepare("Good morning!", reference_audio=_wav(audio * 0.5), reference_text=REF_TEXT)
    assert front.clips_encoded == encoded + 1
    engine = Engine(model, EngineConfig(kv_pages=64))
    a, _ = engine.synthesize("Hello there.", None, SamplingParams(**GREEDY, max_tokens=8), reference_audio=_wav(audio),
                             reference_text=REF_TEXT)
    b, _ = engine.synthesize("Hello there.", None, SamplingParams(**GREEDY, max_tokens=8),
                             reference_codes=clone.codes.numpy(), x_vector=clone.x_vector.numpy(),
                             reference_text=REF_TEXT)
    np.testing.assert_array_equal(a, b)
    for bad, field in [(b"RIFF not a wav", "reference_audio"), (_wav(audio[:1000]), "reference_audio")]:
        with pytest.raises(InvalidRequest) as err:
            front.prepare("Hello there.", reference_audio=bad, reference_text=REF_TEXT)
        assert err.value.field == field
    with pytest.raises(InvalidRequest) as err:  # a clip without its transcript: refused before it is encoded
        front.prepare("Hello there.", reference_audio=_wav(audio))
    assert err.value.field == "reference_text"
    with pytest.raises(InvalidRequest) as err:
        front.prepare("Hello there.", reference_audio=_wav(audio), reference_codes=clone.codes.numpy(),
                      x_vector=clone.x_vector.numpy(), reference_text=REF_TEXT)
    assert err.value.field == "reference_audio"


@pytest.mark.parametrize("frames", [1, 5, 11, 40, 100])
def test_codec_priming_leaves_the_state_a_whole_decode_would(model, frames):
    """prime runs the synthesis stages over the last reach_frames only; the windows that follow equal those after
    decoding every reference frame (and a whole-clip decode)."""
    codec = model.codec
    g = torch.Generator().manual_seed(frames)
    reference, rest = torch.randint(0, 2048, (frames, 16), generator=g), torch.randint(0, 2048, (9, 16), generator=g)
    primed, decoded = codec.new_state(), codec.new_state()
    codec.prime(primed, reference)
    codec.decode_window([decoded], [reference])
    assert primed.frames == decoded.frames == frames
    whole = codec.decode(torch.cat([reference, rest])[None])[0][frames * 1920:]
    got = torch.cat([codec.decode_window([primed], [rest[:1]])[0], codec.decode_window([primed], [rest[1:]])[0]])
    want = torch.cat([codec.decode_window([decoded], [rest[:1]])[0], codec.decode_window([decoded], [rest[1:]])[0]])
    assert (got - want).abs().max() < 1e-5 and (got - whole).abs().max() < 1e-5
    assert codec.reach_frames < 40  # the long references do skip frames
