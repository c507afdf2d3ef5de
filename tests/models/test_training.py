"""Training jobs as users write them, with the ring: the Hugging Face Trainer, unmodified but for one line
(`tests/workers/trainer_job.py`, launched with torchrun on 2 CPU processes), against the same job without the ring.

The Trainer wraps the model in DDP (Dynamo's default optimize_ddp: the ring keeps its graph whole), hands each
rank its own batches (DistributedSampler; ``inputs="per_rank"``), normalises the loss by the token count over
all ranks (``average_tokens_across_devices``) and saves the model. The ring job must log the same losses and
gradient norms, save the same weights (a checkpoint that ``from_pretrained`` reloads equal), and show that the
ring ran (its summary line). All with -m heavy (suite time: per_rank under DDP runs by default in
test_composition): fp32 with gradient accumulation and checkpointing; bf16
(autocast: the two jobs round differently; measured 3e-5 on the losses, 1.5e-4 on the gradient norms, a mean
weight difference 3.6% of the mean change: bounds 1e-3 and 10%) with -m heavy. fp32 weights are compared
absolutely (1e-5), after checking that training moved each by more than 100 x that; an accelerate loop; the ring
job interrupted after its checkpoint and resumed; TRL's SFTTrainer with packing (`tests/workers/trl_job.py`:
padding-free batches of per-rank lengths, position ids restarting per sequence; ``dynamic=True``).
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

ROOT = Path(__file__).resolve().parents[2]


@cache
def run_job(*flags: str, job: str = "trainer_job", procs: int = 2) -> dict:
    """The log (rank 0), saved weights and output folder of ``tests/workers/{job}.py`` on ``procs`` processes, after
    torchrun exits 0."""
    out = tempfile.mkdtemp(prefix=f"ringpass-{job}-")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs)]
    script = ROOT / "tests" / "workers" / f"{job}.py"
    done = subprocess.run(
        [*command, str(script), out, *flags], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT
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


def initial_weights(job: str) -> dict:
    """The weights ``tests/workers/{job}.py`` starts from (its ``build_model`` after ``set_seed(0)``)."""
    import importlib

    import transformers

    sys.path.insert(0, str(ROOT / "tests" / "workers"))
    transformers.set_seed(0)
    return importlib.import_module(job).build_model().state_dict()


def compare(
    ring: dict, plain: dict, loss_tol: float, weight_tol: float, *, bf16=False, gathered="", job="trainer_job"
) -> None:
    """Losses and gradient norms within ``loss_tol`` (relative); each weight within ``weight_tol`` (absolute), or
    with ``bf16`` the mean difference within ``weight_tol`` of the mean change training made (bf16's rounding
    moves single weights by a whole Adam step). ``gathered``: what the summary says each rank's batch holds (the
    Trainer passes the token count over all ranks, num_items_in_batch: each rank's own); None: the caller reads
    the summaries."""
    assert len(steps(ring)) == len(steps(plain)) == 6, (ring["history"], plain["history"])
    for mine, theirs in zip(steps(ring), steps(plain)):
        assert abs(mine["loss"] - theirs["loss"]) <= loss_tol * abs(theirs["loss"]), (mine, theirs)
        assert abs(mine["grad_norm"] - theirs["grad_norm"]) <= loss_tol * abs(theirs["grad_norm"]), (mine, theirs)
    start = initial_weights(job)
    assert set(ring["weights"]) == set(plain["weights"]) == set(start), sorted(ring["weights"])
    for name, theirs in plain["weights"].items():
        change, difference = theirs.float() - start[name], ring["weights"][name].float() - theirs.float()
        if bf16:
            assert difference.abs().mean() <= weight_tol * change.abs().mean(), name
        else:
            assert change.abs().max() > 100 * weight_tol, name  # training moved it
            assert difference.abs().max() <= weight_tol, name
    if gathered is None:
        return
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


@pytest.mark.heavy  # the ring job of the first test, interrupted and resumed: two more 2-process jobs (~50 s)
def test_a_ring_job_resumed_from_its_checkpoint_trains_as_one_run():
    """The fp32 Trainer job with the ring stopped after step 3 (its checkpoint: model, optimizer, scheduler, RNG
    states), then a new job, compiled afresh, ``trainer.train(resume_from_checkpoint=...)`` to step 6: the log
    (steps 1-3 restored from the checkpoint, 4-6 trained) and the weights of the uninterrupted ring job, and of
    the job without the ring."""
    first = run_job("--ring", *FP32, "--stop-after", "3")
    checkpoint = os.path.join(first["out"], "trainer", "checkpoint-3")
    resumed = run_job("--ring", *FP32, "--resume", checkpoint)
    assert [entry["step"] for entry in steps(first)] == [1, 2, 3], first["history"]
    assert steps(resumed)[:3] == steps(first), resumed["history"]  # the checkpoint's log, then steps 4-6
    assert "attention(s) rewritten" in " ".join(first["summaries"]), first["summaries"]
    compare(resumed, run_job("--ring", *FP32), loss_tol=1e-5, weight_tol=1e-5)
    compare(resumed, run_job(*FP32), loss_tol=1e-5, weight_tol=1e-5)


def trl_reference() -> dict:
    """The TRL job without the ring on 1 process, 2 batches accumulated per step: the batches of the 2-process job
    (accelerate gives batch i of the one shuffled order to rank i mod 2), unsharded, without DDP."""
    return run_job("--accum", "2", job="trl_job", procs=1)


def check_packing(ring: dict, reference: dict) -> None:
    """The TRL jobs trained on packed batches: per rank 6 padding-free batches (one row, no attention mask), each
    holding several sequences (position ids restarting at 0 inside the row, counting up within each), the ranks'
    lengths different at some step; step k's batches of ranks 0 and 1 are the reference's micro-batches 2k, 2k+1."""
    trained = [batches[:6] for batches in ring["batches"]]  # accelerate's loader collates one batch ahead
    assert len(trained) == 2 and all(len(batches) == 6 for batches in trained), ring["batches"]
    (single,) = reference["batches"]
    assert [batch for step in zip(*trained) for batch in step] == single[:12]
    for batch in single[:12]:
        rows, length = batch["shape"]
        assert rows == 1 and not batch["attention_mask"] and batch["positions_count_up"], batch
        assert len(batch["sequences"]) >= 2 and sum(batch["sequences"]) == length, batch
    assert any(mine["shape"] != theirs["shape"] for mine, theirs in zip(*trained)), trained


def ring_summary(log: dict) -> str:
    """The summary of the one graph holding the attentions (the ring may split the model into more graphs)."""
    (summary,) = [line for line in log["summaries"] if "rewritten" in line]
    assert "2 attention(s) rewritten to ring attention over 2 ranks" in summary, summary
    assert "DDP: kept whole" in summary and "position_ids" in summary and "inputs='per_rank'" in summary, summary
    assert "layout documents" in summary, summary  # each rank's batch on the layout of its own packing
    return summary


@pytest.mark.heavy  # one more 2-process job (~25 s)
def test_trl_sft_with_packing_and_its_fused_lm_head_trains_as_without_the_ring():
    """TRL's SFTTrainer as it comes: ``packing=True`` (best fit, padding-free: each rank's batch one row of several
    sequences, its own length; ``dynamic=True``) and TRL 1.16's own loss, its fused LM head (the hidden states
    shifted by one, flattened and scored in a chunked ``autograd.Function``). The shift mixes the tokens of the
    sharded hidden states: under ``per_rank`` that tail is cut off the ring graph and runs once on each rank's own
    batch (`ringpass.passes.split_tail`, said in the summary). With the ring on 2 processes (DDP) against the job
    without the ring on 1 process accumulating 2 batches a step (``trl_reference``): losses, gradient norms and
    weights within 1e-5 (measured 1.2e-7, 1e-7, 6.5e-6; the median weight 6e-8)."""
    ring, reference = run_job("--ring", job="trl_job"), trl_reference()
    check_packing(ring, reference)
    compare(ring, reference, loss_tol=1e-5, weight_tol=1e-5, gathered=None, job="trl_job")
    summary = ring_summary(ring)
    assert "the tail from `getitem`" in summary and "last_hidden_state[:, :-1]" in summary, summary
    assert "runs once on this rank's own batch" in summary, summary


@pytest.mark.heavy  # one more 2-process job (~25 s)
def test_trl_sft_with_packing_and_the_models_own_loss():
    """TRL's SFTTrainer, ``packing=True`` (best fit, padding-free: each rank's batch one row of several
    sequences, its own length; ``dynamic=True``), with ``SFTTrainer.compute_loss`` replaced by
    ``transformers.Trainer``'s (the model's own cross-entropy instead of TRL's fused LM head), with
    the ring on 2 processes (DDP) against the unchanged TRL job without the ring on 1 process accumulating 2
    batches a step (TRL's fused loss: another summation order): losses and gradient norms within 1e-5, weights
    within 2e-5 (measured 1.2e-7, 1e-7, 1.1e-5: one element of the MLP whose tiny gradient Adam normalises; the
    median weight 6e-8).

    The 1-process job steps on the same batches (step k: rank 0's and rank 1's k-th batch, see ``trl_reference``)
    and normalises by the same token count, so it gives the 2-process job's numbers without the ring (measured
    equal to the bit, losses and weights) and is the unsharded reference."""
    ring, reference = run_job("--ring", "--model-loss", job="trl_job"), trl_reference()
    check_packing(ring, reference)
    compare(ring, reference, loss_tol=1e-5, weight_tol=2e-5, gathered=None, job="trl_job")
    ring_summary(ring)
