"""Larger ring runs, kept out of the default suite: ./dev test -m heavy"""

import os
import subprocess
import sys

import pytest
import ring_workers

from ringpass.cli.launch import spawn_ranks


@pytest.mark.heavy
def test_four_ranks_long_sequence_fp32_and_fp64():
    big = [
        ring_workers.Case("zigzag", True, "float32", 8191, heads=8, kv_heads=2, head_dim=64, batch=1),
        ring_workers.Case("contiguous", False, "float64", 4099, heads=4, kv_heads=1, head_dim=32, batch=1),
    ]
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
    script = os.path.join(os.path.dirname(__file__), "..", "workers", "compile_kernels.py")
    done = subprocess.run([sys.executable, script, dtype], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stdout + done.stderr


@pytest.mark.heavy
def test_inspect_a_llama_3_8b_shaped_config_at_128k_tokens_on_8_ranks(tmp_path):
    """The issue's target: hidden 4096, 32 heads, 8 KV heads, 2 layers, N=131072, P=8, on the meta
    device, through the command line in a fresh process: under 60 s and 3 GiB peak memory (its own
    peak resident set, read at its end)."""
    import json
    import re
    import time

    import transformers

    transformers.LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        dtype="bfloat16",
    ).save_pretrained(tmp_path)
    command = (
        "import resource, sys; from ringpass.cli import main; code = main(sys.argv[1:]); "
        "print('peak KiB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(code)"
    )
    started = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            command,
            "inspect",
            "--hf-config",
            str(tmp_path),
            "--world-size",
            "8",
            "--labels",
            "--json",
            str(tmp_path / "plan.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    seconds = time.perf_counter() - started
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    peak_gib = int(re.search(r"peak KiB (\d+)", done.stdout).group(1)) / 2**20
    graph = json.loads((tmp_path / "plan.json").read_text())["graphs"][0]
    assert graph["seq_len"] == 131072 and len(graph["attentions"]) == 2
    assert graph["ring"][0]["kv_bytes_per_hop"] == 2 * 1 * 8 * (131072 // 8) * 128 * 2
    assert seconds < 60 and peak_gib < 3, (seconds, peak_gib)
