"""The sampler draws exactly what the full-sort sampler it replaced drew: same token for every row, seed and step.

`reference_sample` is that sampler, kept here verbatim as the specification. The fast path sorts values only
and looks the drawn value up; ties and NaN rows go back to a full sort. Logits below cover flat and peaked rows,
heavy ties, -inf, signed zeros, NaN, candidate id sets and every truncation parameter. The value sort has two
implementations (numpy's, where it has a SIMD sort; a radix sort of int32 order keys elsewhere): the
`value_sort` fixture runs each test under both, whatever this machine's CPU. The repetition penalty is checked
against transformers' own processor.
"""
import itertools

import pytest
import torch

import voxbackend.sampling as sampling
from voxbackend.sampling import SamplingBatch, apply_repetition_penalty, sample, uniform_from_seed
from voxbackend.sampling_params import SamplingParams


def reference_sample(logits: torch.Tensor, batch: SamplingBatch, token_ids: torch.Tensor | None = None) -> torch.Tensor:
    if batch.history is not None:
        logits = apply_repetition_penalty(logits, batch.history, batch.penalty, token_ids, batch.vocab_size)
    to_ids = (lambda idx: idx) if token_ids is None else (lambda idx: token_ids.gather(1, idx[:, None])[:, 0])
    greedy = to_ids(logits.argmax(dim=-1))
    if batch.all_greedy:
        return greedy
    temp = torch.where(batch.temperature > 0, batch.temperature, torch.ones_like(batch.temperature))
    sorted_logits, order = torch.sort(logits / temp[:, None], dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    drop = (batch.top_k[:, None] > 0) & (rank >= batch.top_k[:, None])
    cum_before = probs.cumsum(dim=-1) - probs
    drop |= cum_before >= batch.top_p[:, None]
    drop |= probs < batch.min_p[:, None] * probs[:, :1]
    drop[:, 0] = False
    probs = probs.masked_fill(drop, 0.0)
    cdf = probs.cumsum(dim=-1)
    u = uniform_from_seed(batch.seed, batch.step) * cdf[:, -1]
    pick = torch.searchsorted(cdf, u[:, None], right=True).clamp(max=probs.shape[-1] - 1)
    sampled = to_ids(order.gather(1, pick).squeeze(1))
    return torch.where(batch.temperature == 0, greedy, sampled)


VOCAB = 156940


@pytest.fixture(params=["numpy", "radix"])
def value_sort(request, monkeypatch):
    monkeypatch.setattr(sampling, "_NUMPY_SIMD_SORT", request.param == "numpy")
    return request.param


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
    if kind == "ties":  # few distinct values: every draw lands in a tie group
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
def test_same_tokens_as_the_full_sort_sampler(kind, c, value_sort):
    g = torch.Generator().manual_seed(hash((kind, c)) % 2**31)
    b = 12
    for trial in range(3):
        logits = _logits(g, kind, b, c)
        ids = _candidates(g, b, c) if trial % 2 else None
        params = _params(g, b, c)
        hist_pool = ids if ids is not None else torch.arange(c).expand(b, c)
        histories = [hist_pool[r, torch.randint(c, (int(torch.randint(0, 40, (1,), generator=g)),), generator=g)]
                     .tolist() for r in range(b)]
        for step in range(0, 40, 5):
            vocab = VOCAB if ids is not None else c
            batch = SamplingBatch.build(params, [step + r for r in range(b)], histories, vocab, "cpu")
            want = reference_sample(logits, batch, ids)
            got = sample(logits, batch, ids)
            assert torch.equal(got, want), (kind, c, trial, step, (got != want).nonzero()[:, 0].tolist())


@pytest.fixture
def full_sort_calls(monkeypatch) -> list[int]:
    """The row count of every call of the full-sort path."""
    calls: list[int] = []
    full_sort = sampling._draw_by_sort
    monkeypatch.setattr(sampling, "_draw_by_sort", lambda scaled, d: calls.append(len(scaled)) or full_sort(scaled, d))
    return calls


def test_ties_take_the_full_sort_and_others_do_not(full_sort_calls):
    calls = full_sort_calls
    params = [SamplingParams(temperature=1.0, seed=s).validated() for s in range(8)]
    batch = SamplingBatch.build(params, [0] * 8, [[]] * 8, 4097, "cpu")
    distinct = torch.randn(8, 4097, generator=torch.Generator().manual_seed(3))
    assert torch.equal(sample(distinct, batch), reference_sample(distinct, batch)) and calls == []
    tied = torch.zeros(8, 4097)  # every value is a tie: the sort's own order decides the token
    tied[:4, :2] = 1.0  # rows 0-3: two tied favourites
    assert torch.equal(sample(tied, batch), reference_sample(tied, batch)) and calls == [8]


def test_a_tie_beside_a_nan_row_still_takes_the_full_sort(full_sort_calls):
    """A NaN row matches its drawn value nowhere, so a tie elsewhere can leave one match per row on average:
    the batch-wide count must not clear the tie."""
    calls = full_sort_calls
    params = [SamplingParams(temperature=1.0, seed=s).validated() for s in range(4)]
    batch = SamplingBatch.build(params, [0] * 4, [[]] * 4, 50, "cpu")
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(4))
    logits[1] = float("nan")
    logits[2] = -float("inf")
    logits[2, :2] = 5.0  # two tied favourites, nothing else possible
    assert torch.equal(sample(logits, batch), reference_sample(logits, batch)) and calls == [2]


def test_nan_rows_match_the_reference(value_sort):
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(5))
    logits[1, 17] = float("nan")
    logits[3] = float("nan")
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s).validated() for s in range(4)]
    for step in range(10):
        batch = SamplingBatch.build(params, [step] * 4, [[]] * 4, 300, "cpu")
        assert torch.equal(sample(logits, batch), reference_sample(logits, batch))


def test_the_sort_path_equals_the_value_path(value_sort):
    """Other devices take the full sort (no host sync); on the CPU both give the same columns."""
    g = torch.Generator().manual_seed(9)
    for kind, b in itertools.product(["flat", "peaked", "ties", "mixed"], [1, 5, 32]):
        scaled = _logits(g, kind, b, 4097)
        d = sampling._Draw(torch.randint(0, 60, (b,), generator=g), torch.rand(b, generator=g).clamp(min=0.05),
                           torch.rand(b, generator=g) * 0.2, torch.rand(b, generator=g))
        assert torch.equal(sampling._draw_by_value(scaled, d), sampling._draw_by_sort(scaled, d)), (kind, b)


def test_both_value_sorts_give_torch_sorted_values(value_sort):
    g = torch.Generator().manual_seed(11)
    x = _logits(g, "mixed", 6, 500)
    x[0, :3] = torch.tensor([float("inf"), -0.0, 0.0])
    x[1] = -x[1]
    got = sampling._sorted_descending(x)
    want = torch.sort(x, dim=-1, descending=True).values
    assert torch.equal(got, want)  # -0.0 == 0.0: equal values wherever the signed zeros land
    nan_rows = x.clone()
    nan_rows[2, 7] = float("nan")
    nan_rows[3, 9] = -float("nan")  # sign bit set: the int32 keys put it at the other end
    ends = sampling._sorted_descending(nan_rows)[:, [0, -1]]
    assert ends.isnan().any(dim=-1).tolist() == [False, False, True, True, False, False]


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
