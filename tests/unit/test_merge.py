"""The log-sum-exp merge against attention over the union of two key sets, in fp64."""

import torch
from reference import rel_err

from lowering.kernels import merge


def _attend(q, k, v):
    scores = q @ k.mT
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


def test_merging_two_halves_equals_attention_over_all_keys():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 5, 4), torch.randn(3, 9, 4), torch.randn(3, 9, 4)
    q, k, v = q.double(), k.double(), v.double()
    out, lse = torch.zeros(3, 5, 4, dtype=torch.float64), torch.full((3, 5), float("-inf"), dtype=torch.float64)
    for part in (slice(0, 4), slice(4, 9)):
        merge(out, lse, *_attend(q, k[:, part], v[:, part]))
    full_out, full_lse = _attend(q, k, v)
    assert rel_err(out, full_out) < 1e-14 and rel_err(lse, full_lse) < 1e-14


def test_rows_that_see_no_key_stay_zero_and_minus_infinity():
    out, lse = torch.zeros(2, 3), torch.full((2,), float("-inf"))
    merge(out, lse, torch.zeros(2, 3), torch.full((2,), float("-inf")))
    assert torch.equal(out, torch.zeros(2, 3)) and torch.isneginf(lse).all()
    merge(out, lse, torch.ones(2, 3), torch.tensor([float("-inf"), 0.5]))
    assert torch.equal(out[0], torch.zeros(3)) and torch.equal(out[1], torch.ones(3))
    assert torch.isneginf(lse[0]) and lse[1].item() == 0.5
