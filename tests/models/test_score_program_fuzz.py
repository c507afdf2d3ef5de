"""Trained values in a score or mask program (T5 / UMT5 / MPNet relative-position buckets, a hand-written
clamped-distance table, learned ALiBi slopes) against the model run whole, drawn by hypothesis
(`score_program_fuzz`): loss, output and every gradient by name, fp64 <= 1e-10 (fp32 <= 1e-4), the ring run
(KV exchanges counted), through ``backend="ring"``, ``ringpass.convert`` + ``load`` and ``inputs="per_rank"``;
a learned sink logit and a trained soft-cap refused, never answered.

Each example is one case, run by ranks that stay up between examples (`ringpass.cli.launch.RankPool`, one per ring
size). The default suite runs a fixed draw (``derandomize``, under a minute); ``./dev test -m heavy
tests/models/test_score_program_fuzz.py`` draws ``RINGPASS_FUZZ_EXAMPLES`` cases (default 150) at random, P 2 to 4.
Hypothesis prints a failing case, shrunk, and how to reproduce it; `test_one_case` reruns a case given as JSON:
``RINGPASS_FUZZ_CASE='{"family": "t5", ...}' ./dev test tests/models/test_score_program_fuzz.py -k one_case``.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import score_program_fuzz as fuzz
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from rank_pools import RankPools

import ringpass


class Pools(RankPools):
    """The ranks of one ring size, each case checked on them."""

    def __init__(self, folder: str):
        super().__init__()
        self.folder = folder

    def check(self, case: dict) -> None:
        results = self.run(case["world_size"], fuzz.run_case, (case, self.folder), timeout=600)
        for rank, result in enumerate(results):
            problems = fuzz.check(case, result)
            assert not problems, f"rank {rank} of case {json.dumps(case)}:\n  " + "\n  ".join(problems)


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    found = Pools(str(tmp_path_factory.mktemp("fuzz")))
    yield found
    found.close()


FUZZ = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.timeout(600)
@settings(max_examples=2, derandomize=True, **FUZZ)  # (suite time: 150 more under -m heavy)
@given(case=fuzz.cases(world_sizes=(2,)))
def test_fuzzed_score_programs_train_exactly_through_the_ring(pools, case):
    """A fixed draw on 2 ranks (the default suite)."""
    pools.check(case)


@pytest.mark.heavy
@pytest.mark.timeout(14400)
@settings(max_examples=int(os.environ.get("RINGPASS_FUZZ_EXAMPLES", "150")), **FUZZ)
@given(case=fuzz.cases())
def test_fuzzed_score_programs_train_exactly_through_the_ring_long(pools, case):
    pools.check(case)


T5_REPORTED = dict(  # the T5 encoder users reported: 32 buckets, max distance 64, 2 x 128 tokens
    family="t5",
    seq_len=128,
    heads=4,
    head_dim=16,
    causal=False,
    layout="auto",
    masks="lift",
    dynamic=False,
    second_len=2,
    loss="projection",
    front_end="backend",
    mask_tile=256,
    seed=0,
    buckets=32,
    max_distance=64,
    implementation="sdpa",
)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "world_size,dtype,padding,outputs",
    [
        (2, "float64", "none", "auto"),
        (2, "float64", "right", "gathered"),
        (2, "float32", "none", "auto"),
        pytest.param(4, "float64", "right", "auto", marks=pytest.mark.heavy),
        pytest.param(4, "float32", "none", "gathered", marks=pytest.mark.heavy),
    ],
)
def test_the_reported_t5_encoder_trains_every_parameter_exactly(pools, world_size, dtype, padding, outputs):
    """Every gradient of the reported T5 encoder by name, over two training steps: fp64 <= 1e-10, fp32 <= 1e-4."""
    pools.check({**T5_REPORTED, "world_size": world_size, "dtype": dtype, "padding": padding, "outputs": outputs})


# Found by the long draw on 2026-12-06 as a wrong second call; the fuzzer's fault, not the ring's: the two identical
# tokens of row 0 give every score an exactly zero gradient, which the ring computes as 0 and the reference as
# rounding (1e-17), and the SGD step then chose a learning rate per model from different parameter sets.
SHORT_PADDED_TABLE = dict(
    family="hand", world_size=2, seq_len=2, heads=1, head_dim=4, causal=True, padding="right", layout="auto",
    masks="lift", dynamic=False, second_len=2, outputs="gathered", dtype="float64", loss="projection",
    front_end="backend", mask_tile=4, seed=2667, buckets=8, max_distance=1, table=True, slopes=False,
    spelling="sdpa", tied=False,
)  # fmt: skip


@pytest.mark.parametrize("front_end", ["backend", "convert"])
def test_a_two_token_right_padded_learned_table_is_exact(pools, front_end):
    pools.check({**SHORT_PADDED_TABLE, "front_end": front_end})


def test_both_models_take_one_step_when_a_zero_gradient_is_rounding_in_one_of_them():
    """The SGD step between the two calls moves the ring's model and the reference by one learning rate, so a
    gradient that is exactly zero in one and 1e-17 in the other leaves them equal to 1e-17."""
    trained = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)).double()
    reference = copy.deepcopy(trained)
    for p, q in zip(trained.parameters(), reference.parameters()):
        p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
    trained[1].bias.grad = torch.zeros(1, dtype=torch.float64)
    reference[1].bias.grad = torch.full((1,), 1e-17, dtype=torch.float64)
    fuzz._sgd_step(trained, reference)
    for p, q in zip(trained.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-15)
        assert p.grad is None and q.grad is None


@pytest.mark.skipif("RINGPASS_FUZZ_CASE" not in os.environ, reason="set RINGPASS_FUZZ_CASE to a case's JSON")
def test_one_case(pools):
    pools.check(json.loads(os.environ["RINGPASS_FUZZ_CASE"]))


def test_a_loss_along_the_output_has_almost_no_gradient_through_an_rms_norm():
    """Why the fuzzer's loss is a fixed random projection: after T5's final RMS norm (weight 1) the gradient of
    ``out.pow(2).mean()`` lies along the output, which the norm's Jacobian maps to almost nothing (what is left
    comes from its epsilon), so every gradient before the norm is ~1e-6 of a generic loss's: in fp32, rounding
    (sharded or not) then moves it by tens of percent."""
    model = fuzz.build({**T5_REPORTED, "world_size": 2, "dtype": "float64", "padding": "none"})
    out = model(input_ids=torch.randint(2, fuzz.VOCAB, (2, 32))).last_hidden_state
    table = model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
    along = torch.autograd.grad(out.pow(2).mean(), table, retain_graph=True)[0]
    projected = torch.autograd.grad((out * torch.randn_like(out)).mean(), table)[0]
    assert along.norm() < 1e-4 * projected.norm()


def test_a_bucket_index_computed_by_floor_division_is_lifted_and_trains():
    """``(distance.clamp(-d, d) + d) * (buckets - 1) // (2 * d)``: floor division is elementwise (torch does not
    tag it pointwise), so the bias stays a program evaluated per tile and its table trains (offline, 2 ranks)."""
    case = {"family": "hand", "heads": 2, "causal": True, "buckets": 9, "max_distance": 5, "table": True}
    model = fuzz.ScoreProgramNet({**case, "slopes": False, "spelling": "sdpa"}, dim_per_head=4).double()
    inspection = ringpass.inspect(model, (torch.randint(2, fuzz.VOCAB, (2, 24)),), world_size=2)
    assert inspection.status == "rewritten", inspection
    assert "table.weight (trained" in str(inspection)
