"""CosyVoice2 LM and whole-pipeline parity, on the tiny checkpoint of voxbackend.models.cosyvoice2.tiny (official
folder layout), loaded unchanged by our engine and by upstream CosyVoice (`cosyvoice-minicpmo`):

- LM: our engine's greedy tokens equal upstream `Qwen2LM.inference` (its HF Qwen2 backbone, its min/max length
  rules) with its sampling replaced by argmax, alone and continuously batched with staggered arrivals;
- audio: `Engine.synthesize` equals upstream's pipeline on the same weights: upstream LM tokens through
  upstream `CosyVoice2Model.tts(stream=True)`, chunk for chunk, within 1e-4.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cosyvoice_oracle import upstream_cosyvoice2_model, upstream_qwen2lm
from util_engine_drive import run_staggered
from voxbackend.engine.detokenize import window_seed
from voxbackend.errors import InvalidRequest
from voxbackend.models.base import Prompt
from voxbackend.models.cosyvoice2.model import SPEECH_TOKENS
from voxbackend.models.cosyvoice2.cloning import VoicePrompt
from voxbackend.sampling_params import SamplingParams
from voxbackend.models.cosyvoice2.tiny import DEFAULT_VOICE, write_tiny_cosyvoice2

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest
ATOL = 1e-4
TEXTS = ["Hello there, how are you doing today?", "The quick brown fox.", "Good morning!",
         "It is important to test every part of a system, again and again."]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_cosyvoice2(tmp_path_factory.mktemp("tiny_cosyvoice2"), seed=0)


@pytest.fixture(scope="module")
def engine(ckpt):
    import voxbackend

    return voxbackend.load(ckpt)


@pytest.fixture(scope="module")
def voice(ckpt) -> VoicePrompt:
    return VoicePrompt.load(ckpt / "voices" / f"{DEFAULT_VOICE}.safetensors")


@pytest.fixture(scope="module")
def reference_lm(ckpt):
    return upstream_lm(ckpt)


@pytest.fixture(scope="module")
def endless(ckpt, tmp_path_factory):
    """The same checkpoint with the end id out of reach: every utterance runs to max_len."""
    import shutil

    folder = tmp_path_factory.mktemp("endless") / "cosyvoice2"
    shutil.copytree(ckpt, folder)
    state = torch.load(folder / "llm.pt", weights_only=True)
    state["llm_decoder.bias"][SPEECH_TOKENS] = -1e4
    torch.save(state, folder / "llm.pt")
    import voxbackend

    return voxbackend.load(folder), upstream_lm(folder)


def upstream_lm(ckpt):
    """Upstream Qwen2LM, llm.pt loaded strictly; argmax instead of sampling (the end id excluded while upstream
    would reject it, i.e. before min_len)."""
    model = upstream_qwen2lm(ckpt)

    def argmax(scores, decoded, sampling, ignore_eos=True):
        scores = scores.clone()
        if ignore_eos:
            scores[SPEECH_TOKENS] = float("-inf")
        return scores.argmax()[None]

    model.sampling_ids = argmax
    return model


def reference_tokens(model, text_ids, prompt_text_ids, prompt_speech) -> list[int]:
    t = lambda ids: torch.tensor([ids], dtype=torch.int32)  # noqa: E731
    return [int(x) for x in model.inference(
        text=t(text_ids), text_len=torch.tensor([len(text_ids)]), prompt_text=t(prompt_text_ids),
        prompt_text_len=torch.tensor([len(prompt_text_ids)]),
        prompt_speech_token=t(prompt_speech).reshape(1, -1), prompt_speech_token_len=torch.tensor([len(prompt_speech)]),
        embedding=torch.zeros(1, 192))]


def cases(engine, voice):
    """(text ids, prompt text ids, prompt speech tokens, feat, embedding): with the voice and without a prompt."""
    m = engine.model
    speech = voice.speech_tokens.tolist()
    out = []
    for i, text in enumerate(TEXTS):
        ids = m.text_tokenizer.encode(text)
        if i % 2 == 0:
            out.append((ids, m.text_tokenizer.encode(voice.transcript), speech, voice.speech_feat.numpy(),
                        voice.embedding.numpy()))
        else:
            out.append((ids, [], [], np.zeros((0, 80), np.float32), voice.embedding.numpy()))
    return out


def speech_codes(engine, ids: list[int]) -> list[int]:
    return [c for t in ids for c in engine.model.codes_from_step(t, 0)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=6000, seed=1)


def test_greedy_tokens_alone_equal_upstream_with_its_length_rules(engine, voice, reference_lm):
    early_end = 0
    for text_ids, prompt_text, speech, feat, emb in cases(engine, voice):
        prompt = engine.model.build_prompt(text_ids, prompt_text, speech, feat, emb)
        assert (prompt.min_tokens, prompt.max_tokens) == (2 * len(text_ids), 20 * len(text_ids))
        got = engine.generate_ids([prompt], GREEDY)[0]
        want = reference_tokens(reference_lm, text_ids, prompt_text, speech)
        assert speech_codes(engine, got) == want
        assert engine.model.is_stop(got[-1]) and prompt.min_tokens <= len(want) < prompt.max_tokens
        # without min_len the end id would have come earlier: the rule is exercised, not idle
        unbounded = engine.generate_ids([Prompt(prompt.ids, prompt.conditioning, 0, prompt.max_tokens)], GREEDY)[0]
        early_end += len(speech_codes(engine, unbounded)) < prompt.min_tokens
    assert early_end >= 2


def test_greedy_tokens_run_to_max_len_like_upstream(endless, voice):
    engine, reference = endless
    for text_ids, prompt_text, speech, feat, emb in cases(engine, voice)[1:3]:
        prompt = engine.model.build_prompt(text_ids, prompt_text, speech, feat, emb)
        got = engine.generate_ids([prompt], GREEDY)[0]
        want = reference_tokens(reference, text_ids, prompt_text, speech)
        assert speech_codes(engine, got) == want and len(want) == prompt.max_tokens == 20 * len(text_ids)


def test_greedy_tokens_batched_with_staggered_arrivals_equal_upstream(engine, voice, reference_lm):
    todo = cases(engine, voice) * 2
    prompts = [engine.model.build_prompt(*case) for case in todo]
    got = run_staggered(engine, prompts, GREEDY, every=3)  # a new request every third engine step
    for steps, (text_ids, prompt_text, speech, _, _) in zip(got, todo):
        assert speech_codes(engine, steps) == reference_tokens(reference_lm, text_ids, prompt_text, speech)


@pytest.fixture(scope="module")
def upstream_pipeline(ckpt, engine):
    return upstream_cosyvoice2_model(ckpt, engine.model.codec.cfg)


def test_synthesize_equals_upstream_lm_then_upstream_streaming(engine, voice, reference_lm, upstream_pipeline):
    engine.start()
    try:
        for i, text in enumerate((TEXTS[0], TEXTS[3])):  # 33 and 69 tokens: 2 and 3 windows
            seed = 40 + i
            got, rate = engine.synthesize(text, DEFAULT_VOICE, SamplingParams(temperature=0.0, seed=seed))
            assert rate == 24000
            text_ids = engine.model.text_tokenizer.encode(text)
            tokens = reference_tokens(reference_lm, text_ids, engine.model.text_tokenizer.encode(voice.transcript),
                                      voice.speech_tokens.tolist())
            with torch.random.fork_rng():
                torch.manual_seed(window_seed(seed, 0))  # the request's HiFT excitation noise
                chunks = [c["tts_speech"][0] for c in upstream_pipeline.tts(
                    source_speech_token=torch.tensor([tokens], dtype=torch.int32),
                    flow_prompt_speech_token=voice.speech_tokens[None], prompt_speech_feat=voice.speech_feat[None],
                    flow_embedding=voice.embedding[None], stream=True)]
            assert len(chunks) > 1
            want = torch.cat(chunks).numpy()
            assert got.shape == want.shape and 0.01 < want.std()
            # float rounding of differently batched ops, grown through the flow's ODE steps and HiFT: on AVX2 hosts
            # single samples differ by up to 3e-4 (at a peak near 1), the whole signal by 3e-5 of its norm
            assert np.linalg.norm(got - want) / np.linalg.norm(want) < ATOL
            np.testing.assert_allclose(got, want, atol=10 * ATOL, rtol=0)
    finally:
        engine.shutdown()


def test_prepare_refuses_bad_voice_input_naming_the_field(engine):
    m = engine.model
    with pytest.raises(InvalidRequest) as e:
        m.prepare("Hello.", reference_audio=b"not audio at all", reference_text="hi")
    assert e.value.field == "reference_audio"
    from voxbackend.models.cosyvoice2.tiny import voice_clip
    import io

    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, voice_clip(1.0), 16000, format="WAV")
    with pytest.raises(InvalidRequest) as e:
        m.prepare("Hello.", reference_audio=buf.getvalue())
    assert e.value.field == "reference_text"
    with pytest.raises(InvalidRequest) as e:
        m.prepare("Hello.", voice="nobody")
    assert e.value.field == "voice"
    with pytest.raises(InvalidRequest) as e:
        engine.submit(Prompt([1, 2], {"prompt_speech_tokens": np.zeros(3, np.int32),
                                      "prompt_feat": np.zeros((5, 80), np.float32),
                                      "speaker_embedding": np.zeros(192, np.float32)}))
    assert e.value.field == "prompt_feat"


def test_as_complete_streams_cut_windows_as_for_the_complete_sequence(engine, upstream_pipeline):
    """Tokens arriving 5 at a time, a 7-token prompt (first window 43) and 33 tokens left after it: upstream, given
    the complete sequence, flushes them in one final window; a stream that windows on arrival would not."""
    codec = engine.model.codec
    g = torch.Generator().manual_seed(5)
    prompt, feat, emb = (torch.randint(0, 6561, (7,), generator=g), torch.randn(14, 80, generator=g),
                         torch.randn(192, generator=g))
    tokens = torch.randint(0, 6561, (43 + 33,), generator=g)
    with torch.random.fork_rng():
        torch.manual_seed(9)
        want = [c["tts_speech"][0] for c in upstream_pipeline.tts(
            source_speech_token=tokens[None].int(), flow_prompt_speech_token=prompt[None].int(),
            prompt_speech_feat=feat[None], flow_embedding=emb[None], stream=True)]
    counts = {}
    for as_complete in (True, False):
        stream = codec.new_stream(prompt, feat, emb, seed=9, as_complete=as_complete)
        chunks = []
        for k in range(0, len(tokens), 5):
            stream.push(tokens[k:k + 5].tolist())
            if k + 5 >= len(tokens):
                stream.end()
            while codec.window_due(stream):
                chunks.append(codec.decode([stream])[0])
        counts[as_complete] = len(chunks)
        if as_complete:
            assert [len(c) for c in chunks] == [len(c) for c in want]
            for got, ref in zip(chunks, want):
                torch.testing.assert_close(got, ref, atol=ATOL, rtol=ATOL)
    assert counts == {True: 2, False: 3}
