"""`lowering.costmodel`'s time predictions and `ringpass plan`, against cases computed by hand here."""

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from lowering.costmodel import (
    AttentionShape,
    DecodeCost,
    Hardware,
    Strategy,
    all_gather_seconds,
    decode_seconds,
    hiding_slice,
    local_attention_bytes,
    predict,
    ring_cost,
    strategy_memory,
    strategy_seconds,
    ulysses_seconds,
)
from lowering.layout import Layout
from ringpass import cli
from ringpass.hardware import hardware
from ringpass.planning.plan import make_plan

ONE = AttentionShape(batch=1, query_heads=1, kv_heads=1, head_dim=1, itemsize=4)  # 4 FLOPs per pair, 8 bytes per token


def test_a_hand_computed_ring():
    """P=2, N=8, bidirectional: each step scores 4 x 4 = 16 pairs = 64 FLOPs (1 s at 64 FLOP/s); a hop moves
    K and V of 4 tokens, 32 bytes (1 s at 32 B/s): two steps of 1 s, the transfer exactly hidden."""
    hw = Hardware(link_bytes_per_s=32, link_latency_s=0.0, flops_per_s=64)
    prediction = predict(ring_cost(Layout("contiguous", 2, 8), ONE), hw)
    assert prediction.compute_forward == [1.0, 1.0] and prediction.transfer_forward == 1.0
    # backward: two steps of 2.5 s, then the last dK/dV accumulator's trip home (32 fp32 bytes: 1 s)
    assert prediction.forward_s == 2.0 and prediction.backward_s == 2.5 + 2.5 + 1.0
    assert prediction.transfer_backward == 1.0 + 1.0  # the dK/dV accumulators (fp32 here) travel too
    assert prediction.hides  # forward 1 s under 1 s of compute, backward 2 s under 2.5 s
    # all-gather: one block (1 s), then both steps' compute (2 s)
    assert all_gather_seconds(ring_cost(Layout("contiguous", 2, 8), ONE), hw) == 3.0


def test_attention_rates_by_head_dim():
    """A calibration's rates at D = 32 and 128 (block kernel 40 and 80, SDPA 20 and 60 FLOP/s): D = 64 lies half way
    in log2(D), 60 and 40; outside the measured head dims the nearest one's; without rates, the single ones."""
    hw = Hardware(1, 0, 10.0, sdpa_flops_per_s=5.0, head_dim_rates=((128, 80.0, 60.0), (32, 40.0, 20.0)))
    assert [hw.attention_flops_per_s(d) for d in (16, 32, 64, 128, 256)] == [40.0, 40.0, 60.0, 80.0, 80.0]
    assert [hw.attention_flops_per_s(d, kernel="sdpa") for d in (16, 64, 256)] == [20.0, 40.0, 60.0]
    plain = Hardware(1, 0, 10.0, sdpa_flops_per_s=5.0)
    assert (plain.attention_flops_per_s(32), plain.attention_flops_per_s(32, kernel="sdpa")) == (10.0, 5.0)
    assert Hardware(1, 0, 10.0).attention_flops_per_s(32, kernel="sdpa") == 10.0
    # the ring prices a D = 32 attention at 40 FLOP/s: P=2, N=8, one head, bidirectional, 16 pairs a step x 4 x 32
    shape = AttentionShape(batch=1, query_heads=1, kv_heads=1, head_dim=32, itemsize=4)
    assert predict(ring_cost(Layout("contiguous", 2, 8), shape), hw).compute_forward == [16 * 4 * 32 / 40] * 2
    # unsharded ("none") at the SDPA rate: N=8 non-causal, 64 pairs x 4 x 32 FLOPs forward, 3.5 x that with backward
    assert strategy_seconds(Strategy("none"), shape, 8, 1, hw) == pytest.approx(64 * 4 * 32 / 20 * 3.5)


def test_a_hand_computed_decode_step():
    """One query against 8 positions on P=2: each rank 4 slots, 4 x 4 = 16 FLOPs (1 s at 16 FLOP/s), reading
    4 x 8 = 32 bytes (0.5 s at 64 B/s: the FLOPs bound it); the merge sends out and LSE, (1 + 1) fp32 numbers
    = 8 bytes (0.25 s at 32 B/s) after 0.5 s of latency. Whole on one device: 2 s of FLOPs."""
    hw = Hardware(link_bytes_per_s=32, link_latency_s=0.5, flops_per_s=16, memory_bytes_per_s=64)
    sharded = DecodeCost(ONE, cache_len=8, world_size=2)
    assert (sharded.slots, sharded.flops, sharded.cache_bytes, sharded.merge_bytes) == (4, 16, 32, 8)
    assert decode_seconds(sharded, hw) == {"compute": 1.0, "merge": 0.75, "total": 1.75}
    whole = decode_seconds(DecodeCost(ONE, cache_len=8, world_size=1), hw)
    assert whole == {"compute": 2.0, "merge": 0.0, "total": 2.0}
    slow_memory = Hardware(link_bytes_per_s=32, link_latency_s=0.5, flops_per_s=16, memory_bytes_per_s=8)
    assert decode_seconds(sharded, slow_memory)["compute"] == 4.0  # 32 bytes at 8 B/s: memory-bound


def test_a_hand_computed_ulysses_x_ring():
    """P=4 in Ulysses groups of U=2, N=16 bidirectional, 2 query heads / 2 KV heads: each rank holds 4 tokens; the
    all-to-all moves half of q, k, v and out, 4 x 4 tokens x 2 heads x 4 bytes / 2 = 64 bytes (1 s at 64 B/s, no
    latency). The ring runs over 2 groups with 8 tokens and 1 head each: a step scores 8 x 8 = 64 pairs = 256 FLOPs
    (1 s at 256 FLOP/s) and a hop moves K and V of 8 tokens x 1 head, 64 bytes (2 s at 32 B/s)."""
    shape = AttentionShape(batch=1, query_heads=2, kv_heads=2, head_dim=1, itemsize=4)
    ring_link = Hardware(link_bytes_per_s=32, link_latency_s=0.0, flops_per_s=256)
    fast = Hardware(link_bytes_per_s=64, link_latency_s=0.0, flops_per_s=1)
    times = ulysses_seconds(shape, Layout("contiguous", 4, 16), 2, ring_link, fast)
    assert times["all_to_all_forward"] == 1.0 and times["all_to_all_backward"] == 1.0
    assert times["ring_forward"] == 2.0 + 1.0 and not times["hides"]  # the first step waits for its 2 s hop
    assert times["forward"] == 1.0 + 3.0
    # fewer KV heads than U: the one KV head is repeated to two before the all-to-all, so the bytes are as above
    one_kv = AttentionShape(batch=1, query_heads=2, kv_heads=1, head_dim=1, itemsize=4)
    assert ulysses_seconds(one_kv, Layout("contiguous", 4, 16), 2, ring_link, fast) == times


def test_the_hiding_slice_is_where_a_step_covers_its_hop():
    hw = Hardware(link_bytes_per_s=1e9, link_latency_s=20e-6, flops_per_s=1e12)
    shape = AttentionShape(batch=1, query_heads=8, kv_heads=2, head_dim=64, itemsize=2)
    n = hiding_slice(shape, hw)

    def step(tokens_per_rank):
        prediction = predict(ring_cost(Layout("contiguous", 2, 2 * tokens_per_rank), shape), hw)
        return prediction.compute_forward[0], prediction.transfer_forward

    compute, transfer = step(n)
    assert compute >= transfer
    compute, transfer = step(n - 1)
    assert compute < transfer
    # by hand: 4·8·64 FLOPs per pair, 2·2·64·2 bytes per token: n² · 2048e-12 = 20e-6 + n · 512e-9
    assert abs(n - (512e-9 + (512e-9**2 + 4 * 2048e-12 * 20e-6) ** 0.5) / (2 * 2048e-12)) < 1


def test_a_longer_slice_hides_better_and_a_slower_link_worse():
    shape = AttentionShape(batch=1, query_heads=32, kv_heads=8, head_dim=128, itemsize=2, is_causal=True)
    fast, slow = hardware("nvlink", "h100"), hardware("pcie", "h100")
    assert hiding_slice(shape, fast) < hiding_slice(shape, slow)

    def ratio(seq_len, hw):
        p = predict(ring_cost(Layout("zigzag", 8, seq_len), shape), hw)
        return min(p.compute_forward[:-1]) / p.transfer_forward

    assert ratio(8192, fast) < ratio(131072, fast)
    assert ratio(131072, slow) < ratio(131072, fast)


def test_recommendations():
    shape = AttentionShape(batch=1, query_heads=32, kv_heads=8, head_dim=128, itemsize=2, is_causal=True)
    assert make_plan(shape, 8, 131072, hardware("nvlink", "h100")).recommendation.startswith("ring, layout zigzag")
    decode = make_plan(shape, 8, 131072, hardware("nvlink", "h100"), decode=True)
    assert decode.recommendation.startswith("no ring") and "ringpass.ShardedCache" in decode.recommendation
    assert decode.decode["sharded"]["total"] < decode.decode["whole"]["total"]  # 1/8 of the cache, one small merge
    short = make_plan(shape, 8, 2048, hardware("loopback", "h100"))  # 256 tokens per rank on a slow link
    assert not short.prediction.hides and "No sequence parallelism pays on time here" in short.recommendation
    fewer = make_plan(shape, 16, 2**21, hardware("loopback", "h100"))  # 131072 per rank: too few for that link
    assert not fewer.prediction.hides and f"Use at most {2**21 // fewer.hiding_tokens} ranks" in fewer.recommendation
    with pytest.raises(Exception, match="give --link"):
        hardware(None, "h100")


@pytest.mark.parametrize("command", ["plan", "bench", "inspect", "convert", "demo"])
def test_every_subcommand_prints_its_help(command, capsys):
    """`ringpass <cmd> --help` is what a user types first (plan's help crashed on a `%` in a preset's text): the
    function the console script calls, in this process."""
    with pytest.raises(SystemExit) as exit:
        cli.main([command, "--help"])
    assert exit.value.code == 0 and "usage: ringpass " + command in capsys.readouterr().out


TARGET = shlex.quote(f"{Path(__file__).parents[1] / 'workers' / 'inspect_targets.py'}:llama")
BAD_COMMANDS = {  # a command line each subcommand refuses -> what it says
    "plan --world-size 2 --seq-len 64 --heads 1 --head-dim 8 --device cpu": "ringpass plan: give --link",
    "bench --methods ring-spiral": "ringpass bench: unknown method(s) ring-spiral",
    f"inspect {TARGET} --world-size 1": "ringpass inspect: world_size must be an int >= 2",
    f"convert {TARGET} --world-size 1 -o never.pt2": "ringpass convert: world_size must be an int >= 2",
}


@pytest.mark.parametrize("command", BAD_COMMANDS, ids=lambda command: command.split()[0])
def test_errors_name_the_subcommand_once(command, capsys):
    """The library's messages name their front end ("plan: give --link"); the command line says it once."""
    argv = shlex.split(command)
    assert cli.main(argv) == 1
    printed = capsys.readouterr().err
    assert BAD_COMMANDS[command] in printed and f"{argv[0]}: {argv[0]}:" not in printed, printed


def _whole_model_plan(tmp_path, *flags: str) -> dict:
    """`ringpass plan` on the tests' Llama with its loss (fp32, 2 layers, 61 tokens, 128 tokens x batch 2), as
    JSON; the human output must name the collapsed attention line."""
    out = tmp_path / "model-plan.json"
    target = f"{Path(__file__).parents[1] / 'workers' / 'inspect_targets.py'}:llama_with_loss"
    argv = [*f"plan {target} --world-size 2 --seq-len 128 --batch 2 --dtype fp32 --link loopback".split()]
    assert cli.main([*argv, "--device", "cpu", *flags, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_a_whole_model_plan_by_hand(tmp_path, capsys):
    """Each memory part of the plan against the model's own numbers computed here: weights = parameters x 4
    bytes (+ buffers); AdamW two states each and a step count; the ring's buffers = the cost model's backward
    working memory at P=2 less what local attention holds; the activations at 64 tokens per rank less than half
    those at 128 (P=1), less with checkpointing; with the ring, the compiled step's. (Other optimizers and
    wrappers: -m heavy.)"""
    model, params, block, adamw = _tiny_model_numbers()
    plain = _whole_model_plan(tmp_path)
    printed = capsys.readouterr().out
    assert "attention: 2 x body.blocks.{0-1}: sdpa (causal" in printed, printed
    assert "recommendation: ring over" in printed, printed
    memory = plain["memory_per_rank"]
    assert set(memory) == {"weights", "gradients", "optimizer", "activations", "ring", "total"}
    assert memory["total"] == sum(v for k, v in memory.items() if k != "total")
    assert memory["weights"] == params + sum(b.numel() * b.element_size() for b in model.buffers())
    assert memory["optimizer"] == adamw
    shape = AttentionShape(2, 4, 2, 8, 4, True)
    # the ring's buffers beyond what the fake step's local SDPA holds (out, LSE, dq, dk, dv): three fp32 dK/dV
    # accumulators and two KV blocks, 10 x (B 2 x 2 KV heads x 64 tokens x D 8) fp32 numbers
    assert memory["ring"] == 10 * (2 * 2 * 64 * 8) * 4
    working = ring_cost(Layout("zigzag", 2, 128), shape).working_memory()["backward"]
    assert memory["ring"] == working - local_attention_bytes(shape, 64)
    by = {(c["ring_size"], c["checkpointing"]): c["memory_per_rank"] for c in plain["candidates"]}
    assert set(by) == {(1, False), (1, True), (2, False), (2, True)}
    # half the tokens per rank, compiled (its partition saves less than eager autograd keeps)
    assert 0.25 <= by[2, False]["activations"] / by[1, False]["activations"] <= 0.55, by
    # checkpointed, its peak is a block's recompute in the backward, with the gradients made by then (fewer than all)
    assert by[1, True]["activations"] < by[1, False]["activations"] and 0 < by[1, True]["gradients"] < params, by
    # with the ring the step is compiled: its activations and gradients at the peak are the compiled step's
    # (`ringpass.planning.compiled_memory`, checked against a measured step in tests/unit/test_compiled_memory.py)
    import inspect_targets
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ringpass.planning.compiled_memory import compiled_step_memory

    for checkpointing in (False, True):
        with FakeTensorMode(allow_non_fake_inputs=True):
            compiled = compiled_step_memory(*inspect_targets.llama_with_loss(64, 2), checkpointing)
        # the partitioner's choices between equal cuts vary from one compile to the next (a few KiB here)
        assert by[2, checkpointing]["activations"] == pytest.approx(compiled.activations, rel=0.05)
        assert by[2, checkpointing]["gradients"] == pytest.approx(compiled.gradients, rel=0.05)
    assert by[2, True]["activations"] < by[2, False]["activations"], by


def test_a_whole_model_plan_with_strategy_auto(tmp_path, capsys):
    """``--strategy auto`` on a link so slow that one gather beats the ring's hops: the P=2 candidates run both
    attentions by the all-gather, priced and sized as `lowering.costmodel` prices and sizes that strategy; the
    recommendation names it."""
    plan = _whole_model_plan(tmp_path, "--strategy", "auto", "--bandwidth", "0.001", "--latency", "1000")
    printed = capsys.readouterr().out
    shape = AttentionShape(2, 4, 2, 8, 4, True)
    gather = Strategy("all-gather", "zigzag")
    hw = hardware(bandwidth_gb_s=0.001, latency_us=1000, device="cpu")
    for c in plan["candidates"]:
        if c["ring_size"] == 1:
            assert c["strategies"] == "unsharded" and c["time_parts"]["attention"] > 0
            continue
        assert c["strategies"] == "2 x all-gather (zigzag)", c["strategies"]
        beyond_local = strategy_memory(gather, shape, 128, 2) - local_attention_bytes(shape, 64)
        assert c["memory_per_rank"]["ring"] == beyond_local
        # checkpointing never runs a sharded attention's forward again (the backend saves its output)
        assert c["time_parts"]["attention"] == pytest.approx(2 * strategy_seconds(gather, shape, 128, 2, hw))
    assert "(2 x all-gather (zigzag))" in printed, printed


def test_the_step_time_prices_each_op_by_hand():
    """`OpCosts` on fake tensors: a matrix product's FLOPs (2 m k n) and the bytes of its inputs and output, an
    add's bytes, a view's none; the time is each op's launch plus the longer of its FLOPs at the matrix-product
    rate and its bytes at the memory rate; the ops of a block's forward (a block list's entry, not its backward)
    run twice with checkpointing."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ringpass.planning.model_plan import OpCosts

    with FakeTensorMode():
        a, b, c = torch.empty(64, 32), torch.empty(32, 16), torch.empty(64, 16)
        with OpCosts(set()) as costs:
            (a @ b + c).view(-1)
    assert costs.ops == [
        (2 * 64 * 32 * 16, 4 * (64 * 32 + 32 * 16 + 64 * 16), False),
        (0, 4 * 3 * 64 * 16, False),
        (0, 0, False),
    ]
    hw = Hardware(1, 0, flops_per_s=1, gemm_flops_per_s=1e6, memory_bytes_per_s=1e5, op_overhead_s=1e-3)
    by_hand = (1e-3 + max(65536 / 1e6, 14336 / 1e5)) + (1e-3 + 12288 / 1e5) + 1e-3
    assert costs.seconds(hw, checkpointing=False) == pytest.approx(by_hand)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8)])

        def forward(self, x):
            return self.blocks[0](x).sum()

    net = Net()
    with OpCosts({"Net.blocks.0"}) as costs:
        net(torch.randn(4, 8)).backward()
    forward = [op for op in costs.ops if op[2]]
    assert forward and len(forward) < len(costs.ops)  # the block's forward ops; the sum and the backward are not
    launches = Hardware(1, 0, flops_per_s=1e30, op_overhead_s=1.0)  # each op costs its launch only
    assert costs.seconds(launches, checkpointing=True) == pytest.approx(len(costs.ops) + len(forward))


def test_a_large_vocabulary_step_peaks_with_its_parameters_gradients():
    """A large vocabulary x hidden at a short slice of the sequence, where the embedding's and the head's
    gradients (vocabulary x hidden each) outweigh the activations. Counted here from the shapes: the optimizer step
    holds every gradient and AdamW's temporaries (torch on the CPU: the square root of one parameter's second moment
    and its quotient by the bias correction, two of the largest parameter at once, the head's, beside the quotient
    of the parameter before it, which its variable keeps until the next is made; ``foreach``, a GPU's default: one
    temporary per parameter, all at once), and that moment is the step's peak; with the ring, the backward copies
    each parameter's gradient once as it sums it over the ring, beside every gradient made by then. The plan before
    counted neither (the backward's peak alone: about the gradients, not the copy or the temporaries)."""
    import torch
    import torch.nn.functional as F

    from ringpass.planning.model_plan import candidate, measure_step

    vocab, hidden, tokens = 8192, 32, 2

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.proj = torch.nn.Embedding(vocab, hidden), torch.nn.Linear(hidden, hidden)
            self.head = torch.nn.Linear(hidden, vocab, bias=False)

        def forward(self, ids, labels):
            return F.cross_entropy(self.head(self.proj(self.embed(ids))).flatten(0, 1), labels.flatten())

    def build(n):
        ids = torch.zeros(1, n, dtype=torch.long)
        return Net(), (ids, ids)

    parameters = 4 * (vocab * hidden + hidden * hidden + hidden + hidden * vocab)
    largest, logits = 4 * vocab * hidden, 4 * tokens * vocab  # an fp32 embedding or head; the logits
    step = measure_step(build, tokens, "adamw", foreach=False)
    beside = 2 * largest + 4 * hidden + 4  # the quotient of proj.bias, and the loss the caller holds
    assert step["all_gradients"] == parameters and step["optimizer_step"] == beside
    assert measure_step(build, tokens, "adamw", foreach=True)["optimizer_step"] == parameters + 4
    plan = candidate(step, Layout("zigzag", 1, tokens), 1, hardware("loopback", "cpu"), [], "none", False, None)
    memory = plan.memory_per_rank
    assert plan.peak == "optimizer" and memory["ring"] == 0
    assert memory["activations"] + memory["gradients"] == parameters + beside
    # with the ring (compiled): every gradient and the largest one's copy, beside at most a few logits-sized tensors
    ring = measure_step(build, tokens, "adamw", compiled=True, foreach=False)
    assert parameters + largest <= ring["activations"] + ring["gradients"] <= parameters + largest + 6 * logits


def test_a_step_that_cannot_run_on_fake_tensors_is_refused_saying_why():
    """A model whose code needs a real value (here ``int()`` of a tensor): the plan's fake step fails with an
    error naming the cause and what to do, not torch's traceback alone."""
    import torch

    from lowering.errors import NotSupportedError
    from ringpass.planning.model_plan import measure_step

    class ReadsValues(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.proj(x)[: int(x.sum()) + 1].sum()

    with pytest.raises(NotSupportedError, match="one training step of the model at 16 tokens per rank on fake"):
        measure_step(lambda tokens: (ReadsValues(), (torch.ones(1, tokens, 8),)), 16, "adamw")


@pytest.mark.heavy  # five plans (~50 s)
def test_whole_model_plans_for_other_optimizers_and_wrappers(tmp_path):
    """SGD keeps one state per parameter, none none; FSDP2 divides weights, gradients and states by the ranks and
    gathers two blocks; DDP's buckets copy the gradients; a memory too small: nothing fits, said so."""
    model, params, block, adamw = _tiny_model_numbers()
    memory = _whole_model_plan(tmp_path)["memory_per_rank"]
    assert _whole_model_plan(tmp_path, "--optimizer", "sgd")["memory_per_rank"]["optimizer"] == params
    assert _whole_model_plan(tmp_path, "--optimizer", "none")["memory_per_rank"]["optimizer"] == 0
    fsdp = _whole_model_plan(tmp_path, "--fsdp")["memory_per_rank"]
    assert fsdp["weights"] == memory["weights"] // 2 + 2 * block and fsdp["optimizer"] == adamw // 2
    ddp = _whole_model_plan(tmp_path, "--ddp")["memory_per_rank"]
    assert ddp["gradients"] == memory["gradients"] + params
    tight = _whole_model_plan(tmp_path, "--gpu-mem", "0.0001")
    assert tight["fits"] is False and "nothing fits 0.0001 GiB" in tight["recommendation"], tight["recommendation"]


def _tiny_model_numbers() -> tuple:
    """The factory's model, its parameters' bytes, one block's, and AdamW's states (two per parameter and a
    float32 step count per parameter tensor)."""
    import inspect_targets

    model, _ = inspect_targets.llama_with_loss()
    params = sum(p.numel() * 4 for p in model.parameters())
    block = sum(p.numel() * 4 for p in model.body.blocks[0].parameters())
    return model, params, block, 2 * params + 4 * len(list(model.parameters()))


@pytest.mark.heavy  # real training steps measured, one process and a 2-rank ring, two models (~3 min)
def test_the_plans_memory_against_a_measured_step():
    """`examples/plan_check.py` at a tiny size: the plan's prediction of what a training step adds within a loose
    bound of the measured peak, for the model alone (eager) and for a 2-rank ring (compiled), checkpointing off and
    on, for a Hugging Face Llama and the hand-written one (the documented table, with the 25% target, is run by
    hand)."""
    argv = ["--model", "llama,hand", "--seq-len", "1024", "--world-sizes", "1,2"]
    run = subprocess.run(
        [sys.executable, "examples/plan_check.py", *argv],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).parents[2],
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split("|") for line in run.stdout.splitlines() if line.startswith(("| llama |", "| hand |"))]
    ratios = [float(row[6]) for row in rows]  # predicted / measured memory (time: too noisy here to assert)
    assert len(ratios) == 8 and all(0.7 <= r <= 1.4 for r in ratios), run.stdout
