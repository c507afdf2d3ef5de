"""Training jobs as users write them, with the ring: the Hugging Face Trainer, unmodified but for one line
(`tests/trainer_job.py`, launched with torchrun on 2 CPU processes), against the same job without the ring.

The Trainer wraps the model in DDP (Dynamo's default optimize_ddp: the ring keeps its graph whole), hands each
rank its own batches (DistributedSampler; ``inputs="per_rank"``), normalises the loss by the token count over
all ranks (``average_tokens_across_devices``) and saves the model. The ring job must log the same losses and
gradient norms, save the same weights (a checkpoint that ``from_pretrained`` reloads equal), and show that the
ring ran (its summary line). All with -m heavy (suite time: per_rank under DDP runs by default in
test_composition): fp32 with gradient accumulation and checkpointing; bf16
(autocast: the two jobs round differently; measured 3e-5 on the losses, 1.5e-4 on the gradient norms, a mean
weight difference 3.6% of the mean change: bounds 1e-3 and 10%) with -m heavy. fp32 weights are compared
absolutely (1e-5), after checking that training moved each by more than 100 x that; an accelerate loop.
"""

import json
import os
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "trainer_job.py"


@cache
def run_job(*flags: str) -> dict:
    """The job's log (rank 0), saved weights and output folder, after torchrun exits 0."""
    out = tempfile.mkdtemp(prefix="ringpass-trainer-")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*command, str(JOB), out, *flags], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    from safetensors.torch import load_file

    with open(os.path.join(out, "log.json")) as f:
        log = json.load(f)
    log["weights"] = load_file(os.path.join(out, "model", "model.safetensors"))
    log["out"] = out
    return log


def steps(log: dict) -> list[dict]:
    return [entry for entry in log["history"] if "loss" in entry]


def initial_weights() -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    import trainer_job
    import transformers

    transformers.set_seed(0)
    return trainer_job.build_model().state_dict()


def compare(ring: dict, plain: dict, loss_tol: float, weight_tol: float, *, bf16=False, gathered="") -> None:
    """Losses and gradient norms within ``loss_tol`` (relative); each weight within ``weight_tol`` (absolute), or
    with ``bf16`` the mean difference within ``weight_tol`` of the mean change training made (bf16's rounding
    moves single weights by a whole Adam step). ``gathered``: what the summary says each rank's batch holds (the
    Trainer passes the token count over all ranks, num_items_in_batch: each rank's own)."""
    assert len(steps(ring)) == len(steps(plain)) == 6, (ring["history"], plain["history"])
    for mine, theirs in zip(steps(ring), steps(plain)):
        assert abs(mine["loss"] - theirs["loss"]) <= loss_tol * abs(theirs["loss"]), (mine, theirs)
        assert abs(mine["grad_norm"] - theirs["grad_norm"]) <= loss_tol * abs(theirs["grad_norm"]), (mine, theirs)
    start = initial_weights()
    assert set(ring["weights"]) == set(plain["weights"]) == set(start), sorted(ring["weights"])
    for name, theirs in plain["weights"].items():
        change, difference = theirs.float() - start[name], ring["weights"][name].float() - theirs.float()
        if bf16:
            assert difference.abs().mean() <= weight_tol * change.abs().mean(), name
        else:
            assert change.abs().max() > 100 * weight_tol, name  # training moved it
            assert difference.abs().max() <= weight_tol, name
    (summary,) = ring["summaries"]  # one graph: the whole model
    assert "2 attention(s) rewritten to ring attention over 2 ranks" in summary, summary
    gathered = gathered or "labels, num_items_in_batch all-gathered"
    assert "DDP: kept whole" in summary and f"each rank's input_ids, {gathered}" in summary, summary


FP32 = ("--accum", "2", "--checkpointing")


@pytest.mark.heavy  # two 2-process jobs (~25 s; suite time): per_rank under DDP runs by default in test_composition
def test_hf_trainer_with_the_ring_trains_as_the_same_ddp_job():
    """fp32, gradient accumulation 2, gradient checkpointing: the same losses, gradient norms and weights."""
    compare(run_job("--ring", *FP32), run_job(*FP32), loss_tol=1e-5, weight_tol=1e-5)


@pytest.mark.heavy  # the job of the test above
def test_a_checkpoint_the_ring_job_saved_reloads_equal():
    """``from_pretrained`` of the ring job's saved model: every weight as trained (no ``_orig_mod.`` prefix)."""
    import transformers

    ring = run_job("--ring", *FP32)
    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(ring["out"], "model"))
    state = model.state_dict()
    assert set(state) == set(ring["weights"]), sorted(state)
    for name, saved in ring["weights"].items():
        assert torch.equal(state[name], saved), name


@pytest.mark.heavy  # two more 2-process jobs (~30 s): ./dev test -m heavy
def test_hf_trainer_with_the_ring_in_bf16():
    ring, plain = run_job("--ring", "--bf16"), run_job("--bf16")
    compare(ring, plain, loss_tol=1e-3, weight_tol=0.1, bf16=True)


@pytest.mark.heavy  # two more 2-process jobs (~30 s)
def test_an_accelerate_loop_with_the_ring_trains_as_without_it():
    """accelerate's Accelerator: prepare (DDP, each rank its batches of a shuffled DataLoader), backward, step."""
    ring, plain = run_job("--accelerate", "--ring"), run_job("--accelerate")
    compare(ring, plain, loss_tol=1e-5, weight_tol=1e-5, gathered="labels all-gathered")
