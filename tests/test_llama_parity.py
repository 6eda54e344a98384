"""The paged Llama backbone equals transformers' LlamaForCausalLM (prefill, chunked prefill, decode)."""
import torch

import voxbackend
from voxbackend.attention.base import SeqSlice
from tests.util_llama import write_tiny_llama


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_paged_forward_matches_transformers(tmp_path):
    ref = write_tiny_llama(tmp_path, seed=1)
    engine = voxbackend.load(tmp_path, kv_pages=64, page_size=4)
    model, attn, pool = engine.model, engine.attention, engine.pool
    torch.manual_seed(0)
    prompts = [torch.randint(3, 512, (n,)).tolist() for n in (13, 5, 9)]
    pages = [pool.allocate(f"r{i}", 40) for i in range(3)]

    with torch.no_grad():
        # prefill all three in one flattened batch; sequence 0 in two chunks (8 then 5 tokens)
        ids, pos, seqs = [], [], []
        chunks = [(0, 0, 8), (1, 0, 5), (2, 0, 9)]
        for i, start, n in chunks:
            seqs.append(SeqSlice(len(ids), n, start, pages[i]))
            ids += prompts[i][start : start + n]
            pos += list(range(start, start + n))
        attn.plan(seqs)
        hidden = model.forward(torch.tensor(ids), torch.tensor(pos), attn)
        attn.plan([SeqSlice(0, 5, 8, pages[0])])
        h0 = model.forward(torch.tensor(prompts[0][8:]), torch.arange(8, 13), attn)
        got = {0: model.logits(h0)[-1], 1: model.logits(hidden[8 + 4]), 2: model.logits(hidden[-1])}
        for i in range(3):
            want = ref(torch.tensor([prompts[i]])).logits[0, -1]
            assert _rel_err(got[i], want) <= 1e-4

        # three decode steps for all three sequences together
        seqs_len = [13, 5, 9]
        for step in range(3):
            new = [int(torch.randint(3, 512, ()).item()) for _ in range(3)]
            attn.plan([SeqSlice(i, 1, seqs_len[i], pages[i]) for i in range(3)])
            logits = model.logits(model.forward(torch.tensor(new), torch.tensor(seqs_len), attn))
            for i in range(3):
                prompts[i].append(new[i])
                seqs_len[i] += 1
                want = ref(torch.tensor([prompts[i]])).logits[0, -1]
                assert _rel_err(logits[i], want) <= 1e-4, (step, i)


def test_llama3_rope_frequencies_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tests.util_llama import tiny_llama_config
    from voxbackend.models.decoder import DecoderConfig, rope_inv_freq

    cfg = tiny_llama_config()
    ours = rope_inv_freq(DecoderConfig.from_hf(cfg.to_dict()))
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    assert torch.allclose(ours, theirs, rtol=1e-6)
