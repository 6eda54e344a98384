"""Step-Audio 2's LM in the engine (voxbackend/models/step_audio2/model.py) on the tiny random checkpoint
(voxbackend/models/step_audio2/tiny.py), against a reference composed from independent parts:

- the prompt: step-audio2==1.0.0's own StepAudio2.apply_chat_template (stepaudio2.py, run unbound: it never uses
  the model it belongs to) and its tokenization, one tokenizer call per piece, by transformers' tokenizer;
- the audio rows: the straightforward torch transcription of the upstream encoder (tests/test_step_audio2_encoder.py),
  the first compute_token_num(frames) of each piece's (as upstream inserts them);
- the LM: transformers' Qwen2ForCausalLM.generate from inputs_embeds, greedy.

Greedy reply ids equal the reference's, alone, batched with staggered arrivals and through preemptions.
"""
from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest
import torch

from step_audio2_oracle import load_utils
from test_step_audio2_encoder import upstream_rows
from voxbackend import SamplingParams
from voxbackend.config import EngineConfig
from voxbackend.engine.engine import Engine
from voxbackend.errors import InvalidRequest
from voxbackend.events import EventKind
from voxbackend.models.base import FEATURE
from voxbackend.models.checkpoint import load_safetensors, read_config
from voxbackend.models.step_audio2.audio_encoder import piece_mel
from voxbackend.models.step_audio2.model import AUDIO_OFFSET, StepAudio2
from voxbackend.models.step_audio2.tiny import write_tiny_step_audio2
from tests.util_engine_drive import run_staggered
from cosyvoice_oracle import ORACLES

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 12
SYSTEM = "You are a helpful assistant."


def clip(seconds: float, seed: int) -> np.ndarray:
    t = np.arange(int(seconds * 16000)) / 16000
    noise = np.random.default_rng(seed).standard_normal(t.size)
    return (0.3 * np.sin(2 * np.pi * (170 + 30 * seed) * t) + 0.05 * noise).astype(np.float32)


# (text, audio seconds, system, spoken reply)
REQUESTS = [("Good morning! What is this sound?", 1.3, SYSTEM, True), (None, 0.7, None, True),
            ("Tell me about the weather.", None, SYSTEM, False), ("Hello there, <|EOT|> is text here.", 0.45, None,
                                                                  True)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_step_audio2(tmp_path_factory.mktemp("step_audio2"))


@pytest.fixture(scope="module")
def model(checkpoint):
    from voxbackend.models import registry

    assert registry.detect_kind(checkpoint).name == "step_audio2"
    loaded = registry.load_model(checkpoint, None, "cpu", torch.float32)
    assert isinstance(loaded, StepAudio2)
    return loaded


@pytest.fixture(scope="module")
def upstream():
    """stepaudio2.py's StepAudio2 class, its `from utils import ...` answered by the oracle's utils.py and
    load_audio by the clip itself (the test hands it arrays, not files)."""
    utils = load_utils()
    saved = sys.modules.get("utils")
    sys.modules["utils"] = utils
    try:
        source = ORACLES / "step_audio2" / "stepaudio2.py"
        spec = importlib.util.spec_from_file_location("step_audio2_stepaudio2", source)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            del sys.modules["utils"]
        else:
            sys.modules["utils"] = saved
    module.load_audio = lambda audio: torch.from_numpy(audio)
    return module


def upstream_prompt(upstream, checkpoint, text, seconds, system, speak, seed):
    """The upstream messages for one request -> (prompt ids, the spectrogram of each audio piece)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(checkpoint / "tokenizer.json"))
    content = ([{"type": "text", "text": text}] if text else []) + (
        [{"type": "audio", "audio": clip(seconds, seed)}] if seconds else [])
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "human", "content": content},
        {"role": "assistant", "content": "<tts_start>" if speak else None, "eot": False}]
    pieces, mels = upstream.StepAudio2.apply_chat_template(None, messages)
    ids = [i for piece in pieces for i in tokenizer(text=piece)["input_ids"]]
    return ids, mels, tokenizer.convert_tokens_to_ids("<audio_patch>")


def reference_reply(checkpoint, model, ids, mels, patch_id) -> list[int]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    text_config = read_config(checkpoint)["text_config"]
    lm = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in text_config.items() if k != "max_seq_len"})).eval()
    weights = load_safetensors(checkpoint)
    lm.load_state_dict({k: v for k, v in weights.items() if k.startswith(("model.", "lm_head."))}, strict=True)
    with torch.inference_mode():
        at = [i for i, t in enumerate(ids) if t == patch_id]
        embeds = lm.get_input_embeddings()(torch.tensor([max(i, 0) for i in ids]))
        if mels:
            count = load_utils().compute_token_num  # the adapter may give a row more: upstream takes the first ones
            embeds[at] = torch.cat([upstream_rows(model.audio_encoder, m)[:count(m.shape[1])] for m in mels])
        out = lm.generate(inputs_embeds=embeds[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    return out[0].tolist()


def test_prompts_equal_the_upstream_template_and_its_tokenization(upstream, checkpoint, model):
    for seed, (text, seconds, system, speak) in enumerate(REQUESTS):
        if text and "<|EOT|>" in text:
            continue  # upstream makes it a control id; here it stays text (below)
        ids, mels, patch = upstream_prompt(upstream, checkpoint, text, seconds, system, speak, seed)
        prompt = model.prepare(text, audio=clip(seconds, seed) if seconds else None, sample_rate=16000, system=system,
                               speak=speak)
        assert prompt.ids == [FEATURE if i == patch else i for i in ids], seed
        if seconds:
            for mel, theirs in zip([piece_mel(clip(seconds, seed))], mels):
                torch.testing.assert_close(mel, theirs, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(torch.from_numpy(prompt.conditioning["audio_mels"]), torch.cat(mels, dim=1))
            assert model.feature_count(prompt.conditioning) == ids.count(patch)
    spelled = model.prepare("say <|EOT|> now")
    assert spelled.ids.count(model.template.eot) == 1, "text that spells a control token stays text"


def test_greedy_replies_equal_the_composed_reference_alone_and_batched(upstream, checkpoint, model):
    from transformers import PreTrainedTokenizerFast

    expected = []
    prompts = []
    for seed, (text, seconds, system, speak) in enumerate(REQUESTS):
        prompts.append(model.prepare(text, audio=clip(seconds, seed) if seconds else None, sample_rate=16000,
                                     system=system, speak=speak))
        if text and "<|EOT|>" in text:  # upstream would make a control id of it: the reference takes ours
            ids = [i if i != FEATURE else -1 for i in prompts[-1].ids]
            mels, patch = [piece_mel(clip(seconds, seed))], -1
        else:
            ids, mels, patch = upstream_prompt(upstream, checkpoint, text, seconds, system, speak, seed)
        expected.append(reference_reply(checkpoint, model, ids, mels, patch))
    greedy = SamplingParams(temperature=0, max_tokens=STEPS, min_tokens=STEPS)
    engine = Engine(model, EngineConfig(page_size=4, max_batch=4, kv_pages=256, prefill_budget=16))
    alone = [engine.generate_ids([p], greedy)[0] for p in prompts]
    assert alone == expected
    texts: list[list[str]] = []  # each request's text pieces
    # each arrives while the earlier ones are decoding
    assert run_staggered(engine, prompts, greedy, every=2, texts=texts) == expected
    assert engine.pool.used_pages == 0
    # a pool that holds the longest request but not all four: requests are preempted and resume with the same
    # audio rows at their placeholder positions
    pages = [-(-(len(p.ids) + STEPS) // 4) for p in prompts]
    small = Engine(model, EngineConfig(page_size=4, max_batch=4, kv_pages=max(pages) + 2, prefill_budget=16))
    assert sum(pages) > max(pages) + 2
    assert run_staggered(small, prompts, greedy, every=2) == expected
    assert small.preemptions > 0 and small.pool.used_pages == 0
    # submitted together: the audio encoder runs once for the three requests with audio, on the engine thread
    calls = []
    encode = model.encode_features
    model.encode_features = lambda conds: calls.append(len(conds)) or encode(conds)
    try:
        assert engine.generate_ids(prompts, greedy) == expected
    finally:
        del model.encode_features
    assert calls == [3]
    # the reply's text, as TEXT events in pieces: what the reference's text ids (below the control ids) decode to
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(checkpoint / "tokenizer.json"))
    first_control = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    for pieces, reply in zip(texts, expected):
        said = tokenizer.decode([i for i in reply if i < first_control])
        assert "".join(pieces) == said
    assert any(len(pieces) > 1 for pieces in texts), "text comes in pieces as it is generated"
    assert any(i >= AUDIO_OFFSET for reply in expected for i in reply), "the tiny model says audio ids too"


def test_a_conversation_equals_the_upstream_multi_turn_template(upstream, checkpoint, model):
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(checkpoint / "tokenizer.json"))
    first, second = clip(0.9, 7), clip(0.6, 8)
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "human", "content": [{"type": "text", "text": "What is this?"},
                                              {"type": "audio", "audio": first}]},
                {"role": "assistant", "content": "It is a tone, rising."},
                {"role": "human", "content": [{"type": "audio", "audio": second}]},
                {"role": "human", "content": "And now?"},
                {"role": "assistant", "content": "<tts_start>", "eot": False}]
    pieces, mels = upstream.StepAudio2.apply_chat_template(None, messages)
    expected = [i for piece in pieces for i in tokenizer(text=piece)["input_ids"]]
    patch = tokenizer.convert_tokens_to_ids("<audio_patch>")
    prompt = model.prepare("And now?", system=SYSTEM, history=[
        {"role": "user", "text": "What is this?", "audio": first, "sample_rate": 16000},
        {"role": "assistant", "text": "It is a tone, rising."},
        {"role": "user", "text": "", "audio": second, "sample_rate": 16000}])
    assert prompt.ids == [FEATURE if i == patch else i for i in expected]
    assert model.feature_count(prompt.conditioning) == expected.count(patch) and len(mels) == 2
    assert prompt.conditioning["audio_mel_frames"].tolist() == [m.shape[1] for m in mels]


def test_bad_requests_are_refused_naming_the_field(model):
    def refused(match: str, field: str, *args, **kwargs) -> None:
        with pytest.raises(InvalidRequest, match=match) as e:
            model.prepare(*args, **kwargs)
        assert e.value.field == field, (e.value.field, field)

    refused("give text, audio or both", "text", None)
    refused("is empty", "audio", audio=b"")
    refused("not a readable audio file", "audio", audio=b"RIFF not really a wav")
    refused("limit is 60 s", "audio", audio=np.zeros(61 * 16000, np.float32), sample_rate=16000)
    refused("raw samples need a sample_rate", "audio", audio=np.zeros(1600, np.float32))
    user = {"role": "user", "text": "hi"}
    refused("history has 33 turns; the limit is 32", "history", "hello", history=[user] * 33)
    refused("role must be user or assistant", "history[0].role", "hello", history=[{"role": "robot", "text": "x"}])
    refused("an assistant turn is given by its text", "history[1].audio", "hello",
            history=[user, {"role": "assistant", "text": "hm", "audio": np.zeros(160, np.float32)}])
    refused("give history\\[0\\].text, history\\[0\\].audio or both", "history[0].text", "hello",
            history=[{"role": "user", "text": ""}])
    refused("unknown keys", "history[0]", "hello", history=[{"role": "user", "txt": "x"}])
    engine = Engine(model, EngineConfig(kv_pages=64, page_size=4))
    prompt = model.prepare("hello", audio=clip(0.5, 1), sample_rate=16000)
    prompt.conditioning["audio_mel_frames"] = prompt.conditioning["audio_mel_frames"] + 1
    with pytest.raises(InvalidRequest, match="AUDIO_MEL_FRAMES must give each piece's frames") as e:
        engine.submit(prompt)
    assert e.value.field == "audio_mel_frames"
    long = {"role": "user", "audio": np.zeros(50 * 16000, np.float32), "sample_rate": 16000}
    refused("audio is 200 s in all; the limit is 180 s", "history", "hello", history=[long] * 4)


def test_a_character_split_across_ids_waits_for_its_last_byte(model):
    """Byte-level ids: "é" is two of them; the first alone decodes to U+FFFD, which is not sent."""
    from voxbackend.engine.output import Output
    from voxbackend.request import Request

    events = []
    r = Request("r", [1], SamplingParams(), events.append, 0.0)
    output = Output(model, None, None, None, None, None, None, [])
    ids = model.template.text.encode("caf") + model.template.text.encode("é")
    assert len(model.template.text.encode("é")) == 2
    for i in ids:
        r.lm.text_ids.append(i)
        output._send_text(r, final=False)
    assert "".join(e.text for e in events) == "café" and len(events) == len(ids) - 1, [e.text for e in events]
    assert all("\ufffd" not in e.text for e in events)


def test_an_encoder_failure_ends_only_the_requests_it_held(model):
    engine = Engine(model, EngineConfig(kv_pages=64, page_size=4))
    finals = {}

    def broken(conds):
        raise RuntimeError("device lost")

    model.encode_features = broken
    try:
        with_audio = engine.submit(model.prepare("hi", audio=clip(0.4, 2), sample_rate=16000),
                                   SamplingParams(temperature=0, max_tokens=4), lambda e: e.final and finals.update(
                                       {e.request_id: e}), streaming=False)
        text_only = engine.submit(model.prepare("hello"), SamplingParams(temperature=0, max_tokens=4),
                                  lambda e: e.final and finals.update({e.request_id: e}), streaming=False)
        while len(finals) < 2:
            engine.step()
    finally:
        del model.encode_features
    assert finals[with_audio].kind is EventKind.ERROR and "device lost" in finals[with_audio].error
    assert finals[text_only].kind is EventKind.FINISHED and engine.alive and engine.pool.used_pages == 0


def test_the_spoken_reply_is_the_reference_token2wav_of_its_audio_ids(model):
    """The engine's audio chunks = DiTToken2Wav (parity-tested against upstream's Token2wav.stream in
    tests/test_step_audio2_token2wav.py) on the reply's audio ids, cut as a complete reply is, in the default voice
    and from the first window's seed. Text events come in order with them."""
    from voxbackend.components.flow_hift.dit_token2wav import VoicePrompt, split_chunks
    from voxbackend.engine.detokenize import window_seed
    from voxbackend.models.step_audio2.codec import load_voice

    engine = Engine(model, EngineConfig(kv_pages=256, page_size=4))
    sampling = SamplingParams(temperature=0, max_tokens=220, min_tokens=220, seed=5)
    events = []
    engine.submit(model.prepare("Good morning! What is this sound?", audio=clip(0.6, 3), sample_rate=16000),
                  sampling, events.append)
    while not events or not events[-1].final:
        engine.step()
    final = events[-1]
    assert final.kind is EventKind.FINISHED, final.error
    chunks = [e.audio for e in events if e.kind is EventKind.AUDIO]
    codes = [i - AUDIO_OFFSET for i in final.token_ids if i >= AUDIO_OFFSET]
    cuts = split_chunks(len(codes), model.codec.cfg)
    assert len(cuts) >= 2 and len(chunks) == len(cuts), (len(codes), len(chunks))
    voice = load_voice(model.model_dir, "default")
    prompt = VoicePrompt(torch.as_tensor(voice["prompt_speech_tokens"], dtype=torch.long),
                         torch.as_tensor(voice["prompt_feat"]), torch.as_tensor(voice["speaker_embedding"]))
    seed = window_seed(5, 0)
    state = model.codec.start(prompt, torch.Generator().manual_seed(seed), seed)
    expected = [model.codec.decode_chunk(state, codes[a:b], last_chunk=last).numpy() for a, b, last in cuts]
    for got, want in zip(chunks, expected):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    audio = np.concatenate(chunks)
    assert 0.01 < float(np.sqrt(np.mean(audio ** 2))) < 0.5, "the tiny voice is audible and not clipped"
    kinds = [e.kind for e in events]
    assert EventKind.TEXT in kinds and kinds.index(EventKind.TEXT) < kinds.index(EventKind.AUDIO)
    assert engine.pool.used_pages == 0


def test_the_preprocess_front_end_prepares_the_same_prompt_without_weights(checkpoint, model):
    from voxbackend.models import registry

    front = registry.load_frontend(checkpoint)
    assert type(front).__name__ == "StepAudio2Frontend" and not hasattr(front, "backbone")
    history = [{"role": "user", "audio": clip(0.5, 4), "sample_rate": 16000}, {"role": "assistant", "text": "Yes."}]
    a = front.prepare("And then?", "default", system=SYSTEM, history=history)
    b = model.prepare("And then?", "default", system=SYSTEM, history=history)
    assert a.ids == b.ids and a.conditioning.keys() == b.conditioning.keys()
    for key in a.conditioning:
        np.testing.assert_array_equal(a.conditioning[key], b.conditioning[key])
    assert front.spec == model.spec


def test_a_text_reply_has_no_voice_and_no_audio_and_an_unknown_voice_is_refused(model):
    engine = Engine(model, EngineConfig(kv_pages=64, page_size=4))
    events = []
    engine.submit(model.prepare("Tell me about the weather.", speak=False),
                  SamplingParams(temperature=0, max_tokens=30, min_tokens=30), events.append)
    while not events or not events[-1].final:
        engine.step()
    assert events[-1].kind is EventKind.FINISHED and not [e for e in events if e.kind is EventKind.AUDIO]
    assert [e for e in events if e.kind is EventKind.TEXT]
    with pytest.raises(InvalidRequest, match="unknown voice 'nobody'; choose one of default") as e:
        model.prepare("hello", "nobody")
    assert e.value.field == "voice"
