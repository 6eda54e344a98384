"""GLM-4-Voice in the engine (voxbackend/models/glm4_voice/model.py) on the tiny random checkpoint
(voxbackend/models/glm4_voice/tiny.py), against references composed from independent parts:

- the prompt: upstream web_demo.py's prompt string, tokenized the way its tokenizer call does it (`[gMASK]<sop>`, then
  the string split at the added tokens and each piece byte-level BPE'd), by the Hugging Face `tokenizers` BPE that
  transformers' TikTokenConverter builds from the same tokenizer.model;
- the speech ids: the speech tokenizer's (tests/test_glm4_voice_tokenizer.py holds it to its references);
- the LM: transformers' GlmForCausalLM with the same weights (GLM-4's q/k/v and gate/up split back out), generate,
  greedy.

Greedy reply ids equal the reference's, alone, batched with staggered arrivals and through preemptions.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from voxbackend import SamplingParams
from voxbackend.config import EngineConfig
from voxbackend.engine.engine import Engine
from voxbackend.errors import InvalidRequest
from voxbackend.events import EventKind
from voxbackend.models.base import FEATURE
from voxbackend.models.checkpoint import load_safetensors, read_config
from voxbackend.models.glm4_voice.chat import PATTERN, SPEECH_SYSTEM, TEXT_SYSTEM
from voxbackend.models.glm4_voice.model import GLM4Voice
from voxbackend.models.glm4_voice.tiny import write_tiny_glm4_voice
from tests.util_engine_drive import run_staggered

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 14
SYSTEM = "You are a helpful assistant."


def clip(seconds: float, seed: int) -> np.ndarray:
    t = np.arange(int(seconds * 16000)) / 16000
    noise = np.random.default_rng(seed).standard_normal(t.size)
    return (0.3 * np.sin(2 * np.pi * (170 + 30 * seed) * t) + 0.05 * noise).astype(np.float32)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_glm4_voice(tmp_path_factory.mktemp("glm4_voice"))


@pytest.fixture(scope="module")
def model(checkpoint):
    from voxbackend.models import registry

    assert registry.detect_kind(checkpoint).name == "glm4_voice"
    loaded = registry.load_model(checkpoint, None, "cpu", torch.float32)
    assert isinstance(loaded, GLM4Voice)
    return loaded


@pytest.fixture(scope="module")
def oracle_tokenizer(checkpoint):
    """transformers' conversion of tokenizer.model to a `tokenizers` BPE, with every added token of
    tokenizer_config.json (control and speech tokens) split out of the text as upstream's tokenizer does."""
    import json

    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    converter = TikTokenConverter(vocab_file=str(checkpoint / "tokenizer.model"))
    assert converter.pattern == PATTERN  # GLM-4's pre-tokenizer is the tiktoken default transformers assumes
    tok = converter.converted()
    added = json.loads((checkpoint / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    tok.add_special_tokens([AddedToken(entry["content"], special=True)
                            for _, entry in sorted(added.items(), key=lambda kv: int(kv[0]))])
    for i, entry in added.items():
        assert tok.token_to_id(entry["content"]) == int(i)
    return tok


def upstream_prompt(tok, turns: list[tuple[str, str]], system: str) -> list[int]:
    """web_demo.py's string for (role, user input or assistant text) turns, the last a user's -> its ids.
    A user's speech is given as upstream writes it: `<|begin_of_audio|><|audio_N|>...<|end_of_audio|>`."""
    text = f"<|system|>\n{system}"
    for role, content in turns:
        text += f"<|user|>\n{content}" if role == "user" else f"<|assistant|>streaming_transcription\n{content}"
    text += "<|assistant|>streaming_transcription\n"
    prefix = [tok.token_to_id("[gMASK]"), tok.token_to_id("<sop>")]  # the tokenizer call adds them
    return prefix + tok.encode(text, add_special_tokens=False).ids


def speech_string(tokens: list[int]) -> str:
    return "<|begin_of_audio|>" + "".join(f"<|audio_{t}|>" for t in tokens) + "<|end_of_audio|>"


def with_speech_ids(model, prompt) -> list[int]:
    """The prompt with its FEATURE rows replaced by the speech ids the engine's rows are the embeddings of."""
    cond = prompt.conditioning
    lengths = [int(n) for n in cond.get("audio_clip_samples", ())]
    clips = np.split(cond["audio_samples"], np.cumsum(lengths)[:-1]) if lengths else []
    speech = iter([t + model.template.audio_offset for c in model.speech_tokenizer.speech_tokens(clips) for t in c])
    ids = [next(speech) if i == FEATURE else i for i in prompt.ids]
    assert next(speech, None) is None
    return ids


def test_prompts_equal_upstreams_string_tokenized(model, oracle_tokenizer):
    question, earlier = clip(1.4, 1), clip(0.6, 2)
    q_ids, e_ids = model.speech_tokenizer.speech_tokens([question, earlier])
    cases = [
        (model.prepare("What's the weather like?"), [("user", "What's the weather like?")], TEXT_SYSTEM),
        (model.prepare(audio=question, sample_rate=16000), [("user", speech_string(q_ids))], SPEECH_SYSTEM),
        (model.prepare("And tomorrow?", system=SYSTEM,
                       history=[{"role": "user", "audio": earlier, "sample_rate": 16000},
                                {"role": "assistant", "text": "It is sunny."}]),
         [("user", speech_string(e_ids)), ("assistant", "It is sunny."), ("user", "And tomorrow?")], SYSTEM),
    ]
    for i, (prompt, turns, system) in enumerate(cases):
        assert with_speech_ids(model, prompt) == upstream_prompt(oracle_tokenizer, turns, system), f"case {i}"
    # text that spells a control token stays text (upstream's string would end the user's turn there)
    typed = model.prepare("Say <|user|> and <|audio_7|> aloud.").ids
    user_at = typed.index(model.template.roles["user"])
    assistant_at = len(typed) - 1 - typed[::-1].index(model.template.roles["assistant"])
    said = typed[user_at + 1:assistant_at]
    assert said == model.template.text.encode("\nSay <|user|> and <|audio_7|> aloud.")
    assert max(said) < model.template.text.first_added_id


def reference_lm(checkpoint):
    """GlmForCausalLM with the checkpoint's weights, GLM-4's fused q/k/v and gate/up split back out."""
    from transformers import GlmConfig, GlmForCausalLM

    c = read_config(checkpoint)
    head_dim, heads, groups = c["kv_channels"], c["num_attention_heads"], c["multi_query_group_num"]
    config = GlmConfig(vocab_size=c["padded_vocab_size"], hidden_size=c["hidden_size"],
                       intermediate_size=c["ffn_hidden_size"], num_hidden_layers=c["num_layers"],
                       num_attention_heads=heads, num_key_value_heads=groups, head_dim=head_dim,
                       rms_norm_eps=c["layernorm_epsilon"], max_position_embeddings=c["seq_length"],
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0 * c["rope_ratio"],
                                        "partial_rotary_factor": 0.5},
                       attention_bias=True, tie_word_embeddings=False, pad_token_id=0, eos_token_id=[])
    w = load_safetensors(checkpoint)
    sd = {"model.embed_tokens.weight": w["transformer.embedding.word_embeddings.weight"],
          "model.norm.weight": w["transformer.encoder.final_layernorm.weight"],
          "lm_head.weight": w["transformer.output_layer.weight"]}
    sizes = [heads * head_dim, groups * head_dim, groups * head_dim]
    for i in range(c["num_layers"]):
        a, b = f"model.layers.{i}.", f"transformer.encoder.layers.{i}."
        for param in ("weight", "bias"):
            for x, part in zip("qkv", w[f"{b}self_attention.query_key_value.{param}"].split(sizes)):
                sd[f"{a}self_attn.{x}_proj.{param}"] = part
        sd[a + "self_attn.o_proj.weight"] = w[b + "self_attention.dense.weight"]
        sd[a + "mlp.gate_up_proj.weight"] = w[b + "mlp.dense_h_to_4h.weight"]
        sd[a + "mlp.down_proj.weight"] = w[b + "mlp.dense_4h_to_h.weight"]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            sd[f"{a}{norm}.weight"] = w[f"{b}{norm}.weight"]
    lm = GlmForCausalLM(config).eval()
    lm.load_state_dict(sd, strict=True)
    return lm


def reference_reply(lm, ids: list[int]) -> list[int]:
    with torch.inference_mode():
        out = lm.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    return out[0, len(ids):].tolist()


# (text, audio seconds, system, history)
REQUESTS = [("Good morning! What is this sound?", 1.3, SYSTEM, None), (None, 0.7, None, None),
            ("Tell me about the weather.", None, None, [{"role": "user", "text": "Hi."},
                                                      {"role": "assistant", "text": "Hello!"}]),
            (None, 0.45, SYSTEM, [{"role": "user", "audio": clip(0.5, 9), "sample_rate": 16000}])]


def test_greedy_replies_equal_generate_alone_batched_and_through_preemptions(checkpoint, model):
    lm = reference_lm(checkpoint)
    prompts = [model.prepare(text, audio=clip(s, k) if s else None, sample_rate=16000, system=system, history=h)
               for k, (text, s, system, h) in enumerate(REQUESTS)]
    expected = [reference_reply(lm, with_speech_ids(model, p)) for p in prompts]
    greedy = SamplingParams(temperature=0, max_tokens=STEPS, min_tokens=STEPS)
    engine = Engine(model, EngineConfig(page_size=4, max_batch=4, kv_pages=256, prefill_budget=16))
    assert [engine.generate_ids([p], greedy)[0] for p in prompts] == expected
    texts: list[list[str]] = []  # each request's text pieces
    # each arrives while the earlier ones are decoding
    assert run_staggered(engine, prompts, greedy, every=2, texts=texts) == expected
    assert engine.pool.used_pages == 0
    pages = [-(-(len(p.ids) + STEPS) // 4) for p in prompts]
    small = Engine(model, EngineConfig(page_size=4, max_batch=4, kv_pages=max(pages) + 2, prefill_budget=16))
    assert sum(pages) > max(pages) + 2
    assert run_staggered(small, prompts, greedy, every=2) == expected
    assert small.preemptions > 0 and small.pool.used_pages == 0
    # the speech tokenizer ran once for the requests with clips that were admitted together
    calls = []
    encode = model.encode_features
    model.encode_features = lambda conds: calls.append(len(conds)) or encode(conds)
    try:
        assert engine.generate_ids(prompts, greedy) == expected
    finally:
        del model.encode_features
    assert calls == [3]
    # the reply's text: what the reference's text ids decode to, in pieces
    first_added = model.template.text.first_added_id
    for pieces, reply in zip(texts, expected):
        assert "".join(pieces) == model.template.text.decode([i for i in reply if i < first_added])
    offset = model.template.audio_offset
    assert any(i < first_added for r in expected for i in r) and any(i >= offset for r in expected for i in r), \
        "the tiny model says text and speech ids"


def test_bad_requests_are_refused_naming_the_field(model):
    cases = [
        (dict(), "text"),
        (dict(text="hi", voice="alloy"), "voice"),
        (dict(text="hi", history=[{"role": "user", "text": "a"}] * 33), "history"),
        (dict(text="hi", history=[{"role": "narrator", "text": "a"}]), "history[0].role"),
        (dict(text="hi", history=[{"role": "assistant", "text": "a", "audio": clip(0.2, 1)}]), "history[0].audio"),
        (dict(audio=clip(61, 1), sample_rate=16000), "audio"),
        (dict(audio=b"not audio"), "audio"),
        (dict(text="  "), "text"),
    ]
    for kwargs, field in cases:
        with pytest.raises(InvalidRequest) as e:
            model.prepare(kwargs.pop("text", None), **kwargs)
        assert e.value.field == field, (kwargs, e.value)


def test_the_spoken_reply_is_the_decoder_alone_on_its_speech_ids_and_a_text_reply_has_none(model):
    """The engine's audio = the speech decoder driven alone over the reply's speech ids, cut into upstream's
    blocks, its noise from the first window's seed; text comes before the first audio. SPEAK false: no audio."""
    from voxbackend.engine.detokenize import window_seed

    engine = Engine(model, EngineConfig(kv_pages=256, page_size=4))
    offset = model.template.audio_offset
    sampling = SamplingParams(temperature=0, max_tokens=160, min_tokens=160, seed=5)
    events = []
    engine.submit(model.prepare("Good morning!", audio=clip(0.6, 3), sample_rate=16000), sampling, events.append)
    quiet = []
    engine.submit(model.prepare("Good morning!", speak=False), sampling, quiet.append)
    while not (events and events[-1].final and quiet and quiet[-1].final):
        engine.step()
    final = events[-1]
    assert final.kind is EventKind.FINISHED, final.error
    codes = [i - offset for i in final.token_ids if offset <= i < offset + 16384]
    state = model.codec.new_state(window_seed(5, 0))
    state.push(codes)
    state.end()
    expected = []
    while (block := model.codec.next_block(state)) is not None:
        expected.append(model.codec.decode([state], [block])[0].numpy())
    assert len(expected) >= 2, len(codes)
    audio = np.concatenate([e.audio for e in events if e.kind is EventKind.AUDIO])
    np.testing.assert_allclose(audio, np.concatenate(expected), atol=1e-5, rtol=0)
    assert 0.01 < float(np.sqrt(np.mean(audio ** 2))) < 0.5, "the tiny decoder is audible and not clipped"
    kinds = [e.kind for e in events]
    assert EventKind.TEXT in kinds and kinds.index(EventKind.TEXT) < kinds.index(EventKind.AUDIO)
    assert quiet[-1].kind is EventKind.FINISHED and not [e for e in quiet if e.kind is EventKind.AUDIO]
    assert [e for e in quiet if e.kind is EventKind.TEXT]
    assert engine.pool.used_pages == 0
