"""Larger ring runs, kept out of the default suite: ./dev test -m heavy"""

import os
import subprocess
import sys

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


@pytest.mark.heavy
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_triton_kernels_compile_for_an_h100_class_gpu(dtype, tmp_path):
    """The compiled (not interpreted) Triton path, built down to a cubin for sm_90 without a GPU: it
    catches what the interpreter accepts but the compiler does not (non-constexpr globals, branch types).
    In a fresh process: once Triton has run interpreted, a process cannot compile."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    script = os.path.join(os.path.dirname(__file__), "compile_kernels.py")
    done = subprocess.run([sys.executable, script, dtype], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stdout + done.stderr
