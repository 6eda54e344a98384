"""Chatterbox's original T3 LM on the paged decoder equals upstream T3 (chatterbox-tts 0.1.7) on the tiny Llama
checkpoint of voxbackend.models.chatterbox.tiny_t3: the prompt rows with classifier-free guidance, the speech logits
of both guidance rows (prefill and decode) and the greedy guided tokens of `T3.inference`.

Upstream's Perceiver hard-codes width 1024: the oracle is built with `cond_enc.Perceiver` patched to a
functools.partial of it at the tiny width (pre_attention_query_size = embedding_dim = 64; 32 queries, 4 heads
kept), restored after the build."""
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.chatterbox_oracle import upstream_t3
from tests.util_paged import rel_err
from voxbackend.attention.base import SeqSlice
from voxbackend.attention.torch_backend import TorchPagedAttention
from voxbackend.engine.kv_pool import KVPool
from voxbackend.models.chatterbox.t3_lm import (COND_PROMPT_LEN, COND_ROWS, SPEECH_VOCAB, START_SPEECH, STOP_SPEECH,
                                                TEXT_VOCAB, WEIGHTS_FILE, T3LM)
from voxbackend.models.chatterbox.tiny_t3 import tiny_t3

pytestmark = pytest.mark.usefixtures("one_thread")

PAGE = 16
CFG_WEIGHT = 0.5
PENALTY = 1.2
MAX_NEW = 40
START_TEXT, STOP_TEXT = 255, 0


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    llama, weights = tiny_t3(seed=0)
    oracle, t3 = upstream_t3(llama, weights)
    path = tmp_path_factory.mktemp("t3") / WEIGHTS_FILE
    save_file(weights, path)
    ours = T3LM.build(load_file(path), llama)
    return oracle, t3, ours


def voice(seed: int, n_cond: int, n_text: int, exaggeration: float):
    """speaker embedding, conditioning speech tokens, text ids framed by upstream's start/stop text tokens."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(1, TEXT_VOCAB, (n_text,), generator=g)
    text = torch.cat([torch.tensor([START_TEXT]), text[text != START_TEXT], torch.tensor([STOP_TEXT])])
    return (torch.randn(256, generator=g), torch.randint(0, START_SPEECH, (n_cond,), generator=g), text,
            exaggeration)


def upstream_cond(oracle, speaker, cond, exaggeration):
    """A fresh T3Cond per call: upstream caches the prompt embedding in it."""
    return oracle.T3Cond(speaker_emb=speaker[None], cond_prompt_speech_tokens=cond[None],
                         emotion_adv=exaggeration * torch.ones(1, 1, 1))


def upstream_prompt(oracle, t3, speaker, cond, text, exaggeration) -> torch.Tensor:
    """[2, 34 + M + 2, hidden]: inference's inputs_embeds (prepare_input_embeds with CFG, then the bos row)."""
    texts = torch.stack([text, text])
    embeds, len_cond = t3.prepare_input_embeds(
        t3_cond=upstream_cond(oracle, speaker, cond, exaggeration), text_tokens=texts,
        speech_tokens=torch.full((2, 1), START_SPEECH), cfg_weight=CFG_WEIGHT)
    assert len_cond == COND_ROWS
    bos = t3.speech_emb(torch.tensor([[START_SPEECH]])) + t3.speech_pos_emb.get_fixed_embedding(0)
    return torch.cat([embeds, torch.cat([bos, bos])], dim=1)


def our_prompts(ours: T3LM, speaker, cond, text, exaggeration) -> list[torch.Tensor]:
    """[conditioned, unconditioned] prompt rows."""
    rows = ours.cond_embeds(speaker, cond, exaggeration)
    return [ours.prompt_embeds(rows, text, blank) for blank in (False, True)]


def paged(ours: T3LM, pages: int):
    pool = KVPool(ours.cfg.geometry(), num_pages=pages, page_size=PAGE, device="cpu", dtype=torch.float32)
    return pool, TorchPagedAttention(pool.cache, PAGE, pool.scratch_page, ours.cfg.head_dim**-0.5)


def upstream_logits(oracle, t3, embeds: torch.Tensor) -> torch.Tensor:
    """T3HuggingfaceBackend, as inference builds it: speech_head of the backbone's last hidden_states entry."""
    backend = oracle.t3.T3HuggingfaceBackend(config=t3.cfg, llama=t3.tfmr, speech_enc=t3.speech_emb,
                                             speech_head=t3.speech_head)
    return backend(inputs_embeds=embeds, output_hidden_states=True, return_dict=True).logits


VOICES = [voice(1, COND_PROMPT_LEN, 23, 0.5), voice(2, 37, 9, 1.3)]


def test_prompt_rows_match_upstream(models):
    oracle, t3, ours = models
    with torch.no_grad():
        for v in VOICES:
            want = upstream_prompt(oracle, t3, *v)
            got = torch.stack(our_prompts(ours, *v))
            assert got.shape == want.shape == (2, COND_ROWS + len(v[2]) + 2, 64)
            assert rel_err(got, want) <= 1e-5
            assert torch.equal(got[:, COND_ROWS:], want[:, COND_ROWS:])  # text/speech rows: the same lookups
    assert ours.max_text_index == 2049 and ours.max_speech_index == 4099


def test_guided_logits_match_upstream(models):
    """Two requests (cond + uncond each: four sequences) in one flattened prefill, then three decode steps."""
    oracle, t3, ours = models
    rows = [r for v in VOICES for r in our_prompts(ours, *v)]
    refs = [upstream_prompt(oracle, t3, *v) for v in VOICES]  # [2, L, hidden] each
    pool, attn = paged(ours, 64)
    errors = []
    with torch.no_grad():
        pages = [pool.allocate(f"s{i}", len(r) + 3) for i, r in enumerate(rows)]
        starts = torch.tensor([0] + [len(r) for r in rows]).cumsum(0).tolist()
        attn.plan([SeqSlice(starts[i], len(r), 0, pages[i]) for i, r in enumerate(rows)])
        hidden = ours.forward_embeds(torch.cat(rows), torch.cat([torch.arange(len(r)) for r in rows]), attn)
        got = ours.speech_logits(hidden).split([len(r) for r in rows])
        for j, ref in enumerate(refs):
            want = upstream_logits(oracle, t3, ref)
            errors += [rel_err(got[2 * j], want[0]), rel_err(got[2 * j + 1], want[1])]
        assert got[0].shape[-1] == SPEECH_VOCAB

        g = torch.Generator().manual_seed(3)
        lengths = [len(r) for r in rows]
        for k in range(1, 4):  # the k-th generated token at speech index k, the same in both rows of a request
            new = torch.randint(0, SPEECH_VOCAB, (2,), generator=g).repeat_interleave(2)
            attn.plan([SeqSlice(i, 1, lengths[i], pages[i]) for i in range(4)])
            x = ours.embed_speech(new, torch.full((4,), k))
            logits = ours.speech_logits(ours.forward_embeds(x, torch.tensor(lengths), attn))
            lengths = [n + 1 for n in lengths]
            for j in range(2):
                row = t3.speech_emb(new[2 * j].view(1, 1)) + t3.speech_pos_emb.get_fixed_embedding(k)
                refs[j] = torch.cat([refs[j], torch.cat([row, row])], dim=1)
                want = upstream_logits(oracle, t3, refs[j])[:, -1]
                errors += [rel_err(logits[2 * j], want[0]), rel_err(logits[2 * j + 1], want[1])]
    assert max(errors) <= 1e-4, errors


def penalize(logits: torch.Tensor, history: list[int]) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor: each seen id's logit divided by the penalty if positive,
    multiplied if negative (once, however often it was seen)."""
    ids = torch.tensor(sorted(set(history)))
    seen = logits[ids]
    return logits.index_copy(0, ids, torch.where(seen < 0, seen * PENALTY, seen / PENALTY))


def our_greedy(ours: T3LM, speaker, cond, text, exaggeration) -> list[int]:
    """upstream inference's loop, greedy: guided logits, then the penalty over [start] + generated, argmax; the
    stop token ends it and is kept (upstream returns it)."""
    rows = our_prompts(ours, speaker, cond, text, exaggeration)
    n = len(rows[0])
    pool, attn = paged(ours, 2 * -(-(n + MAX_NEW) // PAGE))
    pages = [pool.allocate(f"r{i}", n + MAX_NEW) for i in range(2)]
    attn.plan([SeqSlice(0, n, 0, pages[0]), SeqSlice(n, n, 0, pages[1])])
    hidden = ours.forward_embeds(torch.cat(rows), torch.arange(n).repeat(2), attn)[[n - 1, 2 * n - 1]]
    tokens: list[int] = []
    for k in range(1, MAX_NEW + 1):
        cond_logits, uncond_logits = ours.speech_logits(hidden)
        guided = cond_logits + CFG_WEIGHT * (cond_logits - uncond_logits)
        token = int(penalize(guided, [START_SPEECH] + tokens).argmax())
        tokens.append(token)
        if token == STOP_SPEECH:
            break
        position = n + k - 1
        attn.plan([SeqSlice(i, 1, position, pages[i]) for i in range(2)])
        x = ours.embed_speech(torch.tensor([token, token]), torch.tensor([k, k]))
        hidden = ours.forward_embeds(x, torch.tensor([position, position]), attn)
    return tokens


@pytest.mark.parametrize("seed, n_cond, n_text, exaggeration, stops",
                         [(11, COND_PROMPT_LEN, 17, 0.5, False), (12, 60, 31, 0.9, False), (15, 30, 20, 0.4, True)])
def test_greedy_guided_tokens_equal_inference(models, monkeypatch, seed, n_cond, n_text, exaggeration, stops):
    """Upstream sampling made greedy: multinomial -> argmax. Upstream's order is guidance, repetition penalty,
    temperature, min_p, top_p: a positive temperature keeps the argmax, and min_p and top_p always keep the top
    token, so none of them can move it."""
    oracle, t3, ours = models
    v = voice(seed, n_cond, n_text, exaggeration)
    with torch.no_grad():
        got = our_greedy(ours, *v)
    monkeypatch.setattr(torch, "multinomial", lambda probs, num_samples=1: probs.argmax(-1, keepdim=True))
    speaker, cond, text, _ = v
    want = t3.inference(t3_cond=upstream_cond(oracle, speaker, cond, exaggeration),
                        text_tokens=torch.stack([text, text]), max_new_tokens=MAX_NEW, cfg_weight=CFG_WEIGHT,
                        temperature=0.8, top_p=0.95, min_p=0.05, repetition_penalty=PENALTY)[0].tolist()
    assert got == want
    assert len(set(got)) > 5  # a model that neither stops at once nor repeats one token
    assert got[-1] == STOP_SPEECH if stops else (len(got) == MAX_NEW and STOP_SPEECH not in got)
