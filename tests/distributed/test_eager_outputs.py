"""Eager code on what a ring model returns works as on the unsharded tensor (`tests/workers/eager_output_workers.py`).

Every line of `eager_output_workers.LINES` (metrics, losses, checks, conversion, saving) on a `SequenceSharded`
value with padding slots, against the same line on the whole tensor, at P = 2 (and 3, heavy): the value (fp64:
1e-12), the gradient where one reaches the logits, whether it communicated as its rule says (a line that needs
the whole sequence all-gathers it and warns once per line; any other gathers nothing), and that gathered results
are plain tensors. Then on a compiled model's logits, and the cases where not every rank runs the line.

The rules with arithmetic in them (what each rank reduces, how the parts combine, padding left out) are fuzzed:
hypothesis draws an op with its dims and options, the value's shape, its sequence dim, the layout, the ranks and
the dtype (`cases`); the default suite runs a fixed draw on 2 ranks, ``./dev test -m heavy
tests/distributed/test_eager_outputs.py`` draws ``RINGPASS_FUZZ_EXAMPLES`` (default 300) at random on 2 and 3 ranks.
"""

from __future__ import annotations

import json
import math
import os
from functools import cache

import eager_output_workers as workers
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ringpass.cli.launch import spawn_ranks

TIMEOUT = 300


@cache
def _lines(world_size: int, dtype: str = "float64"):
    return spawn_ranks(workers.lines, world_size, (dtype,), timeout=TIMEOUT)


def _check_line(name: str, world_size: int, dtype: str, tolerance: float) -> None:
    needs_whole = workers.LINES[name][1]
    for rank, results in enumerate(_lines(world_size, dtype)):
        result = results[name]
        assert result["error"] <= tolerance, (rank, name, result)
        assert result.get("grad", 0.0) <= tolerance, (rank, name, result)
        if needs_whole:
            assert result["gathers"] > 0 and result["plain"], (rank, name, result)
            (warning,) = result["warned"]
            assert "all-gathered the whole sequence" in warning and "bytes per rank" in warning, warning
            assert result["warned again"] == [], (rank, name, result)  # once per line and op
        else:
            assert result["gathers"] == 0 and result["warned"] == [], (rank, name, result)


@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize("name", list(workers.LINES))
def test_each_eager_line_gives_the_unsharded_value(name):
    _check_line(name, 2, "float64", 1e-12)


@pytest.mark.heavy
@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize("name", list(workers.LINES))
def test_each_eager_line_on_three_ranks_and_in_fp32(name):
    _check_line(name, 3, "float64", 1e-12)
    _check_line(name, 2, "float32", 1e-5)


@pytest.mark.timeout(TIMEOUT + 60)
def test_in_place_ops_write_what_they_would_on_whole_tensors():
    for rank, result in enumerate(spawn_ranks(workers.in_place, 2, timeout=TIMEOUT)):
        assert result["plain"] <= 1e-15 and result["carried"] <= 1e-12, (rank, result)


@pytest.mark.timeout(TIMEOUT + 60)
def test_a_training_scripts_eager_code_on_a_compiled_models_logits():
    for rank, result in enumerate(spawn_ranks(workers.model_lines, 2, timeout=TIMEOUT)):
        assert result["type"] == "SequenceSharded" and result["kv_exchanges"] > 0, (rank, result)  # the ring ran
        assert result["allclose"], (rank, result)
        for key in ("loss", "numpy", "perplexity"):
            assert result[key] <= 1e-10, (rank, key, result)
        assert result["saved"][0] == "Tensor" and result["saved"][1] <= 1e-10, (rank, result)  # a plain tensor
        assert result["warned"] == ["ringpass: numpy()", "ringpass: pickling (torch.save)"], (rank, result)


@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize("then", ["step", pytest.param("barrier", marks=pytest.mark.heavy)])  # (suite time)
def test_a_line_one_rank_runs_alone_raises_there_and_the_others_go_on(then):
    """Rank 0 logs ``logits.tolist()`` alone. The others go on to the next training step (rank 0 sees them at a
    later ring call: at once) or wait at a plain barrier (rank 0 gives up after the backend's timeout, 3 s here).
    Rank 0 catches the error and goes on too: the next step is exact on every rank, and a line every rank runs
    gathers again."""
    results = spawn_ranks(workers.lonely, 2, (then,), timeout=TIMEOUT)
    error = results[0]["error"]
    assert "tolist() at " in error and "eager_output_workers.py:" in error, error
    assert "not every rank does" in error and "Call .full_tensor() on every rank" in error, error
    assert ("went on to ring call" if then == "step" else "has not come") in error, error
    assert results[0]["seconds"] < (3.0 if then == "step" else 8.0), results[0]
    for rank, result in enumerate(results):
        assert result["loss"] <= 1e-10 and result["together"] <= 1e-15, (rank, result)


@pytest.mark.timeout(TIMEOUT + 60)
def test_two_ranks_at_different_lines_are_both_told():
    for rank, result in enumerate(spawn_ranks(workers.apart, 2, timeout=TIMEOUT)):
        other = "aten.roll" if rank == 0 else "aten.flip"
        assert "not every rank does (rank" in result["error"] and "is at " in result["error"], (rank, result)
        assert other not in result["error"] and result["seconds"] < 10.0, (rank, result)


OPS = (
    "sum", "mean", "amax", "amin", "nansum", "logsumexp", "any", "all", "count_nonzero", "prod", "max", "min",
    "norm", "var", "std", "var_mean", "std_mean", "allclose", "equal", "mse_loss", "smooth_l1_loss", "huber_loss",
    "soft_margin_loss", "binary_cross_entropy_with_logits", "sort", "cumsum", "flip", "softmax", "argmax", "median",
    "topk", "roll",
)  # fmt: skip


@st.composite
def cases(draw, world_sizes=(2, 3)):
    ndim = draw(st.integers(1, 4))
    seq_dim = draw(st.integers(0, ndim - 1))
    shape = [draw(st.integers(1, 19)) if d == seq_dim else draw(st.integers(1, 4)) for d in range(ndim)]
    dims = draw(st.none() | st.sets(st.integers(0, ndim - 1), min_size=1).map(sorted))
    return {
        "op": draw(st.sampled_from(OPS)),
        "shape": shape,
        "seq_dim": seq_dim,
        "layout": draw(st.sampled_from(["zigzag", "contiguous"])),
        "world_size": draw(st.sampled_from(world_sizes)),
        "dtype": draw(st.sampled_from(["float64", "float32"])),
        "dims": dims,
        "dim": draw(st.integers(0, ndim - 1)),
        "keepdim": draw(st.booleans()),
        "ord": draw(st.sampled_from([1, 2, 3, 0.5, 0, math.inf, -math.inf])),
        "correction": draw(st.sampled_from([0, 1, 2])),
        "reduction": draw(st.sampled_from(["none", "mean", "sum"])),
        "off": draw(st.sampled_from([0.0, 1e-3])),
        "seed": draw(st.integers(0, 2**16)),
    }


def _check_case(pools, case: dict) -> None:
    for rank, result in enumerate(pools.run(case["world_size"], workers.drawn, (case,), timeout=120)):
        assert not result["value"] and not result.get("grad"), f"rank {rank}, case {json.dumps(case)}: {result}"


FUZZ = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


# a float32 sum that cancels to 3e-3 from terms near 1: its rounding is the terms', found by the long fuzz
CANCELLING_SUM = {
    **dict(op="sum", shape=[3, 4], seq_dim=0, layout="zigzag", world_size=2, dtype="float32", dims=None, dim=0),
    **dict(keepdim=False, ord=1, correction=0, reduction="none", off=0.0, seed=24542),
}


@pytest.mark.timeout(600)
@settings(max_examples=60, derandomize=True, **FUZZ)
@given(case=cases(world_sizes=(2,)))
@example(case=CANCELLING_SUM)
def test_fuzzed_reductions_and_ops_along_dims_equal_the_whole_tensors(pools, case):
    """A fixed draw on 2 ranks (the default suite), and the cases the long draw found."""
    _check_case(pools, case)


@pytest.mark.heavy
@pytest.mark.timeout(7200)
@settings(max_examples=int(os.environ.get("RINGPASS_FUZZ_EXAMPLES", "300")), **FUZZ)
@given(case=cases())
def test_fuzzed_reductions_and_ops_along_dims_long(pools, case):
    _check_case(pools, case)
