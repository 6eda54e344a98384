"""The Qwen3-TTS talker over the paged KV pool equals the reference talker (qwen-tts-hf): prefill, chunked
prefill and batched decode, on rows that mix text, codec specials and full 16-codebook frames."""
from __future__ import annotations

import json

import pytest
import torch

from tests.qwen_tts_ref import TALKER, write_tiny_qwen3_tts
from voxbackend.attention.base import SeqSlice
from voxbackend.attention.torch_backend import TorchPagedAttention
from voxbackend.engine.kv_pool import KVPool
from voxbackend.models.qwen3_tts.talker import Qwen3TTSTalker, talker_decoder_config

GROUPS = TALKER["num_code_groups"]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_tts")
    return path, write_tiny_qwen3_tts(path, seed=2)


def _reference_embeds(ref, rows: torch.Tensor) -> torch.Tensor:
    """What the reference generate() feeds its talker for such rows, from its own modules."""
    talker = ref.talker
    x = torch.zeros(len(rows), TALKER["hidden_size"])
    for t, row in enumerate(rows.tolist()):
        if row[0] >= 0:
            x[t] += talker.get_input_embeddings()(torch.tensor(row[0]))
        for j in range(1, GROUPS):
            if row[j] >= 0:
                x[t] += talker.code_predictor.get_input_embeddings()[j - 1](torch.tensor(row[j]))
        if row[-1] >= 0:
            x[t] += talker.text_projection(talker.get_text_embeddings()(torch.tensor([row[-1]])))[0]
    return x


def _reference_logits(ref, rows: torch.Tensor) -> torch.Tensor:
    hidden = ref.talker.model(inputs_embeds=_reference_embeds(ref, rows)[None], use_cache=False).last_hidden_state
    return ref.talker.codec_head(hidden)[0]


def _rows(g: torch.Generator, n: int) -> torch.Tensor:
    """A prompt-like mix: text-only rows, text + a codec special, and whole frames of 16 codes (+ text)."""
    rows = torch.full((n, GROUPS + 1), -1, dtype=torch.long)
    for t in range(n):
        kind = t % 3
        if kind in (0, 1):
            rows[t, -1] = torch.randint(0, TALKER["text_vocab_size"], (), generator=g)
        if kind == 1:
            rows[t, 0] = torch.randint(2048, TALKER["vocab_size"], (), generator=g)  # a special (pad, speaker...)
        if kind == 2:
            rows[t, :GROUPS] = torch.randint(0, 2048, (GROUPS,), generator=g)
    return rows


def _frame(g: torch.Generator, with_text: bool) -> torch.Tensor:
    row = torch.full((GROUPS + 1,), -1, dtype=torch.long)
    row[:GROUPS] = torch.randint(0, 2048, (GROUPS,), generator=g)
    if with_text:
        row[-1] = torch.randint(0, TALKER["text_vocab_size"], (), generator=g)
    return row


def test_talker_config_is_qwen3_with_1d_rope(tiny):
    path, _ = tiny
    cfg = talker_decoder_config(json.loads((path / "config.json").read_text())["talker_config"])
    assert (cfg.qk_norm, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling) == (True, 24, 1e6, {"rope_type": "default"})
    with pytest.raises(ValueError, match="mrope_section"):
        talker_decoder_config({**TALKER, "rope_scaling": {"mrope_section": [1, 1, 1], "rope_type": "default"}})


def test_paged_talker_matches_reference(tiny):
    path, ref = tiny
    talker = Qwen3TTSTalker(path)
    pool = KVPool(talker.cfg.geometry(), num_pages=48, page_size=4, device="cpu", dtype=torch.float32)
    attn = TorchPagedAttention(pool.cache, pool.page_size, pool.scratch_page, talker.cfg.head_dim ** -0.5)
    g = torch.Generator().manual_seed(0)
    prompts = [_rows(g, n) for n in (11, 4, 7)]
    pages = [pool.allocate(f"r{i}", 40) for i in range(3)]
    with torch.no_grad():
        # prefill all three in one flattened batch; sequence 0 in two chunks (6 then 5 rows)
        firsts = [6, 4, 7]
        seqs, start = [], 0
        for i, n in enumerate(firsts):
            seqs.append(SeqSlice(start, n, 0, pages[i]))
            start += n
        attn.plan(seqs)
        rows = torch.cat([p[:n] for p, n in zip(prompts, firsts)])
        positions = torch.cat([torch.arange(n) for n in firsts])
        hidden = talker.forward(rows, positions, attn)
        attn.plan([SeqSlice(0, 5, 6, pages[0])])
        h0 = talker.forward(prompts[0][6:], torch.arange(6, 11), attn)
        want = _reference_logits(ref, prompts[0])
        assert _rel_err(talker.logits(hidden[:6]), want[:6]) <= 1e-4  # every prefill position, not just the last
        assert _rel_err(talker.logits(h0), want[6:]) <= 1e-4
        assert _rel_err(talker.logits(hidden[6 + 3]), _reference_logits(ref, prompts[1])[-1]) <= 1e-4
        assert _rel_err(talker.logits(hidden[-1]), _reference_logits(ref, prompts[2])[-1]) <= 1e-4

        lengths = [11, 4, 7]  # three decode steps: each sequence's next frame (with or without a text id)
        for step in range(3):
            new = torch.stack([_frame(g, with_text=(i + step) % 2 == 0) for i in range(3)])
            attn.plan([SeqSlice(i, 1, lengths[i], pages[i]) for i in range(3)])
            logits = talker.logits(talker.forward(new, torch.tensor(lengths), attn))
            for i in range(3):
                prompts[i] = torch.cat([prompts[i], new[i : i + 1]])
                lengths[i] += 1
                assert _rel_err(logits[i], _reference_logits(ref, prompts[i])[-1]) <= 1e-4, (step, i)


def test_code_predictor_greedy_codes_equal_reference_generate(tiny):
    """Codebooks 1-15 for a batch of frames in one device loop equal the reference predictor's generate, row by
    row and batched, on talker hidden states of real prompts."""
    path, ref = tiny
    talker = Qwen3TTSTalker(path)
    pool = KVPool(talker.cfg.geometry(), num_pages=16, page_size=4, device="cpu", dtype=torch.float32)
    attn = TorchPagedAttention(pool.cache, pool.page_size, pool.scratch_page, talker.cfg.head_dim ** -0.5)
    g = torch.Generator().manual_seed(3)
    prompts = [_rows(g, n) for n in (5, 8, 3, 6)]
    seqs, start = [], 0
    for i, p in enumerate(prompts):
        seqs.append(SeqSlice(start, len(p), 0, pool.allocate(f"r{i}", len(p))))
        start += len(p)
    with torch.no_grad():
        attn.plan(seqs)
        hidden = talker.forward(torch.cat(prompts), torch.cat([torch.arange(len(p)) for p in prompts]), attn)
        last = hidden[torch.tensor([s.q_start + s.q_len - 1 for s in seqs])]
        first = talker.logits(last)[:, :2048].argmax(-1)  # codebook 0: a code, not a special
        seen = []

        def greedy(logits, k):
            seen.append(k)
            return logits.argmax(-1)

        codes = talker.predict_codes(last, first, greedy)
        assert codes.shape == (4, GROUPS) and torch.equal(codes[:, 0], first) and seen == list(range(1, GROUPS))
        embeds = torch.stack([last, ref.talker.get_input_embeddings()(first)], dim=1)
        want = ref.talker.code_predictor.generate(inputs_embeds=embeds, max_new_tokens=GROUPS - 1, do_sample=False,
                                                  top_k=None, top_p=None, temperature=None)
        assert torch.equal(codes[:, 1:], want[:, -(GROUPS - 1):])
        for i in range(4):  # and one row alone: batching does not change a row
            alone = talker.predict_codes(last[i : i + 1], first[i : i + 1], lambda logits, k: logits.argmax(-1))
            assert torch.equal(alone[0], codes[i])
