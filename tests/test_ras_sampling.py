"""Repetition-aware sampling (CosyVoice2's ras_sampling) and stop-id masking (min_tokens), per row on the device.

The reference below follows upstream `ras_sampling` / `nucleus_sampling` / `random_sampling` step by step (a
Python loop over the stable-sorted probabilities keeps the nucleus), with its multinomial draws replaced by our
draw procedure at the row's counter-based numbers: the nucleus by rejection (inverse CDF over the top-k tokens
in candidate order; a draw outside the nucleus shrinks the support to the tokens more likely than it), the
redraw by inverse CDF over the whole distribution.
"""
import torch

from tests.util_sampling import inverse_cdf, uniform
from voxbackend.sampling import RESAMPLE_STEP, ROUND_SEED, SamplingBatch, mask_ids, sample
from voxbackend.sampling_params import SamplingParams

V = 400


def reference_ras(logits: torch.Tensor, recent: list[int], p: SamplingParams, step: int) -> int:
    probs = (logits.double() / p.temperature).softmax(0)
    values, order = probs.sort(descending=True, stable=True)
    kept, cum = [], 0.0
    for value in values.tolist():
        if cum < p.top_p and len(kept) < p.top_k:
            cum += value
            kept.append(value)
        else:
            break
    nucleus = set(order[: len(kept)].tolist())
    weights = probs.tolist()
    kth = values[p.top_k - 1].item()
    support = [w if w >= kth else 0.0 for w in weights]  # the top-k tokens (no ties in random logits)
    token, round_ = inverse_cdf(support, uniform(p.seed, step)), 0
    while token not in nucleus:
        round_ += 1
        support = [w if w > weights[token] else 0.0 for w in support]
        token = inverse_cdf(support, uniform((p.seed + round_ * ROUND_SEED) & 0xFFFFFFFF, step))
    if sum(t == token for t in recent[-p.ras_window:]) >= p.ras_window * p.ras_tau_r:
        token = inverse_cdf(weights, uniform(p.seed, step + RESAMPLE_STEP))
    return token


def batch(params, steps, recent):
    return SamplingBatch.build([q.validated() for q in params], steps, [[] for _ in params], V, "cpu", recent=recent)


def test_ras_equals_the_reference_procedure_and_takes_both_branches():
    g = torch.Generator().manual_seed(0)
    params = [SamplingParams(top_p=0.8, top_k=25, ras_window=10, ras_tau_r=0.1, seed=s) for s in range(6)]
    params[5] = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, ras_window=4, ras_tau_r=0.5, seed=5)
    redrawn = kept = 0
    for step in range(40):
        logits = torch.randn(6, V, generator=g) * 3
        # recent ids built around each row's likely picks, so draws repeat often
        top = logits.topk(3).indices
        recent = [top[i].tolist() * (i % 3) + [int(x) for x in torch.randint(0, V, (4,), generator=g)]
                  for i in range(6)]
        got = sample(logits, batch(params, [step] * 6, recent))
        for i in range(6):
            want = reference_ras(logits[i], recent[i], params[i], step)
            assert int(got[i]) == want, (step, i)
            nucleus = sample(logits[i:i + 1], batch([params[i]], [step], [[]]))  # no recent ids: never redrawn
            redrawn += int(nucleus[0]) != want
            kept += int(nucleus[0]) == want
    assert redrawn > 10 and kept > 10


def test_rows_without_ras_draw_as_before_beside_rows_with_it():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, V, generator=g) * 2
    plain = [SamplingParams(top_p=0.9, seed=11), SamplingParams(top_k=30, seed=12)]
    ras = [SamplingParams(top_k=25, top_p=0.8, ras_window=10, seed=13)] * 2
    for step in range(20):
        recent = [[int(logits[i].argmax())] * 10 for i in range(4)]
        mixed = sample(logits, batch(plain + ras, [step] * 4, recent))
        before = sample(logits[:2], SamplingBatch.build([p.validated() for p in plain], [step] * 2, [[], []], V, "cpu"))
        assert mixed[:2].tolist() == before.tolist()


def test_masked_stop_ids_are_never_drawn_and_only_in_masked_rows():
    logits = torch.zeros(3, V)
    logits[:, 7] = 50.0  # the stop id, by far the most likely
    logits[:, 9] = 10.0
    rows = torch.tensor([True, False, True])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0), SamplingParams(seed=3)]
    for ids in (None, torch.arange(V).expand(3, -1)):
        masked = mask_ids(logits, ids, torch.tensor([7, 8]), rows)
        for step in range(30):
            out = sample(masked, batch(params, [step] * 3, [[]] * 3), ids).tolist()
            assert out[0] == 9 and out[1] == 7 and out[2] != 7


def test_ras_and_min_tokens_are_validated():
    import pytest

    from voxbackend.errors import InvalidRequest

    for kwargs, field in (({"ras_window": -1}, "ras_window"), ({"ras_tau_r": 1.5}, "ras_tau_r"),
                          ({"min_tokens": -2}, "min_tokens")):
        with pytest.raises(InvalidRequest) as e:
            SamplingParams(**kwargs).validated()
        assert e.value.field == field
