"""One parity check for every paged backbone: prefill (one sequence in two chunks), then decode steps of all
sequences together, each compared with the reference model run on the whole sequence."""
from __future__ import annotations

import torch

from voxbackend.attention.base import SeqSlice


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def assert_paged_forward_matches(engine, ref, seed: int = 0, vocab: int = 512, tol: float = 1e-4) -> None:
    """`ref(ids [1, L]).logits` is the reference's; three prompts of 13, 5 and 9 tokens, three decode steps."""
    model, attn, pool = engine.model, engine.attention, engine.pool
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (13, 5, 9)]
    pages = [pool.allocate(f"parity{i}", 40) for i in range(3)]

    def want(i: int) -> torch.Tensor:
        return ref(torch.tensor([prompts[i]])).logits[0, -1]

    with torch.no_grad():
        # prefill all three in one flattened batch; sequence 0 in two chunks (8 then 5 tokens)
        ids, pos, seqs = [], [], []
        for i, n in ((0, 8), (1, 5), (2, 9)):
            seqs.append(SeqSlice(len(ids), n, 0, pages[i]))
            ids += prompts[i][:n]
            pos += list(range(n))
        attn.plan(seqs)
        hidden = model.forward(torch.tensor(ids), torch.tensor(pos), attn)
        attn.plan([SeqSlice(0, 5, 8, pages[0])])
        h0 = model.forward(torch.tensor(prompts[0][8:]), torch.arange(8, 13), attn)
        got = {0: model.logits(h0)[-1], 1: model.logits(hidden[8 + 4]), 2: model.logits(hidden[-1])}
        for i in range(3):
            assert rel_err(got[i], want(i)) <= tol, ("prefill", i)

        lengths = [13, 5, 9]
        for step in range(3):
            new = torch.randint(3, vocab, (3,), generator=g).tolist()
            attn.plan([SeqSlice(i, 1, lengths[i], pages[i]) for i in range(3)])
            logits = model.logits(model.forward(torch.tensor(new), torch.tensor(lengths), attn))
            for i in range(3):
                prompts[i].append(new[i])
                lengths[i] += 1
                assert rel_err(logits[i], want(i)) <= tol, ("decode", step, i)
    for i in range(3):
        pool.release(f"parity{i}")
