"""The ring composed with the rest of the parallelism stack on a DeviceMesh (gloo, CPU): FSDP2 and DDP
(gradients exact with the wrapper's reduction as the only one), tensor parallel and Ulysses x ring. Each
case: loss and every parameter gradient of one step against the unsharded model on the global batch, proof
that the ring ran, and the gradient collectives counted. FSDP2 (a hand-written model and a Hugging Face Llama), DDP
with per-rank inputs and the refusals run in the default suite; an explicit grads="reduced", per-rank lengths,
tails and per-block graphs (a second 2-rank spawn) and the 2 x 2 meshes (one 4-rank spawn) with ``-m heavy``."""

from functools import cache

import composition_workers
import pytest

from lowering.errors import NotSupportedError
from lowering.ulysses import check_heads
from ringpass.cli.launch import spawn_ranks

# case -> (the `composition_workers` function, its arguments); a spawn returns each rank's {case: result}
TWO_RANKS = {
    "fsdp2 blocks": ("wrapped_step", ("fsdp2", 1)),
    "fsdp2 root hf": ("wrapped_step", ("fsdp2_root", 1, "auto", "hf_llama")),
    "fsdp2 root hybrid": ("wrapped_step", ("fsdp2_root", 1, "auto", "hf_lfm2")),
    "fsdp2 blocks hybrid": ("wrapped_step", ("fsdp2", 1, "auto", "hf_lfm2")),
    "refused": ("refused", ("fsdp2", "local")),
    "per_rank ddp": ("per_rank_step", ("ddp", 2)),  # DDP's buckets of 1 kB: Dynamo's optimize_ddp would cut the graph
    "per_rank ddp packed": ("per_rank_step", ("ddp", 2, True)),
}
TWO_RANKS_HEAVY = {  # suite time: a second 2-rank spawn, -m heavy
    "fsdp2 reduced": ("wrapped_step", ("fsdp2", 1, "reduced")),
    "per_rank lengths": ("per_rank_lengths", ()),
    "tail none": ("per_rank_tail", ("none",)),
    "tail ddp": ("per_rank_tail", ("ddp",)),
    "blocks ddp": ("per_rank_blocks", ("ddp_blocks",)),
    "blocks fsdp2": ("per_rank_blocks", ("fsdp2_blocks",)),
    "blocks hf fsdp2 padded": ("per_rank_blocks", ("hf_fsdp2_padded",)),
    "fsdp2 blocks scan state": ("wrapped_step", ("fsdp2", 1, "auto", "hf_qwen3_next", {"scans": "state"})),
}
FOUR_RANKS = {
    "fsdp2": ("wrapped_step", ("fsdp2", 2)),
    "ddp": ("wrapped_step", ("ddp", 2)),
    "ddp dp": ("wrapped_step", ("ddp_dp", 2)),
    "tensor parallel": ("tensor_parallel_step", ()),
    "ulysses option": ("ulysses_step", ("llama", "option")),
    "ulysses mesh hf": ("ulysses_step", ("hf_llama", "mesh")),
    # (sequence, query heads, KV heads, causal, layout): GQA, fewer KV heads than U, padding, both layouts
    "ulysses by hand": (
        "ulysses_by_hand",
        (
            [
                (16, 4, 2, True, "zigzag"),
                (13, 4, 1, True, "zigzag"),
                (16, 4, 4, False, "contiguous"),
                (11, 8, 2, True, "contiguous"),
            ],
        ),
    ),
    "hsdp": ("wrapped_step", ("hsdp", 2)),
    "ulysses mesh hf inductor": ("ulysses_step", ("hf_llama", "mesh", "inductor")),
    "ulysses hf modes": ("ulysses_hf_modes", (["left-padded", "packed"],)),
    "per_rank ddp dp": ("per_rank_step", ("ddp_dp", 1)),
    "per_rank ddp": ("per_rank_step", ("ddp", 1)),
    "per_rank fsdp2 root": ("per_rank_step", ("fsdp2_root", 1)),
    "per_rank none": ("per_rank_step", ("none", 1)),
}


@cache
def results(world_size: int, heavy: bool = False) -> list[dict]:
    calls = FOUR_RANKS if world_size == 4 else TWO_RANKS_HEAVY if heavy else TWO_RANKS
    return spawn_ranks(composition_workers.runs, world_size, (calls,), timeout=600)


def check_exact(result: dict) -> None:
    assert result["loss"] <= 1e-5 and result["grads"] <= 1e-4, result
    assert result["kv_exchanges"] > 0, result  # the ring ran


def test_fsdp2_on_the_rings_ranks_takes_the_mean_with_no_other_reduction():
    """fully_shard on every block and the root over the ring's 2 ranks (grads="auto"): each rank's gradient is its
    share x 2, FSDP2's reduce-scatters are the only gradient collectives; a graph per block (FSDP2's hooks break
    the graph), and the root only (one graph, a Hugging Face Llama); a hybrid both ways (Lfm2: its convolution layers
    pass their state between the ranks; with a graph per block, CommDebugMode, which tracks modules, once raised on the
    ring's lifted mask program, a GraphModule called inside the ring op)."""
    for rank in results(2):
        hybrids = (rank["fsdp2 root hybrid"], rank["fsdp2 blocks hybrid"])
        for result in (rank["fsdp2 blocks"], rank["fsdp2 root hf"], *hybrids):
            check_exact(result)
            assert result["gradients"] and set(result["gradients"]) == {"mean"}, result
            assert "FSDP2 over ranks 0, 1" in result["why"][0], result
            # the graphs reduce no gradient; the head, which runs eagerly on the SequenceSharded hidden state
            # after FSDP2's graph break, sums its weight gradient's shares over the ring (`SequenceSharded`'s rule);
            # the hybrid's convolutions send their halos' gradients home ([chunks, batch 2, 32 channels, 2 tokens]: one
            # graph is zigzag under its attention, 4 chunks; a convolution block's own graph is contiguous, 2)
            chunks = {id(hybrids[0]): 4, id(hybrids[1]): 2}.get(id(result))
            halos = [[chunks, 2, 32, 2]] * 2 if chunks else []
            shapes = result["backward_all_reduce_shapes"]
            assert [s for s in shapes if s != result["head_shape"]] == halos, result
            # one reduce-scatter per FSDP2 unit; the all-gathers re-gather resharded blocks' parameters
            assert set(result["collectives"]) <= {"_reduce_scatter_base_", "_allgather_base_"}, result
            assert result["collectives"]["_reduce_scatter_base_"] == result["fsdp_units"], result


@pytest.mark.heavy  # in the second 2-rank spawn
def test_fsdp2_over_a_hybrid_whose_scan_passes_its_state():
    """``fully_shard`` on every block of Qwen3-Next (a graph per block) with ``scans="state"``: the delta rule's block
    runs on this rank's chunks from the state the chunks before them leave, under FSDP2's mean."""
    for rank in results(2, heavy=True):
        result = rank["fsdp2 blocks scan state"]
        check_exact(result)
        assert set(result["gradients"]) == {"mean"}, result
        scans = [m for m in result["mixers"] if m.startswith("state passing: each of this rank's chunks")]
        assert len(scans) == 1 and result["summary_gathers"] >= 1, result


@pytest.mark.heavy  # in the second 2-rank spawn
def test_an_explicit_grads_reduced_under_fsdp2_is_exact_and_says_what_it_costs():
    for rank in results(2, heavy=True):
        result = rank["fsdp2 reduced"]
        check_exact(result)
        assert result["ringpass_all_reduces"] > 0 and "reduces it again" in result["why"][0], result


def test_combinations_that_would_be_wrong_are_refused():
    for rank in results(2):
        assert "grads='local'" in rank["refused"] and "1/2 of the truth" in rank["refused"], rank["refused"]


def test_ddp_with_dynamos_default_optimize_ddp_keeps_the_ring_graph_whole():
    """DDP with buckets small enough that Dynamo's DDPOptimizer would cut the graph into pieces (the per_rank case
    below): the ring's graph arrives whole (one graph, its attentions rewritten), the summary says so."""
    for rank in results(2):
        summary = rank["per_rank ddp"]["summaries"][0]  # the first call's graph (a second length compiles a second)
        assert "2 attention(s) rewritten" in summary and "DDP: kept whole (Dynamo's optimize_ddp" in summary, summary


def test_per_rank_inputs_give_each_rank_its_own_outputs_and_a_data_parallel_jobs_gradients():
    """inputs='per_rank' under DDP, two rows per rank, the ranks' token counts differ: each rank's loss and logits
    are its own batch's, the gradients after DDP's mean DDP's of the ranks' own, the ring ran on every batch.
    (No wrapper, a (dp, cp) mesh, FSDP2: -m heavy.)"""
    for rank in results(2):
        result = rank["per_rank ddp"]
        assert result["loss"] <= 1e-5 and result["logits"] <= 1e-5 and result["grads"] <= 1e-4, result
        assert result["kv_exchanges"] == 2 * 2, result  # 2 attentions x 2 batches, one exchange each at P=2
        assert "inputs='per_rank': each rank's input_ids, labels all-gathered" in result["summaries"][0], result
        assert set(result["gradients"]) == {"mean"}, result


def test_per_rank_packed_rows_run_on_the_documents_layout():
    """TRL's path: inputs='per_rank' under DDP, each rank's two rows packed from documents its own way (position ids
    restarting at each): ``layout="auto"`` takes the documents layout for every rank's batch; each rank's loss and
    logits its own batch's, DDP's gradients, the ring ran."""
    for rank in results(2):
        result = rank["per_rank ddp packed"]
        assert result["loss"] <= 1e-5 and result["logits"] <= 1e-5 and result["grads"] <= 1e-4, result
        assert "layout documents" in result["summaries"][0] and result["kv_exchanges"] > 0, result


@pytest.mark.heavy  # in the second 2-rank spawn
def test_per_rank_batches_of_different_lengths_and_sizes_under_a_dynamic_graph():
    """inputs='per_rank' compiled with dynamic=True under DDP, the ranks' batches of different lengths and row
    counts (padded rows masked): each rank's loss and logits its own batch's, DDP's gradient, the ring ran on both
    batches. A graph compiled for one length, and one whose shape guards break on the other rank's length: the
    same error on every rank, saying what to do."""
    errors = []
    for rank in results(2, heavy=True):
        result = rank["per_rank lengths"]
        assert result["loss"] <= 1e-5 and result["logits"] <= 1e-5 and result["grads"] <= 1e-4, result
        assert result["kv_exchanges"] == 2 * 2, result
        fixed, branch = result["fixed_length"], result["branch_on_length"]
        assert "['torch.int64', 2, 12] on rank 0; ['torch.int64', 3, 9] on rank 1" in fixed, fixed
        assert "Compile with dynamic=True" in fixed, fixed
        assert "rank 0's compiled graph does not take rank 1's batch" in branch and "shape guards" in branch, branch
        errors.append((fixed, branch))
    assert errors[0] == errors[1]


@pytest.mark.heavy  # in the second 2-rank spawn
def test_per_rank_runs_a_tail_that_shifts_the_hidden_states_on_each_ranks_own_batch():
    """inputs='per_rank', a loss that shifts the hidden states by one after the last attention and scores them with
    the embedding's weight (TRL's fused LM head, spelled out): the tail runs once on each rank's own batch (said in
    the summary), the loss is each rank's own, every rank's gradient the data-parallel mean, without a wrapper and
    under DDP (the tied weight trains through both the ring graph and the tail); the ring ran on both batches. A
    token shift between two attentions is still refused on every rank."""
    for rank in results(2, heavy=True):
        for result in (rank["tail none"], rank["tail ddp"]):
            assert result["loss"] <= 1e-5 and result["grads"] <= 1e-4, result
            assert result["kv_exchanges"] == 2 * 2, result  # 2 attentions, each rank's batch
            assert "the tail from `getitem`" in result["summary"], result["summary"]
            assert "runs once on this rank's own batch" in result["summary"], result["summary"]
            assert "cannot run on a sequence-sharded activation" in result["refused"], result["refused"]


@pytest.mark.heavy  # in the second 2-rank spawn
def test_per_rank_across_graph_boundaries_sends_the_activations_by_tokens():
    """inputs='per_rank' with the model cut into graphs: blocks compiled one by one under DDP, FSDP2 on every block
    and the root with the blocks compiled one by one (torchtitan's way), and a Hugging Face Llama under FSDP2 per
    block compiled whole with one rank's rows padded (its mask crosses to the blocks as its description).
    Each rank's loss is its own batch's and the gradients the data-parallel mean; the ring ran on both batches in
    each block; the summary says the hidden states were sent by tokens (not gathered). An eager activation attended
    without a wrapper: its output and the gradient of this rank's own objective as unsharded."""
    for rank in results(2, heavy=True):
        for result in (rank["blocks ddp"], rank["blocks fsdp2"], rank["blocks hf fsdp2 padded"]):
            assert result["loss"] <= 1e-12 and result["grads"] <= 1e-10, result
            assert result["kv_exchanges"] == 2 * 2 * 2, result  # 2 blocks, each rank's batch, forward and backward
            ring_graphs = [s for s in result["summaries"] if "rewritten to ring attention" in s]
            assert ring_graphs and all("(activations) sent by tokens" in s for s in ring_graphs), result["summaries"]
        assert max(rank["blocks ddp"]["activation"]) <= 1e-12, rank["blocks ddp"]["activation"]
        padded = rank["blocks hf fsdp2 padded"]
        assert all("mask(s) crossing" in s for s in padded["summaries"] if "ring attention" in s), padded


@pytest.mark.heavy  # one 4-rank spawn for all of them (~1 min): ./dev test -m heavy
def test_fsdp2_and_ddp_over_data_and_ring_ranks_flattened():
    """A 2 x 2 mesh (dp, cp): FSDP2 / DDP over the four ranks flattened, each replica its own rows; the mean of
    the scaled shares is the gradient of the global batch, the wrapper's reduction the only one."""
    for rank in results(4):
        for result, kind in ((rank["fsdp2"], "FSDP2"), (rank["ddp"], "DDP")):
            check_exact(result)
            assert set(result["gradients"]) == {"mean"} and f"{kind} over ranks 0-3" in result["why"][0], result
            assert all(shape == result["head_shape"] for shape in result["backward_all_reduce_shapes"]), result
        assert rank["fsdp2"]["collectives"]["_reduce_scatter_base_"] == rank["fsdp2"]["fsdp_units"], rank["fsdp2"]
        assert rank["ddp"]["collectives"] == {"allreduce_": 1}, rank["ddp"]  # DDP's one bucket


@pytest.mark.heavy  # one 4-rank spawn for all of them (~1 min): ./dev test -m heavy
def test_hsdp_replicated_over_data_sharded_over_the_ring():
    """fully_shard on the 2-D (dp, cp) mesh: FSDP2 reduce-scatters over cp and all-reduces over dp, a mean over
    all four ranks; the ring adds nothing."""
    for rank in results(4):
        result = rank["hsdp"]
        check_exact(result)
        assert set(result["gradients"]) == {"mean"} and "FSDP2 over ranks 0-3" in result["why"][0], result
        assert all(shape == result["head_shape"] for shape in result["backward_all_reduce_shapes"]), result
        assert result["collectives"]["_reduce_scatter_base_"] == result["fsdp_units"], result


@pytest.mark.heavy  # one 4-rank spawn for all of them (~1 min): ./dev test -m heavy
def test_ddp_over_data_parallel_ranks_only_still_reduces_over_the_ring():
    for rank in results(4):
        result = rank["ddp dp"]
        check_exact(result)
        assert result["gradients"] == ["reduced"] and "data-parallel ranks only" in result["why"][0], result
        assert result["ringpass_all_reduces"] > 0 and result["collectives"] == {"allreduce_": 1}, result


@pytest.mark.heavy  # one 4-rank spawn for all of them (~1 min): ./dev test -m heavy
def test_tensor_parallel_x_ring_rotates_only_each_ranks_own_heads():
    """A Hugging Face Llama with q/k/v, gate/up column-wise and o, down row-wise over ``tp`` (parallelize_module),
    the ring over ``cp`` on a 2 x 2 mesh: exact, and each KV block on the wire holds this rank's one KV head of
    two (2 x batch 2 x 1 head x 6 slots x head dim 8 x 4 bytes)."""
    for rank in results(4):
        result = rank["tensor parallel"]
        check_exact(result)
        assert result["kv_bytes"] == [2 * 2 * 1 * 6 * 8 * 4], result
        # no wrapper: the ring all-reduces each parameter's gradient (a DTensor's local shard) once over cp
        assert result["ringpass_all_reduces"] == result["parameters"], result
        assert (2, 1) in [(a["query_heads"], a["kv_heads"]) for a in result["reports"][0]["attentions"]], result


@pytest.mark.heavy  # one 4-rank spawn for all of them (~1 min): ./dev test -m heavy
def test_ulysses_x_ring_trains_exactly():
    """U = 2 on 4 ranks, by option (groups of neighbours) and by a 2-D mesh: the ring runs over 2 groups (at most one
    KV exchange per layer forward and one backward, not three: none where the other group needs no block of this
    one's), four all-to-alls per layer forward and four back."""
    ranks = results(4)
    for case in ("ulysses option", "ulysses mesh hf", "ulysses mesh hf inductor"):  # the last by Inductor
        assert sum(rank[case]["kv_exchanges"] for rank in ranks) > 0, case  # the ring ran
    for rank in ranks:
        for case in ("ulysses option", "ulysses mesh hf", "ulysses mesh hf inductor"):
            result = rank[case]
            assert result["loss"] <= 1e-5 and result["grads"] <= 1e-4, result
            assert result["kv_exchanges"] <= 2 * 2 and result["all_to_alls"] == 2 * 8, result
            assert result["ringpass_all_reduces"] == result["parameters"], result  # each gradient once, over all 4
            assert (result["report"]["status"], result["report"]["ulysses"]) == ("rewritten", 2), result["report"]


@pytest.mark.heavy  # one 4-rank spawn for all of them (~1 min): ./dev test -m heavy
def test_ulysses_with_padding_packed_documents_and_dynamic_shapes():
    """Hugging Face Llama, left-padded and packed batches (lifted masks on the groups' positions), one dynamic
    compile serving two lengths."""
    for rank in results(4):
        for case, result in rank["ulysses hf modes"].items():
            assert max(result["loss"], result["logits"], result["grads"], result["longer"]) <= 1e-4, (case, result)
            assert result["all_to_alls"] == 2 * 8 and result["later_compiles"] == 0, (case, result)


@pytest.mark.heavy  # one 4-rank spawn for all of them (~1 min): ./dev test -m heavy
def test_ulysses_attention_by_hand_is_exact_in_fp64():
    """(KV exchanges: one forward and one backward per rank, none for a group whose block the other needs not: under a
    contiguous causal mask the later group's.)"""
    ranks = results(4)
    for rank in ranks:
        for case in rank["ulysses by hand"]:
            assert case["out"] < 1e-12 and case["grads"] < 1e-12, case
            assert case["kv_exchanges"] <= 2 and case["all_to_alls"] == 8, case
    for index in range(len(ranks[0]["ulysses by hand"])):  # the ring ran
        assert sum(rank["ulysses by hand"][index]["kv_exchanges"] for rank in ranks) > 0, index


def test_ulysses_refuses_head_counts_it_cannot_split():
    for heads, kv_heads in ((3, 3), (6, 3)):  # query heads U does not divide; KV heads neither divides
        with pytest.raises(NotSupportedError, match="Ulysses groups of 2 ranks"):
            check_heads(heads, kv_heads, 2)
    assert check_heads(4, 2, 2) == 1 and check_heads(8, 1, 4) == 4  # split as they are; one KV head repeated per rank


def test_inspect_and_convert_refuse_ulysses_until_they_describe_it():
    import models
    import torch

    import ringpass

    ids = torch.randint(0, 61, (1, 16))
    with pytest.raises(NotSupportedError, match="inspect: Ulysses x ring is not described offline yet"):
        ringpass.inspect(models.Llama(), ids, world_size=4, ulysses=2)
    with pytest.raises(NotSupportedError, match="convert: Ulysses x ring is not built for converted models yet"):
        ringpass.convert(models.Llama(), ids, world_size=4, ulysses=2)


@pytest.mark.heavy  # in the 4-rank spawn
def test_per_rank_inputs_on_a_data_and_ring_mesh():
    """inputs='per_rank' on a (dp 2, cp 2) mesh, the ring over cp, four ranks with four batches: DDP over the
    data-parallel ranks only (the ring reduces, DDP averages across rings), DDP and FSDP2 (root) over all four
    ranks (the ring's shares scaled for the wrapper's mean), no wrapper (every rank ends with the mean over its
    ring's ranks): each rank's own loss and logits, the data-parallel gradient."""
    for rank in results(4):
        for case, mode in (("ddp dp", "reduced"), ("ddp", "mean"), ("fsdp2 root", "mean"), ("none", "reduced")):
            result = rank[f"per_rank {case}"]
            assert result["loss"] <= 1e-5 and result["logits"] <= 1e-5 and result["grads"] <= 1e-4, result
            assert result["kv_exchanges"] == 2 * 2, result  # 2 attentions x the ring's 2 batches
            assert set(result["gradients"]) == {mode}, result
