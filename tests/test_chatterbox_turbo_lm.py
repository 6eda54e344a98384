"""Chatterbox-Turbo's LM on the paged decoder equals upstream T3 (chatterbox-tts 0.1.7) built as tts_turbo.from_local
builds it, on a tiny GPT-2 backbone with random weights: the prompt rows, the speech logits (prefill and decode)
and the greedy tokens of `inference_turbo` with its repetition penalty."""
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.chatterbox_oracle import load_t3
from tests.util_paged import rel_err
from voxbackend.attention.base import SeqSlice
from voxbackend.attention.torch_backend import TorchPagedAttention
from voxbackend.engine.kv_pool import KVPool
from voxbackend.models.chatterbox.turbo_lm import COND_PROMPT_LEN, START_SPEECH, STOP_SPEECH, WEIGHTS_FILE, TurboLM

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = "GPT2_tiny_test"
TINY_GPT2 = {"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "layer_norm_epsilon": 1e-5,
             "model_type": "gpt2", "n_ctx": 512, "n_embd": 64, "hidden_size": 64, "n_head": 4, "n_layer": 2,
             "n_positions": 512, "vocab_size": 50276, "bos_token_id": 50256, "eos_token_id": 50256}
PAGE = 16
PENALTY = 1.2
MAX_GEN_LEN = 30


def turbo_hp(T3Config):
    """tts_turbo.ChatterboxTurboTTS.from_local's hyperparameters, on the tiny backbone."""
    hp = T3Config(text_tokens_dict_size=50276)
    hp.llama_config_name = TINY
    hp.speech_tokens_dict_size = 6563
    hp.input_pos_emb = None
    hp.speech_cond_prompt_len = COND_PROMPT_LEN
    hp.use_perceiver_resampler = False
    hp.emotion_adv = False
    return hp


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter redrawn (LayerNorms and biases too), matrices large enough that greedy meets no near-tie."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name and name.endswith("weight"):
                p.copy_(torch.rand(p.shape, generator=g) * 0.5 + 0.75)
            elif p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 1.5 * min(p.shape) ** -0.5)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    oracle = load_t3()
    oracle.LLAMA_CONFIGS[TINY] = TINY_GPT2
    try:
        torch.manual_seed(0)
        t3 = oracle.T3(turbo_hp(oracle.T3Config)).eval()
        assert t3.is_gpt
    finally:
        del oracle.LLAMA_CONFIGS[TINY]
    randomize(t3, seed=1)
    path = tmp_path_factory.mktemp("turbo") / WEIGHTS_FILE
    save_file({k: v.contiguous() for k, v in t3.state_dict().items()}, path)
    ours = TurboLM.build(load_file(path), TINY_GPT2)
    return oracle, t3, ours


def voice(seed: int, n_cond: int, n_text: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(256, generator=g), torch.randint(0, START_SPEECH, (n_cond,), generator=g),
            torch.randint(0, 50276, (n_text,), generator=g))


def upstream_embeds(oracle, t3, speaker, cond, text, speech) -> torch.Tensor:
    cond_ = oracle.T3Cond(speaker_emb=speaker[None], cond_prompt_speech_tokens=cond[None])
    embeds, _ = t3.prepare_input_embeds(t3_cond=cond_, text_tokens=text[None], speech_tokens=speech[None])
    return embeds


def paged(ours: TurboLM, pages: int):
    pool = KVPool(ours.cfg.geometry(), num_pages=pages, page_size=PAGE, device="cpu", dtype=torch.float32)
    return pool, TorchPagedAttention(pool.cache, PAGE, pool.scratch_page, ours.cfg.head_dim**-0.5)


def test_prompt_rows_and_logits_match_upstream(models):
    """Two prompts in one flattened prefill (every position's logits), then three decode steps of both."""
    oracle, t3, ours = models
    voices = [voice(1, COND_PROMPT_LEN, 23), voice(2, 60, 9)]
    pool, attn = paged(ours, 64)
    errors = []
    with torch.no_grad():
        rows = [ours.prompt_embeds(*v) for v in voices]
        for r, (speaker, cond, text) in zip(rows, voices):
            assert r.shape == (1 + len(cond) + len(text) + 1, 64)
            want = upstream_embeds(oracle, t3, speaker, cond, text, torch.tensor([START_SPEECH]))[0]
            assert torch.equal(r[1:], want[1:])  # embedding rows: the same table lookups
            assert rel_err(r[:1], want[:1]) <= 1e-6  # the speaker projection: a matmul, rounding apart
        pages = [pool.allocate(f"s{i}", len(r) + 3) for i, r in enumerate(rows)]
        attn.plan([SeqSlice(0, len(rows[0]), 0, pages[0]), SeqSlice(len(rows[0]), len(rows[1]), 0, pages[1])])
        hidden = ours.forward_embeds(torch.cat(rows), torch.cat([torch.arange(len(r)) for r in rows]), attn)
        got = ours.speech_logits(hidden).split([len(r) for r in rows])
        for r, logits in zip(rows, got):
            errors.append(rel_err(logits, t3.speech_head(t3.tfmr(inputs_embeds=r[None]).last_hidden_state[0])))

        g = torch.Generator().manual_seed(3)
        lengths = [len(r) for r in rows]
        for _ in range(3):
            new = torch.randint(0, 6563, (2,), generator=g)
            attn.plan([SeqSlice(i, 1, lengths[i], pages[i]) for i in range(2)])
            logits = ours.speech_logits(ours.forward_embeds(ours.embed_speech(new), torch.tensor(lengths), attn))
            for i in range(2):
                rows[i] = torch.cat([rows[i], t3.speech_emb(new[i:i + 1])])
                lengths[i] += 1
                want = t3.speech_head(t3.tfmr(inputs_embeds=rows[i][None]).last_hidden_state[0, -1])
                errors.append(rel_err(logits[i], want))
    assert max(errors) <= 1e-4, errors


def penalize(logits: torch.Tensor, history: list[int]) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor: each seen id's logit divided by the penalty if positive,
    multiplied if negative (once, however often it was seen)."""
    ids = torch.tensor(sorted(set(history)))
    seen = logits[ids]
    return logits.index_copy(0, ids, torch.where(seen < 0, seen * PENALTY, seen / PENALTY))


def our_greedy(ours: TurboLM, speaker, cond, text) -> list[int]:
    """upstream inference_turbo's loop, greedy: the first step's history is the start token, later steps' the
    generated tokens; at most MAX_GEN_LEN + 1 tokens, a stop token ends it and is dropped."""
    rows = ours.prompt_embeds(speaker, cond, text)
    pool, attn = paged(ours, -(-(len(rows) + MAX_GEN_LEN + 1) // PAGE))
    pages = pool.allocate("r", len(rows) + MAX_GEN_LEN + 1)
    attn.plan([SeqSlice(0, len(rows), 0, pages)])
    hidden = ours.forward_embeds(rows, torch.arange(len(rows)), attn)[-1:]
    tokens: list[int] = []
    for _ in range(MAX_GEN_LEN + 1):
        logits = ours.speech_logits(hidden)[0]
        token = int(penalize(logits, tokens or [START_SPEECH]).argmax())
        tokens.append(token)
        if token == STOP_SPEECH:
            return tokens[:-1]
        position = len(rows) + len(tokens) - 1
        attn.plan([SeqSlice(0, 1, position, pages)])
        hidden = ours.forward_embeds(ours.embed_speech(torch.tensor([token])), torch.tensor([position]), attn)
    return tokens


@pytest.mark.parametrize("seed, n_cond, n_text", [(11, COND_PROMPT_LEN, 17), (12, 200, 31), (13, 48, 6)])
def test_greedy_tokens_equal_inference_turbo(models, monkeypatch, seed, n_cond, n_text):
    """Upstream sampling made greedy: multinomial -> argmax. top_k 0 / top_p 1 switch those warpers off: upstream
    applies the penalty after them, so a top-p set of one token could keep a penalized token that plain argmax
    would pass over; temperature (a positive scale before the sign-keeping penalty) cannot move the argmax."""
    oracle, t3, ours = models
    speaker, cond, text = voice(seed, n_cond, n_text)
    with torch.no_grad():
        got = our_greedy(ours, speaker, cond, text)
    monkeypatch.setattr(torch, "multinomial", lambda probs, num_samples=1: probs.argmax(-1, keepdim=True))
    cond_ = oracle.T3Cond(speaker_emb=speaker[None], cond_prompt_speech_tokens=cond[None])
    want = t3.inference_turbo(cond_, text[None], temperature=0.8, top_k=0, top_p=1.0, repetition_penalty=PENALTY,
                              max_gen_len=MAX_GEN_LEN)[0].tolist()
    assert got == want
    assert len(set(got)) > 5  # the penalty at work on a model that does not just repeat one token
