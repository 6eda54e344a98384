"""Truncated sampling (top-k, top-p, min-p) by rejection, without a sort: the specification and its proofs.

`reference_row` is the specification, one row at a time in plain Python: a token survives when its probability
is at least the row's floor (its k-th largest, and min_p times the largest) and less than top_p of the whole
distribution is strictly more likely; a round draws by inverse CDF over the support in candidate order with the
round's own number; a draw that does not survive shrinks the support to the tokens strictly more likely than it.
Checked here: the batched sampler draws exactly the reference's tokens (flat and peaked rows, heavy ties, -inf,
signed zeros, candidate id sets, every parameter); the draws follow the truncated distribution; the survivors
are transformers' own (TopK / TopP / MinP warpers); tied tokens survive together; NaN rows end.
"""
import zlib

import pytest
import torch

from tests.util_sampling import inverse_cdf, uniform
from voxbackend.sampling import ROUND_SEED, SamplingBatch, apply_repetition_penalty, sample
from voxbackend.sampling_params import SamplingParams

VOCAB = 156940


def reference_row(logits: torch.Tensor, p: SamplingParams, step: int) -> int:
    """The column one row draws (its logits already penalized)."""
    if p.temperature == 0:
        return int(logits.argmax())
    probs = (logits / p.temperature).softmax(-1).tolist()
    floor = 0.0
    if 0 < p.top_k < len(probs):
        floor = sorted(probs, reverse=True)[p.top_k - 1]
    if p.min_p > 0:
        floor = max(floor, float(torch.tensor(p.min_p) * max(probs)))  # float32, as the sampler computes it

    def survives(j: int) -> bool:
        return probs[j] >= floor and (p.top_p >= 1 or sum(q for q in probs if q > probs[j]) < p.top_p)

    support = [q if q >= floor else 0.0 for q in probs]
    j = inverse_cdf(support, uniform(p.seed, step))
    rounds = 0
    while not survives(j):
        rounds += 1
        support = [q if q > probs[j] else 0.0 for q in support]
        j = inverse_cdf(support, uniform((p.seed + rounds * ROUND_SEED) & 0xFFFFFFFF, step))
    return j


def _params(g: torch.Generator, n: int, c: int) -> list[SamplingParams]:
    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    return [
        SamplingParams(
            temperature=pick([0.0, 0.3, 0.6, 1.0, 1.7]),
            top_k=pick([0, 0, 1, 5, 50, c, c + 3]),
            top_p=pick([1.0, 1.0, 0.8, 0.5, 0.95, 0.05]),
            min_p=pick([0.0, 0.0, 0.05, 0.3]),
            repetition_penalty=pick([1.0, 1.3, 0.7]),
            seed=int(torch.randint(2**31 - 1, (1,), generator=g)),
        ).validated()
        for _ in range(n)
    ]


def _logits(g: torch.Generator, kind: str, b: int, c: int) -> torch.Tensor:
    x = torch.randn(b, c, generator=g)
    if kind == "flat":
        return x * 0.5
    if kind == "peaked":
        return x * 8
    if kind == "ties":  # few distinct values: draws land in tie groups
        return torch.round(x * 2) / 2
    if kind == "mixed":  # some equal values, -inf entries, signed zeros
        x = torch.round(x * 16) / 16
        x[torch.rand(b, c, generator=g) < 0.1] = float("-inf")
        x[:, 0] = 0.0
        x[:, -1] = -0.0
        return x
    raise ValueError(kind)


def _candidates(g: torch.Generator, b: int, c: int) -> torch.Tensor:
    return torch.stack([torch.sort(torch.randperm(VOCAB, generator=g)[:c]).values for _ in range(b)])


@pytest.mark.parametrize("kind, c", [("flat", 4097), ("peaked", 4097), ("ties", 4097), ("mixed", 300),
                                     ("flat", 7), ("ties", 33), ("peaked", 300)])
def test_same_tokens_as_the_reference(kind, c):
    g = torch.Generator().manual_seed(zlib.crc32(f"{kind}-{c}".encode()))
    b = 12
    for trial in range(2):
        logits = _logits(g, kind, b, c)
        ids = _candidates(g, b, c) if trial % 2 else None
        params = _params(g, b, c)
        hist_pool = ids if ids is not None else torch.arange(c).expand(b, c)
        histories = [hist_pool[r, torch.randint(c, (int(torch.randint(0, 40, (1,), generator=g)),), generator=g)]
                     .tolist() for r in range(b)]
        for step in range(0, 30, 6):
            vocab = VOCAB if ids is not None else c
            batch = SamplingBatch.build(params, [step + r for r in range(b)], histories, vocab, "cpu")
            penalized = apply_repetition_penalty(logits, batch.history, batch.penalty, ids, vocab)
            got = sample(logits, batch, ids)
            for r in range(b):
                column = reference_row(penalized[r], params[r], step + r)
                want = column if ids is None else int(ids[r, column])
                assert int(got[r]) == want, (kind, c, trial, step, r, params[r])


def _truncated(probs: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """The truncated distribution by the definition, in float64 (distinct probabilities)."""
    keep = torch.ones_like(probs, dtype=torch.bool)
    if top_k:
        keep &= probs >= probs.sort(descending=True).values[top_k - 1]
    keep &= probs >= min_p * probs.max()
    if top_p < 1:
        keep &= torch.tensor([probs[probs > q].sum() < top_p for q in probs])
    return torch.where(keep, probs, 0) / probs[keep].sum()


@pytest.mark.parametrize("size, scale, params", [
    (8, 1.0, {"top_p": 0.8}), (8, 1.0, {"top_k": 3}), (8, 1.0, {"min_p": 0.2}),
    (8, 1.0, {"top_k": 5, "top_p": 0.6, "min_p": 0.05}), (8, 1.0, {}),
    (40, 0.5, {"top_p": 0.3}),  # flat and a small nucleus: most draws take several rounds
])
def test_draws_follow_the_truncated_distribution(size, scale, params):
    logits = torch.randn(1, size, generator=torch.Generator().manual_seed(size)) * scale
    n = 40000
    batch = SamplingBatch.build([SamplingParams(seed=s, **params).validated() for s in range(n)], [3] * n,
                                [[]] * n, size, "cpu")
    freq = torch.bincount(sample(logits.expand(n, -1), batch), minlength=size).double() / n
    want = _truncated(logits[0].double().softmax(-1), **params)
    tolerance = 5 * (want * (1 - want) / n).sqrt()
    assert ((freq - want).abs() <= tolerance).all(), (freq, want)
    assert (freq[want == 0] == 0).all()


def test_survivors_are_the_transformers_warpers_survivors():
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(21)) * 1.5
    n = 6000
    for params, warper in (({"top_k": 4}, TopKLogitsWarper(4)), ({"top_p": 0.7}, TopPLogitsWarper(0.7)),
                           ({"min_p": 0.1}, MinPLogitsWarper(0.1))):
        kept = set(torch.isfinite(warper(None, logits.clone()))[0].nonzero()[:, 0].tolist())
        batch = SamplingBatch.build([SamplingParams(seed=s, **params).validated() for s in range(n)], [0] * n,
                                    [[]] * n, 12, "cpu")
        drawn = set(sample(logits.expand(n, -1), batch).tolist())
        assert drawn == kept, (params, drawn, kept)


def test_tied_favourites_survive_together_and_nothing_else():
    logits = torch.zeros(1, 50)
    logits[0, :2] = 5.0
    n = 400
    for params in ({"top_k": 1}, {"top_p": 0.01}, {"min_p": 1.0}):
        batch = SamplingBatch.build([SamplingParams(seed=s, **params).validated() for s in range(n)], [0] * n,
                                    [[]] * n, 50, "cpu")
        assert set(sample(logits.expand(n, -1), batch).tolist()) == {0, 1}, params


def test_a_tiny_nucleus_on_a_flat_row_ends_on_the_favourite():
    """top_p below the largest probability keeps one token: many rounds of rejection, one answer."""
    logits = torch.randn(64, 4097, generator=torch.Generator().manual_seed(2)) * 0.3
    params = [SamplingParams(top_p=1e-4, seed=s).validated() for s in range(64)]
    batch = SamplingBatch.build(params, [9] * 64, [[]] * 64, 4097, "cpu")
    assert torch.equal(sample(logits, batch), logits.argmax(dim=-1))


def test_nan_rows_end_with_a_candidate_and_leave_the_others_alone():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(5))
    logits[1, 17] = float("nan")
    logits[3] = float("nan")
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=40, min_p=0.01, seed=s).validated()
              for s in range(4)]
    for step in range(10):
        got = sample(logits, SamplingBatch.build(params, [step] * 4, [[]] * 4, 300, "cpu"))
        assert ((got >= 0) & (got < 300)).all()
        for r in (0, 2):
            alone = sample(logits[r:r + 1], SamplingBatch.build([params[r]], [step], [[]], 300, "cpu"))
            assert got[r] == alone[0]


def test_penalty_equals_the_transformers_processor():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(12)
    b, c = 6, 1000
    logits = torch.randn(b, c, generator=g) * 3
    logits[:, :4] = torch.tensor([0.0, -0.0, float("-inf"), 5.0])
    penalties = [1.3, 0.7, 1.0, 2.5, 1.3, 1.1]
    histories = [torch.randint(c, (n,), generator=g).tolist() for n in (0, 1, 7, 40, 300, 40)]
    histories[3] += [0, 1, 2, 3, 3, 3]  # signed zeros, -inf, repeats
    params = [SamplingParams(temperature=1.0, repetition_penalty=p).validated() for p in penalties]
    batch = SamplingBatch.build(params, [0] * b, histories, c, "cpu")
    got = apply_repetition_penalty(logits, batch.history, batch.penalty, None, c)
    for r in range(b):
        want = logits[r:r + 1].clone()
        if histories[r]:
            want = RepetitionPenaltyLogitsProcessor(penalties[r])(torch.tensor([histories[r]]), want)
        assert torch.equal(got[r:r + 1], want), r
