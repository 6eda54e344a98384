"""CosyVoice2 text input streaming (bistream) vs upstream `Qwen2LM.inference_bistream`, greedy, on the tiny
checkpoint of voxbackend.models.cosyvoice2.tiny with the fill token made reachable (the tiny weights push it out of
reach: a real model emits it in bistream mode only). Upstream runs with its sampling replaced by argmax (the end
id excluded while it passes ignore_eos; after the text, where upstream raises on a fill, the fill excluded, as
ours does), on transformers' Qwen2 with the cache-indexing stand-in.

The same pieces give the same speech tokens: all submitted at once, arriving at random engine steps while other
requests run, and through preemption (a request recomputes its positions, text rows included).
"""
from __future__ import annotations

import dataclasses
import random
import shutil

import numpy as np
import pytest
import torch

from cosyvoice_oracle import legacy_cache_indexing, upstream_qwen2lm
from voxbackend.errors import InvalidRequest
from voxbackend.models.cosyvoice2.model import SPEECH_TOKENS
from voxbackend.models.cosyvoice2.cloning import VoicePrompt
from voxbackend.sampling_params import SamplingParams
from voxbackend.models.cosyvoice2.tiny import DEFAULT_VOICE, write_tiny_cosyvoice2

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest
FILL_BIAS = 21.0  # the fill's logit bias: it comes now and then, and is forced at other times
GREEDY = SamplingParams(temperature=0.0, max_tokens=500, seed=1)
TEXTS = ["Hello there, how are you doing today? The quick brown fox jumps over the lazy dog.",
         "It is important to test every part of a system, from the smallest function to the whole service.",
         "Good morning! Good evening!"]


def write_bistream_checkpoint(root):
    """The tiny checkpoint with the fill token's bias raised to FILL_BIAS, in root / "cosyvoice2"."""
    base = write_tiny_cosyvoice2(root / "base", seed=0)
    folder = root / "cosyvoice2"
    shutil.copytree(base, folder)
    state = torch.load(folder / "llm.pt", weights_only=True)
    state["llm_decoder.bias"][SPEECH_TOKENS + 2] = FILL_BIAS
    torch.save(state, folder / "llm.pt")
    return folder


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_bistream_checkpoint(tmp_path_factory.mktemp("bistream"))


@pytest.fixture(scope="module")
def engine(ckpt):
    import voxbackend

    return voxbackend.load(ckpt)


@pytest.fixture(scope="module")
def reference(ckpt):
    model = upstream_qwen2lm(ckpt)

    def argmax(scores, decoded, sampling, ignore_eos=True):
        scores = scores.clone()
        if ignore_eos:
            scores[SPEECH_TOKENS] = float("-inf")
        else:  # after the text: upstream raises on a fill (ours excludes it there, as the real model never emits it)
            scores[SPEECH_TOKENS + 2] = float("-inf")
        return scores.argmax()[None]

    model.sampling_ids = argmax
    fed = []
    step = model.llm.forward_one_step

    def forward_one_step(xs, masks, cache=None):
        fed.append(xs.shape[1])
        return step(xs, masks, cache)

    model.llm.forward_one_step = forward_one_step
    model.fed = fed  # positions per forward of the last run
    return model


@pytest.fixture(scope="module")
def voice(ckpt) -> VoicePrompt:
    return VoicePrompt.load(ckpt / "voices" / f"{DEFAULT_VOICE}.safetensors")


def cut(ids: list[int], rng: random.Random, max_len: int = 7) -> list[list[int]]:
    """Pieces of 0..max_len ids (empty pieces included)."""
    pieces, k = [], 0
    while k < len(ids):
        n = rng.randint(0, max_len)
        pieces.append(ids[k:k + n])
        k += n
    return pieces


def upstream_tokens(reference, pieces, transcript, speech) -> list[int]:
    t = lambda ids: torch.tensor([ids], dtype=torch.int32)  # noqa: E731
    reference.fed.clear()
    with legacy_cache_indexing():
        return [int(x) for x in reference.inference_bistream(
            text=(t(p) for p in pieces), prompt_text=t(transcript), prompt_text_len=torch.tensor([len(transcript)]),
            prompt_speech_token=t(speech).reshape(1, -1), prompt_speech_token_len=torch.tensor([len(speech)]),
            embedding=torch.zeros(1, 192))]


def cases(engine, voice, seed: int):
    """(pieces, transcript ids, prompt speech, feat, embedding): with the voice and without a prompt."""
    m, rng = engine.model, random.Random(seed)
    out = []
    for i, text in enumerate(TEXTS):
        pieces = cut(m.text_tokenizer.encode(text), rng)
        if i % 2 == 0:
            out.append((pieces, m.text_tokenizer.encode(voice.transcript), voice.speech_tokens.tolist(),
                        voice.speech_feat.numpy(), voice.embedding.numpy()))
        else:
            out.append((pieces, [], [], np.zeros((0, 80), np.float32), voice.embedding.numpy()))
    return out


def speech_codes(engine, ids: list[int]) -> list[int]:
    return [c for t in ids for c in engine.model.codes_from_step(t, 0)]


def run_streamed(engine, todo, arrival_rng: random.Random | None, params: SamplingParams = GREEDY) -> list[list[int]]:
    """Each case submitted with its first piece (text_open); the others appended at once, or (arrival_rng) one at
    a time at random engine steps; requests start every other step. Returns every request's steps."""
    m = engine.model
    done: dict[str, list[int]] = {}
    errors = []

    def on_event(e):
        if e.final:
            done[e.request_id] = e.token_ids
            if e.error:
                errors.append(e.error)

    ids, left, step = [], [], 0
    while len(done) < len(todo):
        if step % 2 == 0 and len(ids) < len(todo):
            pieces, transcript, speech, feat, emb = todo[len(ids)]
            rid = engine.submit(m.build_bistream_prompt(pieces[0], transcript, speech, feat, emb), params, on_event,
                                streaming=False, text_open=True)
            ids.append(rid)
            left.append([rid, pieces[1:]])
            if arrival_rng is None:
                for k, piece in enumerate(pieces[1:]):
                    engine.append_text(rid, piece, final=k == len(pieces) - 2)
                left[-1][1] = []
                if len(pieces) == 1:
                    engine.append_text(rid, [], final=True)
        for entry in left:
            rid, rest = entry
            if rest and arrival_rng is not None and arrival_rng.random() < 0.3:
                engine.append_text(rid, rest.pop(0), final=not rest)
        engine.step()
        step += 1
    assert not errors, errors
    return [done[rid] for rid in ids]


def test_greedy_bistream_equals_upstream_for_the_same_pieces(engine, voice, reference):
    todo = cases(engine, voice, seed=0)
    got = run_streamed(engine, todo, arrival_rng=None)
    forced = natural = 0
    for steps, (pieces, transcript, speech, _, _) in zip(got, todo):
        want = upstream_tokens(reference, pieces, transcript, speech)
        assert speech_codes(engine, steps) == want
        assert engine.model.is_stop(steps[-1]) and steps[-1] - engine.model.speech_base == SPEECH_TOKENS
        fills = [k for k, s in enumerate(steps) if s == engine.model.bistream.fill]
        forced += sum(b - a == 16 for a, b in zip(fills, fills[1:]))
        natural += sum(b - a < 16 for a, b in zip(fills, fills[1:])) + bool(fills)
    # the rules are exercised: fills the model chose, fills forced 15 speech tokens after the previous one
    assert forced >= 1 and natural >= 3


def test_pieces_arriving_at_random_steps_give_the_same_tokens(engine, voice, reference):
    todo = cases(engine, voice, seed=1) * 2
    got = run_streamed(engine, todo, arrival_rng=random.Random(5))
    for steps, (pieces, transcript, speech, _, _) in zip(got, todo):
        assert speech_codes(engine, steps) == upstream_tokens(reference, pieces, transcript, speech)


def test_preempted_bistream_requests_recompute_their_positions(ckpt, voice, reference):
    import voxbackend

    small = voxbackend.load(ckpt, page_size=16, kv_pages=20)  # one request fits (18 pages), two may not
    todo = cases(small, voice, seed=2) * 2
    got = run_streamed(small, todo, random.Random(7), dataclasses.replace(GREEDY, max_tokens=200))
    assert small.preemptions > 0
    for steps, (pieces, transcript, speech, _, _) in zip(got, todo):
        assert speech_codes(small, steps) == upstream_tokens(reference, pieces, transcript, speech)
    assert small.pool.free_pages == small.pool.num_pages  # no page leaked


def test_streamed_text_is_refused_naming_the_field(engine, voice):
    m = engine.model
    prompt = m.build_bistream_prompt([1, 2], [], [], np.zeros((0, 80), np.float32), voice.embedding.numpy())
    rid = engine.submit(prompt, GREEDY, text_open=True)
    with pytest.raises(InvalidRequest) as e:
        engine.append_text(rid, [m.text_vocab], final=False)
    assert e.value.field == "text"
    engine.cancel(rid)
    engine.step()
    with pytest.raises(InvalidRequest) as e:  # a streamed-text prompt must be [sos, text, prompt speech]
        engine.submit(m.build_prompt([1, 2], [], [], np.zeros((0, 80), np.float32), voice.embedding.numpy()),
                      GREEDY, text_open=True)
    assert e.value.field == "prompt_ids"


def test_a_streamed_text_stops_at_the_whole_texts_length_rule(ckpt, voice):
    """The tiny checkpoint without the fill bias never picks the fill (so never pulls the next piece) nor the end
    id: the request stops ("length") at 20 x the text tokens received (transcript included), not at the context
    budget."""
    import voxbackend

    engine = voxbackend.load(ckpt.parent / "base")
    m = engine.model
    pieces = cut(m.text_tokenizer.encode(TEXTS[2]), random.Random(3))
    transcript = m.text_tokenizer.encode("Hi.")  # a short one: each text token is 20 steps here
    ended = {}
    rid = engine.submit(m.build_bistream_prompt(pieces[0], transcript, [], np.zeros((0, 80), np.float32),
                                                voice.embedding.numpy()),
                        dataclasses.replace(GREEDY, max_tokens=5000), lambda e: e.final and ended.update(e=e),
                        streaming=False, text_open=True)
    for k, piece in enumerate(pieces[1:]):
        engine.append_text(rid, piece, final=k == len(pieces) - 2)
    while "e" not in ended:
        engine.step()
    text_ids = len(transcript) + sum(map(len, pieces))
    assert ended["e"].finish_reason == "length" and len(ended["e"].token_ids) == 20 * text_ids
    assert engine.pool.free_pages == engine.pool.num_pages
