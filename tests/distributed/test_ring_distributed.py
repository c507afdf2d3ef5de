"""ring_attention on 1-4 gloo processes on loopback against unsharded fp64 attention.

One spawn per world size runs every case (see ring_workers.cases); each case is its own test. Tolerances:
fp64 relative error <= 1e-10 (measured <= 4e-15), fp32 <= 1e-5 (measured <= 1.5e-6), bf16 within twice the
error of unsharded bf16 SDPA (lse <= 5e-3). Every spawn has a timeout: a dead or stuck rank fails the test.
"""

from functools import cache

import pytest
import ring_workers

from lowering import Layout
from lowering.schedule import kv_source, plan_block
from ringpass.cli.launch import RankFailure, spawn_ranks

WORLD_SIZES = (1, 2, 3, 4)
TOLERANCE = {"float64": 1e-10, "float32": 1e-5}
TIMEOUT = 240


@cache
def results(world_size: int) -> list[dict]:
    return spawn_ranks(ring_workers.all_cases, world_size, timeout=TIMEOUT)


def _params():
    # P=3 and 4 with -m heavy (suite time: odd rings run by default in the fully-masked and disagreement tests, four
    # ranks in the test of two rings on subgroups)
    return [
        pytest.param(p, case, id=f"P{p}-{case.name}", marks=[pytest.mark.heavy] if p in (3, 4) else [])
        for p in WORLD_SIZES
        for case in ring_workers.cases(p)
    ]


@pytest.mark.parametrize("world_size,case", _params())
def test_ring_matches_unsharded_attention(world_size, case):
    for rank, per_rank in enumerate(results(world_size)):
        result = per_rank[case.name]
        assert result["finite"] and result["padding_ok"], f"rank {rank}"
        lse_dtype = "torch.float64" if case.dtype == "float64" else "torch.float32"
        assert result["dtypes"] == (f"torch.{case.dtype}", lse_dtype)
        for name, error in result["errors"].items():
            if case.dtype == "bfloat16":  # lse is fp32 from bf16 scores: ~1e-3 measured
                bound = 2 * result["unsharded_errors"][name] if name != "lse" else 5e-3
            else:
                bound = TOLERANCE[case.dtype]
            assert error <= bound, f"rank {rank}: {name} relative error {error:.2e} > {bound:.0e}"


@pytest.mark.parametrize(
    "world_size,case", [p for p in _params() if p.values[1].dtype == "float64" and not p.values[1].lse_grad]
)
def test_communication_and_kernel_calls_are_counted(world_size, case):
    """Every block travels the whole lap (P - 1 sends of KV per rank each way, P of dk/dv), except under a contiguous
    causal mask: there block b is needed by the ranks after it only, so it stops at the last rank, and that rank
    sends each block's dk/dv straight home. Rank r < P - 1 then sends r + 1 blocks (and their dk/dv on), the last
    rank no block and P - 1 dk/dv home."""
    layout = Layout(case.kind, world_size, case.seq_len)
    for rank, per_rank in enumerate(results(world_size)):
        forward, backward = per_rank[case.name]["forward"], per_rank[case.name]["backward"]
        if case.kind == "contiguous" and case.causal and world_size > 1:
            last = rank == world_size - 1
            kv, dkv = (0, world_size - 1) if last else (rank + 1, rank + 1)
        else:
            kv, dkv = world_size - 1, (world_size if world_size > 1 else 0)
        assert forward["kv"] == backward["kv"] == kv and forward["dkv"] == 0, (rank, forward, backward)
        assert backward["dkv"] == dkv, (rank, backward)
        planned = sum(
            len(plan_block(layout, rank, kv_source(rank, s, world_size), case.causal)) for s in range(world_size)
        )
        assert forward["blocks"] == backward["blocks"] == planned
        assert forward["masked_blocks"] == backward["masked_blocks"] == 0


def test_contiguous_causal_rank0_computes_only_its_own_block():
    case = next(c for c in ring_workers.cases(2) if c.kind == "contiguous" and c.causal and c.dtype == "float64")
    assert results(2)[0][case.name]["forward"]["blocks"] == 1  # (rank 1's block lies after all its queries)


def test_layout_for_another_world_size_is_refused_on_every_rank():
    messages = spawn_ranks(ring_workers.wrong_world_size, 2, timeout=60)
    for message in messages:
        assert "layout is for 3 ranks but the process group has 2" in message


def test_a_dead_rank_fails_the_run_instead_of_hanging():
    with pytest.raises(RankFailure, match=r"rank 1 of 2 died \(exit code 3\)"):
        spawn_ranks(ring_workers.one_rank_dies, 2, timeout=60)


@pytest.mark.heavy  # suite time (README, "Heavier cases")
def test_a_stuck_rank_fails_at_the_timeout():
    # long enough for rank 0 to start, join and report on a slow day (at 3 s it once missed too)
    with pytest.raises(RankFailure, match=r"ranks \[1\] of 2 did not finish within 10 s"):
        spawn_ranks(ring_workers.one_rank_hangs, 2, timeout=10)


def test_opcheck_on_two_ranks():
    for rank_results in spawn_ranks(ring_workers.opcheck_on_ranks, 2, timeout=TIMEOUT):
        for layout_name, checks in rank_results.items():
            assert checks and all(v == "SUCCESS" for v in checks.values()), (layout_name, checks)


def test_ring_attention_compiles_fullgraph_on_two_ranks():
    for result in spawn_ranks(ring_workers.compiled_call, 2, timeout=TIMEOUT):
        assert result["ring_ops"] == 1
        assert result["out"] < 1e-12 and result["grads"] < 1e-12


@pytest.mark.parametrize("world_size", [2, 3])
def test_fully_masked_queries_on_ranks_give_what_their_model_gives(world_size):
    """Left-padded queries see no key: 0 (SDPA's bool mask), or eager's uniform average with its gradients
    (added finfo.min: into q, k, v; filled: into v), with blocks and dK/dV travelling between processes."""
    for errors in spawn_ranks(ring_workers.fully_masked_on_ranks, world_size, timeout=TIMEOUT):
        assert set(errors) == {"zero", "uniform", "uniform_values"} and max(errors.values()) < 1e-12, errors


@pytest.mark.parametrize("world_size,balanced", [(2, False), (3, False), (2, True), (3, True)])
def test_packed_documents_on_ranks_are_exact_and_skip_the_tiles_of_other_documents(world_size, balanced):
    """``ring_attention(documents=ids)``: two rows packed differently on the zigzag layout, or alike on a
    `DocumentLayout`; out and every gradient of each rank's rows against fp64 attention under the dense documents
    mask; every rank skips tiles no query of its documents sees."""
    for result in spawn_ranks(ring_workers.documents_on_ranks, world_size, (balanced,), timeout=TIMEOUT):
        assert result["error"] < 1e-10 and result["skipped"] > 0, result


@pytest.mark.parametrize("world_size", [2, 3])
def test_documents_each_on_one_rank_send_nothing_and_split_ones_travel(world_size):
    """On a `DocumentLayout` of 18 documents of 20 tokens every document stays whole on one rank: no rank needs
    another's block, so no block, and no dk/dv, is sent (the bytes not sent are counted) and the result is exact;
    ``strategy="all-gather"`` gathers nothing there either (the local pass). A document split over the ranks (the
    155- and 178-token ones) makes every block travel the whole lap, and the all-gather gather (forward, backward)."""
    short = (True, (20,) * 18)
    for strategy in ("ring", "all-gather"):
        for result in spawn_ranks(ring_workers.documents_on_ranks, world_size, (*short, strategy), timeout=TIMEOUT):
            assert result["error"] < 1e-10 and result["sends"] == [] and result["unsent_bytes"] > 0, result
            assert result["gathers"] == 0, (strategy, result)
    for result in spawn_ranks(ring_workers.documents_on_ranks, world_size, (True,), timeout=TIMEOUT):
        assert result["sends"].count("kv") == 2 * (world_size - 1) and result["unsent_bytes"] == 0, result
    long = (True, (1, 7, 155, 178), "all-gather")
    for result in spawn_ranks(ring_workers.documents_on_ranks, world_size, long, timeout=TIMEOUT):
        assert result["error"] < 1e-10 and result["gathers"] == 2, result


def test_two_rings_on_subgroups_of_four_ranks():
    errors = spawn_ranks(ring_workers.rings_on_subgroups, 4, timeout=TIMEOUT)
    assert max(errors) < 1e-12


def test_each_ring_step_is_a_profiler_range():
    """A torch.profiler trace of a ring shows each step's post, compute and wait, forward and backward."""
    names = spawn_ranks(ring_workers.profiled_ring, 2, (), timeout=120)[0]
    for phase in ("forward", "backward"):
        for step in (0, 1):
            assert f"ringpass {phase} step {step}: compute" in names, names
        assert f"ringpass {phase} step 0: post" in names and f"ringpass {phase} step 0: wait" in names
    assert "ringpass forward step 1: wait" not in names  # the last forward step receives nothing


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_that_disagree_on_a_call_by_hand_all_refuse_then_agreeing_calls_run(world_size):
    """Rank 0 passes a 192-token layout, the others a 96-token one: every rank raises the same error naming
    which rank has which layout (not a crash in gloo's traffic). Then the group still works, and each new
    layout is agreed on once: 96 and 40 tokens, not their repeats."""
    others = "rank 1" if world_size == 2 else "ranks 1, 2"
    for rank, result in enumerate(spawn_ranks(ring_workers.disagreeing_layouts, world_size, timeout=120)):
        assert result["refused"] == (
            f"InvalidInputError: The ranks disagree on a ring_attention call: its layout is "
            f"Layout(kind='zigzag', world_size={world_size}, seq_len=192) on rank 0; "
            f"Layout(kind='zigzag', world_size={world_size}, seq_len=96) on {others}. Every rank of the ring must make "
            "the same ring_attention calls, in the same order: the same layout and options, on shards of the same "
            "shape."
        ), (rank, result["refused"])
        mine = 192 if rank == 0 else 96
        assert result["agreements"] == [
            f"Layout(kind='zigzag', world_size={world_size}, seq_len={n})" for n in (mine, 96, 40)
        ], (rank, result["agreements"])
        assert len(result["errors"]) == 5 and max(result["errors"]) < 1e-12, (rank, result["errors"])


def test_by_hand_all_gather_and_ulysses_attention_refuse_ranks_that_disagree():
    """The all-gather and Ulysses strategies called by hand agree on their calls as `ring_attention` does:
    rank 0's 192-token layout against rank 1's 96 raises on both ranks, naming the layouts, and the group then
    runs an agreeing call exactly."""
    for rank, result in enumerate(spawn_ranks(ring_workers.disagreeing_strategies, 2, timeout=120)):
        for function, outcome in result.items():
            assert outcome["refused"] == (
                f"InvalidInputError: The ranks disagree on a {function} call: its layout is "
                "Layout(kind='zigzag', world_size=2, seq_len=192) on rank 0; "
                f"Layout(kind='zigzag', world_size=2, seq_len=96) on rank 1. Every rank of the ring must make the "
                f"same {function} calls, in the same order: the same layout and options, on shards of the same shape."
            ), (rank, function, outcome["refused"])
            assert outcome["error"] < 1e-12, (rank, function, outcome["error"])
