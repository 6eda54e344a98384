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
    assert (uniform_from_seed(torch.tensor([3]), torch.tensor([4]))
            != uniform_from_seed(torch.tensor([4]), torch.tensor([4])))


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


@pytest.mark.parametrize("columns,on_prompt", [(1, True), (3, True), (3, False)])
def test_penalty_table_holds_what_the_lists_hold(columns, on_prompt):
    """The runner's device table of penalized ids gives, for every request of a step, its prompt (when the spec
    penalizes prompts) + generated steps, -1 padded (negative markers kept: the penalty skips them), while
    requests come and go (slots reused), steps are appended on the device, and some steps are taken without
    the table (a batch without a penalty) and written from the host later."""
    import random
    from types import SimpleNamespace

    from voxbackend.engine.penalties import PenaltyTable
    from voxbackend.request import Request

    rng = random.Random(columns)
    row = (lambda: rng.randrange(-3, 50)) if columns == 1 else (lambda: [rng.randrange(-3, 50) for _ in range(columns)])
    table = PenaltyTable(SimpleNamespace(token_columns=columns, penalty_columns=None, penalty_on_prompt=on_prompt),
                         "cpu")
    live: list[Request] = []
    born = 0
    for step in range(150):
        if len(live) < 6 or rng.random() < 0.1:
            live.append(Request(f"r{born}", [row() for _ in range(rng.randrange(1, 9))], SamplingParams(), print, 0.0))
            born += 1
        batch = rng.sample(live, rng.randrange(1, len(live) + 1))
        new = [row() for _ in batch]
        if rng.random() < 0.2:  # a batch without a penalty: the table does not see this step
            for r, s in zip(batch, new):
                r.lm.output_ids.append(s)
            continue
        kept = table.rows(batch)
        for c in range(columns):
            got = table.history(kept, c).tolist()
            for r, ids in zip(batch, got):
                want = [x if columns == 1 else x[c] for x in (r.prompt_ids if on_prompt else []) + r.lm.output_ids]
                assert ids == want + [-1] * (kept.width - len(want)), (step, r.id, c)
        table.append(batch, kept, torch.tensor(new))  # [B] ids, or [B, columns] rows
        for r, s in zip(batch, new):
            r.lm.output_ids.append(s)
        if rng.random() < 0.15:  # one finishes: its slot goes back
            gone = live.pop(rng.randrange(len(live)))
            table.release(gone)
    assert born > 12 and max(len(r.lm.output_ids) for r in live) > 20  # slots reused, the table grown
    for r in live:
        table.release(r)
    assert sorted(table.free) == list(range(len(table.table)))  # no slot leaks
