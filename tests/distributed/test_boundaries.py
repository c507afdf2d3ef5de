"""The sequence stays sharded across graph boundaries (`ringpass.SequenceSharded`, ``outputs="auto"``).

Each recipe a training stack runs trains one step of `models.Llama` (fp64, 13 tokens: padding slots on every layout)
and must equal the unsharded model (loss, logits and every parameter gradient within 1e-10), run the ring (KV
exchanges counted), all-gather no sequence values (counted: `lowering.record_ring_events`) and, where the audit runs
(per-block recipes: every op; whole-model compiles: the ops of the compiled graphs), allocate no activation of the
whole sequence x hidden. A plain-ids run proves the audit and the count can fail. One spawn of 2 ranks runs them all;
4 ranks with ``-m heavy``."""

from functools import cache

import boundary_workers
import pytest
import torch
import torch.fx as fx

from lowering.sequence_mask import register_recipe
from ringpass import NeedsWholeSequence, SequenceMask
from ringpass.cli.launch import spawn_ranks

SEQ_LEN = 13
RECIPES = ("per_block", "checkpoint", "checkpoint_reentrant", "graph_break", "fsdp2", "dynamic")
TIMEOUT = 400


# Hugging Face models: hf_<family>_<how>[_<variant>] (`boundary_workers.hf_recipe`); masks cross as SequenceMask
HF = ("hf_llama_layers", "hf_llama_fsdp2_left-padded", "hf_qwen2_break_packed")
HF_HEAVY = (  # (suite time: HF's dynamic recipes compile each graph a few times on the first step)
    "hf_qwen2_break_packed+dynamic",
    "hf_qwen2_layers_checkpointed",  # (the default suite checkpoints compiled blocks in the recipes above)
    "hf_llama-eager_fsdp2",  # HF's eager attention builds a float causal mask from positions alone
    "hf_qwen2_fsdp2_packed",
    "hf_llama_break_left-padded",
    "hf_llama_fsdp2_checkpointed+left-padded",
    "hf_llama_fsdp2_left-padded+dynamic",
    "hf_qwen2_layers_dynamic",
)


@cache
def _results(
    world_size: int,
    names=("eager", *RECIPES, "per_block_plain_ids", "mask_across_a_break", *HF, "hf_llama_layers_left-padded"),
):
    return spawn_ranks(boundary_workers.recipes, world_size, (names, SEQ_LEN), timeout=TIMEOUT)


@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.heavy)])
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_keeps_the_sequence_sharded_between_graphs(world_size, recipe):
    for rank, results in enumerate(_results(world_size)):
        result = results[recipe]
        assert result["loss"] <= 1e-10 and result["logits"] <= 1e-10, (rank, result)
        assert result["grads"] <= 1e-10, (rank, result)
        assert result["kv_exchanges"] > 0, (rank, result)  # the ring ran
        assert result["all_gathers"] == [], (rank, result)  # nothing gathered between the graphs
        assert result["audit"] == [], (rank, result)  # no activation of the whole sequence x hidden
        assert result["logits_type"] == "SequenceSharded"
        if recipe == "dynamic":  # one compile serves both blocks and another length
            assert result["compiles"] == 1 and result["longer"] <= 1e-10, (rank, result)


@pytest.mark.timeout(TIMEOUT + 60)
def test_the_audit_and_the_gather_count_see_a_whole_activation():
    """Plain token ids: the eager embedding makes the whole [B, N, H] on every rank, and the first block's boundary
    gathers its gradient. The numbers are still exact."""
    for rank, results in enumerate(_results(2)):
        result = results["per_block_plain_ids"]
        assert any("embedding" in found for found in result["audit"]), (rank, result)
        assert [tuple(shape) for shape in result["all_gathers"]] == [(2, 8, 32)], (rank, result)
        assert result["loss"] <= 1e-10 and result["grads"] <= 1e-10, (rank, result)


@pytest.mark.timeout(TIMEOUT + 60)
def test_eager_code_on_a_sharded_value_follows_its_rules_or_gathers_with_a_warning():
    for rank, results in enumerate(_results(2)):
        result = results["eager"]
        assert result["type"] == "SequenceSharded" and result["shape"] == [2, SEQ_LEN, 5], result
        assert result["local"] == [2, 8, 5], result  # zigzag over 2 ranks: 4 chunks of 4 slots, 3 of them padding
        for key in ("loss", "logits", "grads", "picked", "dtensor", "cumsum"):
            assert result[key] <= 1e-12, (rank, key, result[key])
        assert result["argmax"], rank
        assert ("this rank's 8 of 13 tokens" in result["repr"]) == (rank == 0)  # printed on rank 0 alone: no hang


@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize("name", [*HF, *(pytest.param(n, marks=pytest.mark.heavy) for n in HF_HEAVY)])
def test_hugging_face_training_recipes(name):
    """Layers compiled one by one (HF's causal path without padding passes no mask), FSDP2 per layer and root, a
    graph break in every layer; with HF's gradient checkpointing, left padding, packed documents, dynamic shapes
    (two lengths, one compile of each graph). A padding or document mask is built in the model's first graph and
    crosses to each layer's graph as its per-token description (no S x S tensor anywhere). fp32: within 1e-4."""
    results = _results(2, HF_HEAVY) if name in HF_HEAVY else _results(2)
    for rank, per_name in enumerate(results):
        result = per_name[name]
        assert "refused" not in result, (rank, result)
        assert result["loss"] <= 1e-4 and result["logits"] <= 1e-4 and result["grads"] <= 1e-4, (rank, result)
        assert result["kv_exchanges"] > 0 and result["all_gathers"] == [], (rank, result)
        assert result["logits_type"] == "SequenceSharded"
        if "dynamic" in name:  # the second length ran the graphs compiled for the first
            assert all("sequence 13," in line for line in result["summaries"] if "sequence" in line), result
        crossing = [line for line in result["masks"] if "per-token description" in line]
        if "padded" in name or "packed" in name or "eager" in name:  # built in one graph, taken by the next
            assert any(line.startswith("output") for line in crossing), (rank, result["masks"])
            assert any("arrives as its per-token description" in line for line in crossing), (rank, result["masks"])
        else:
            assert crossing == [], (rank, result["masks"])


@pytest.mark.timeout(TIMEOUT + 60)
def test_a_mask_that_a_graph_attends_with_crosses_to_the_next_as_its_description():
    """The first graph builds a causal padding mask, attends with it, and returns it described (its [B, S] padding
    mask, gathered nowhere); the next graph attends with it again. fp64: within 1e-10."""
    for rank, results in enumerate(_results(2)):
        result = results["mask_across_a_break"]
        assert result["loss"] <= 1e-10 and result["grads"] <= 1e-10, (rank, result)
        assert result["kv_exchanges"] > 0 and result["all_gathers"] == [], (rank, result)
        (first, first_masks), (second, second_masks) = result["reports"]
        assert first == 1 and len(first_masks) == 1 and first_masks[0].startswith("output"), result["reports"]
        assert second == 1 and "arrives as its per-token description" in second_masks[0], result["reports"]


@pytest.mark.timeout(TIMEOUT + 60)
def test_a_padding_mask_made_outside_the_compiled_graphs_is_refused_with_the_reason():
    """Layers compiled one by one: HF builds the 4-D mask eagerly, so it reaches each layer's graph S x S."""
    for results in _results(2):
        refused = results["hf_llama_layers_left-padded"]["refused"]
        assert "needs input `attention_mask`, a sequence x sequence tensor" in refused, refused
        assert "built outside the graphs the ring compiles" in refused and "torch.compile(model" in refused, refused


def _causal_and_kept(keep, n):  # a recipe as a graph writes one: per-token values (and a length) in, the mask out
    idx = torch.arange(n)
    return (idx[None, :] <= idx[:, None])[None, None] & keep[:, None, None, :]


@pytest.mark.parametrize("n", [6, 9])
def test_a_sequence_mask_is_its_description_until_asked_for_the_whole_mask(n):
    """`full_tensor()` builds the mask the recipe describes (one recipe for every length: its length is the padding
    mask's size); printing shows the description; eager ops are refused with what to call, detach keeps the
    description; a compiler tracing it (AOT) traces the recipe."""
    keep = torch.arange(n)[None, :] >= torch.tensor([[2], [0]])  # row 0 padded on the left
    program = fx.symbolic_trace(_causal_and_kept, concrete_args=None)
    key = register_recipe(program, torch.bool, sizes=[(0, 1)], shape=(2, 1, (0, 1), (0, 1)), source="here")
    mask = SequenceMask([keep], key)
    assert mask.shape == (2, 1, n, n) and mask.dtype == torch.bool
    expected = torch.ones(n, n, dtype=torch.bool).tril() & keep[:, None, None, :]
    assert torch.equal(mask.full_tensor(), expected)
    assert f"SequenceMask(shape=(2, 1, {n}, {n}), dtype=bool, built from [(2, {n}) bool]" in repr(mask)
    assert type(mask.detach()) is SequenceMask and torch.equal(mask.detach().full_tensor(), expected)
    with pytest.raises(NeedsWholeSequence, match=r"call \.full_tensor\(\) for the whole mask"):
        mask.logical_not()
    torch._dynamo.reset()
    counted = torch.compile(lambda m: m.sum(), backend="aot_eager", fullgraph=True)(mask)
    assert int(counted) == int(expected.sum())
