"""Larger ring runs, kept out of the default suite: ./dev test -m heavy"""

import pytest

import ring_workers
from ringpass.launch import spawn_ranks


@pytest.mark.heavy
def test_four_ranks_long_sequence_fp32_and_fp64():
    big = [ring_workers.Case("zigzag", True, "float32", 8191, heads=8, kv_heads=2, head_dim=64, batch=1),
           ring_workers.Case("contiguous", False, "float64", 4099, heads=4, kv_heads=1, head_dim=32, batch=1)]
    for per_rank in spawn_ranks(ring_workers.run_cases, 4, (big,), timeout=900):
        for case in big:
            bound = 1e-5 if case.dtype == "float32" else 1e-10
            for name, error in per_rank[case.name]["errors"].items():
                assert error <= bound, (case.name, name, error)
