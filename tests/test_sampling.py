"""Per-row sampling: each row's result depends only on its own logits, parameters, seed and step."""
import pytest
import torch

from voxbackend.errors import InvalidRequest
from voxbackend.sampling import SamplingBatch, sample, uniform_from_seed
from voxbackend.sampling_params import SamplingParams

V = 300


def _batch(params, steps, histories):
    return SamplingBatch.build([p.validated() for p in params], steps, histories, V, "cpu")


def test_rows_sample_as_if_alone():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=g) * 3
    params = [
        SamplingParams(temperature=0.7, top_p=0.9, seed=11),
        SamplingParams(temperature=1.3, top_k=20, seed=12, repetition_penalty=1.5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, min_p=0.05, seed=13),
    ]
    histories = [[1, 2, 3], [int(logits[1].argmax()), 7], [4], [5, 6]]
    for step in range(20):
        together = sample(logits, _batch(params, [step] * 4, histories))
        for i in range(4):
            alone = sample(logits[i : i + 1], _batch([params[i]], [step], [histories[i]]))
            assert together[i] == alone[0], (step, i)


def test_repetition_penalty_does_not_leak_between_rows():
    logits = torch.zeros(2, V)
    logits[:, 10] = 5.0
    logits[:, 11] = 4.0
    params = [SamplingParams(temperature=0.0, repetition_penalty=10.0), SamplingParams(temperature=0.0)]
    out = sample(logits, _batch(params, [0, 0], [[10], [10]]))
    assert out.tolist() == [11, 10]  # row 0 is penalized away from 10; row 1 (penalty 1) is not


def test_top_k_top_p_min_p_restrict_the_choice():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (V - 4)]))
    seen = {
        name: {int(sample(logits, _batch([p], [s], [[]]))[0]) for s in range(300)}
        for name, p in {
            "top_k": SamplingParams(top_k=2, seed=1),
            "top_p": SamplingParams(top_p=0.7, seed=1),
            "min_p": SamplingParams(min_p=0.2, seed=1),
        }.items()
    }
    assert seen == {"top_k": {0, 1}, "top_p": {0, 1}, "min_p": {0, 1, 2}}


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1] + [0.0] * (V - 3))
    logits = torch.log(probs.clamp(min=1e-12))[None]
    draws = torch.tensor([int(sample(logits, _batch([SamplingParams(seed=5)], [s], [[]]))[0]) for s in range(3000)])
    freq = torch.bincount(draws, minlength=3)[:3].float() / 3000
    assert torch.allclose(freq, probs[:3], atol=0.04)


def test_candidate_ids_map_back_to_vocab():
    logits = torch.tensor([[0.0, 9.0, 1.0]])
    ids = torch.tensor([[100, 200, 250]])  # ascending, as models return them
    batch = _batch([SamplingParams(temperature=0.0, repetition_penalty=2.0)], [0], [[7]])
    assert sample(logits, batch, ids).tolist() == [200]


def test_uniform_is_in_range_and_seed_dependent():
    u = uniform_from_seed(torch.arange(1000), torch.zeros(1000, dtype=torch.long))
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.05
    assert uniform_from_seed(torch.tensor([3]), torch.tensor([4])) != uniform_from_seed(torch.tensor([4]), torch.tensor([4]))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_k": 1.5}, "top_k"),
        ({"seed": -3}, "seed"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": float("-inf")}, "top_p"),
        ({"min_p": float("inf")}, "min_p"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"max_tokens": float("inf")}, "max_tokens"),
        ({"seed": float("inf")}, "seed"),
        ({"max_tokens": True}, "max_tokens"),
    ],
)
def test_bad_sampling_values_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequest, match=field) as e:
        SamplingParams(**kwargs).validated()
    assert e.value.field == field


def test_penalty_over_candidates_equals_penalty_over_the_vocab():
    g = torch.Generator().manual_seed(1)
    full = torch.randn(3, V, generator=g)
    ids = torch.stack([torch.sort(torch.randperm(V, generator=g)[:40]).values for _ in range(3)])
    history = [[int(ids[0, 3]), int(ids[0, 3]), 5], [int(ids[1, 0]), int(ids[1, 39])], [7]]
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.7) for _ in range(3)]
    batch = _batch(params, [0] * 3, history)
    from voxbackend.sampling import apply_repetition_penalty

    over_vocab = apply_repetition_penalty(full, batch.history, batch.penalty, None, V).gather(1, ids)
    over_candidates = apply_repetition_penalty(full.gather(1, ids), batch.history, batch.penalty, ids, V)
    assert torch.equal(over_vocab, over_candidates)


@pytest.mark.parametrize("columns", [1, 3])
def test_penalty_history_grows_as_the_lists_it_replaces(columns):
    """The runner's incremental history equals the prompt + output lists it used to rebuild every step: one
    column kept whole (negative markers included, the penalty skips them), other columns without absent (-1)
    entries, across calls that add one step, several steps, or none, and through its buffer growing."""
    import random

    import numpy as np

    from voxbackend.engine.model_runner import PenaltyHistory

    rng = random.Random(columns)
    row = (lambda: rng.randrange(-1, 50)) if columns == 1 else (lambda: [rng.randrange(-1, 50) for _ in range(columns)])
    prompt = [row() for _ in range(5)]
    output: list = []
    history = PenaltyHistory(prompt, columns)
    for call in range(60):
        output.extend(row() for _ in range(rng.choice([0, 1, 1, 7])))
        for c in range(columns):
            want = prompt + output if columns == 1 else [r[c] for r in prompt + output if r[c] >= 0]
            assert history.ids(c, output).tolist() == want, (call, c)
    assert len(output) > 128  # grown past the first buffer
    assert PenaltyHistory([], columns).ids(0, []).dtype == np.int64
