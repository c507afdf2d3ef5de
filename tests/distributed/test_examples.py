"""The examples run as a user runs them (torchrun on 2 CPU processes, 4 for the 2 x 2 mesh), with a timeout."""

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# gloo sometimes aborts a worker at interpreter exit after all its work is done (a C++ thread of the process group
# still holding a tensor while Python finalizes; ../shared/notes/torch-compile-facts.md): seen once in CI in
# compile_with_ring.py, not reproduced in 70 runs here. Such a run is tried once more, loudly; any other failure, or
# the abort twice, fails the test. PYTHONFAULTHANDLER prints every thread's stack when it happens.
EXIT_ABORT = "terminate called without an active exception"


def _torchrun(script: str, timeout: float, processes: int = 2, args: tuple = ()) -> str:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(processes),
        str(ROOT / "examples" / script),
        *args,
    ]
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    if result.returncode != 0 and EXIT_ABORT in result.stderr:
        warnings.warn(f"{script}: a worker aborted at exit; running it again:\n{result.stderr[-3000:]}", stacklevel=2)
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout


def test_ring_attention_by_hand_under_torchrun():
    output = _torchrun("ring_attention_by_hand.py", timeout=180)
    errors = [float(e) for e in re.findall(r"max \|ring - sdpa\| = (\S+),", output)]
    assert len(errors) == 2 and max(errors) < 1e-5, output


def test_compile_with_ring_under_torchrun():
    output = _torchrun("compile_with_ring.py", timeout=300)
    loss, unsharded, grad_error = re.search(
        r"loss (\S+) \(unsharded (\S+)\), max relative gradient error (\S+)", output
    ).groups()
    assert abs(float(loss) - float(unsharded)) <= 1e-5 * abs(float(unsharded))
    assert float(grad_error) < 1e-4


@pytest.mark.heavy  # suite time (README, "Heavier cases")
def test_hf_llama_with_padding_under_torchrun():
    output = _torchrun("hf_llama_with_padding.py", timeout=300)
    loss, unsharded, grad_error = re.search(
        r"loss (\S+) \(unsharded (\S+)\), max relative gradient error (\S+)", output
    ).groups()
    assert abs(float(loss) - float(unsharded)) <= 1e-5 * abs(float(unsharded))
    assert float(grad_error) < 1e-4
    assert "lifted mask program + causal" in output


@pytest.mark.heavy  # suite time (README, "Heavier cases")
def test_convert_and_run_under_torchrun():
    output = _torchrun("convert_and_run.py", timeout=300)
    steps = re.findall(r"step \d: loss (\S+) \(unsharded (\S+)\), max relative gradient error (\S+)", output)
    assert len(steps) == 2, output
    for loss, unsharded, grad_error in steps:
        assert abs(float(loss) - float(unsharded)) <= 1e-5 * abs(float(unsharded))
        assert float(grad_error) < 1e-4
    assert "rewritten to ring attention over 2 ranks" in output


@pytest.mark.heavy  # four processes in turn: ~25 s
def test_first_call_memory_is_a_one_time_import():
    """docs/performance.md: the first ring call's one-time memory is paid by a 64-token call as well (an import,
    not memory the long call needs), and kept; a later long call costs what every call costs."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "first_call_memory.py"), "--seq-len", "1024"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    rows = {
        m.group(1).strip(): (float(m.group(2)), float(m.group(3)))
        for m in re.finditer(
            r"^(long first|long again|64 tokens first|then long)\s+(\S+)\s+(\S+)$", result.stdout, re.M
        )
    }
    assert len(rows) == 4, result.stdout
    one_time = rows["long first"][0] - rows["long again"][0]
    assert one_time > 50, rows  # torch._dynamo's import: ~100 MiB
    assert (
        rows["64 tokens first"][1] > 0.5 * one_time
        and abs(rows["then long"][0] - rows["long again"][0]) < 0.2 * one_time
    ), rows


@pytest.mark.heavy  # 4 processes (~40 s)
def test_fsdp_and_tensor_parallel_with_the_ring_under_torchrun():
    output = _torchrun("fsdp_tp_ring.py", timeout=400, processes=4)
    found = re.findall(r"(.+ x ring): loss (\S+) \(unsharded (\S+)\), max relative gradient error (\S+)", output)
    assert [name for name, *_ in found] == ["FSDP2 x ring", "tensor parallel x ring"], output
    for _, loss, unsharded, grad_error in found:
        assert abs(float(loss) - float(unsharded)) <= 1e-5 * abs(float(unsharded)) and float(grad_error) < 1e-4, output
    assert output.count("rewritten to ring attention over 2 ranks") == 2, output


@pytest.mark.heavy  # three 4-process jobs (~4 min)
def test_train_recipe_checks_its_first_step_and_resumes_where_it_stopped(tmp_path):
    """examples/train.py on a (dp 2, cp 2) mesh, HF Llama, FSDP2 per block: --check's verdict against the unsharded
    model on the global batch; 2 steps saved with DCP then 1 resumed give the losses of 3 steps in one run."""
    common = ("--dp", "2", "--cp", "2", "--seq-len", "64")
    whole = _torchrun("train.py", 600, 4, (*common, "--steps", "3", "--check", "--ckpt", str(tmp_path / "a")))
    verdict = re.search(r"check: .* relative error (\S+)\), max relative gradient error (\S+): (\w+)", whole)
    assert verdict and verdict.group(3) == "OK" and float(verdict.group(2)) < 1e-4, whole
    assert re.search(r"ring: 2 attention\(s\) rewritten in \d+ graph\(s\) over 2 ranks", whole), whole
    first = _torchrun("train.py", 600, 4, (*common, "--steps", "2", "--ckpt", str(tmp_path / "b")))
    resumed = _torchrun("train.py", 600, 4, (*common, "--steps", "1", "--resume", "--ckpt", str(tmp_path / "b")))
    losses = dict(re.findall(r"^step (\d+): loss (\S+)$", whole, re.M))
    assert len(losses) == 3 and dict(re.findall(r"^step (\d+): loss (\S+)$", first + resumed, re.M)) == losses
