"""The ring backend's passes, in the stages they run in. Each pass is one file and one function
``(PassContext) -> None`` whose docstring says what it matches and what it writes. `run_pipeline` runs them
for every front end (the backend, `ringpass.inspect`, `ringpass.convert`):

- ``prepare`` (`PREPARE`): remove the values nothing reads, spell tensor properties one way (torch 2.13's and
  2.15's captures differ), record the gradient paths, write out what Dynamo wraps (subgraphs, model numbers,
  ``nn.MultiheadAttention``, vmapped masks), find the attentions and the other sequence mixers (causal convolutions,
  cumsums). Then, by what was found:
- a graph without attention or sequence mixer: nothing more; it runs unchanged (replicated) on every rank, unless an
  input arrives sequence-sharded (a `SequenceSharded` from another ring graph): then it is a prefill without attention;
- decode steps (fewer queries than keys: against a KV cache; `DECODE`): attended where the cache lies;
  nothing else in the graph is sharded;
- else the prefill (`PREFILL`): ``analyse`` (masks, sequence axes, strategy, layout, placements), ``shard`` (positions,
  sizes, attention and boundaries rewritten for this rank's tokens) and ``gradients``.
- ``check`` (`CHECK`), always last: no rewrite may cut a gradient path.

`ringpass.fx.runner` numbers and logs the passes, and checks and writes the graph after each one
when asked (``RINGPASS_CHECK_PASSES=1``, ``RINGPASS_DEBUG_DIR=dir``)."""

import torch

from lowering import compat
from lowering.errors import NotSupportedError
from lowering.layout import local_length
from ringpass.fx.chains import op_chain
from ringpass.fx.context import FULL, HEADS, LOCAL, PassContext
from ringpass.fx.nodes import example_value, nbytes, op_label, plain, short_source
from ringpass.fx.report import Refusal
from ringpass.fx.runner import PassRunner, Stage
from ringpass.passes.check_gradient_paths import check_gradient_paths
from ringpass.passes.choose_layout import choose_layout
from ringpass.passes.choose_strategy import RunsWhole, choose_strategy
from ringpass.passes.devectorize_vmaps import devectorize_vmaps
from ringpass.passes.exchange_activations import exchange_activations
from ringpass.passes.expand_multi_head_attention import expand_multi_head_attention
from ringpass.passes.find_attention import find_attention
from ringpass.passes.find_region_heads import find_region_heads
from ringpass.passes.find_scan_states import find_scan_states
from ringpass.passes.find_sequence_mixers import find_sequence_mixers
from ringpass.passes.gather_whole_regions import gather_whole_regions
from ringpass.passes.inline_subgraphs import inline_subgraphs
from ringpass.passes.insert_boundaries import insert_boundaries
from ringpass.passes.invert_permutations import invert_permutations
from ringpass.passes.keep_cache_sharded import keep_cache_sharded
from ringpass.passes.lift_masks import lift_masks
from ringpass.passes.local_permutations import find_local_permutations
from ringpass.passes.localize_shapes import localize_shapes
from ringpass.passes.pass_scan_states import pass_scan_states
from ringpass.passes.pin_model_numbers import pin_model_numbers
from ringpass.passes.placements import decide_placements
from ringpass.passes.read_document_ids import read_document_ids
from ringpass.passes.record_gradient_paths import record_gradient_paths
from ringpass.passes.reduce_grads import reduce_grads
from ringpass.passes.remove_unread_values import remove_unread_values
from ringpass.passes.rewrite_attention import rewrite_attention
from ringpass.passes.rewrite_decode_attention import is_decode_step, rewrite_decode_attention
from ringpass.passes.rewrite_positions import rewrite_positions
from ringpass.passes.rewrite_sequence_mixers import rewrite_sequence_mixers
from ringpass.passes.sequence_axes import find_sequence_axes
from ringpass.passes.sharded_lengths import globalize_sharded_lengths
from ringpass.passes.spell_properties_as_attributes import spell_properties_as_attributes
from ringpass.passes.split_region_heads import split_region_heads
from ringpass.passes.split_tail import split_tail

PREPARE = Stage(
    "prepare",
    (
        remove_unread_values,
        spell_properties_as_attributes,
        record_gradient_paths,
        inline_subgraphs,
        pin_model_numbers,
        expand_multi_head_attention,
        devectorize_vmaps,
        find_attention,
        find_sequence_mixers,
    ),
)
PREFILL = (
    Stage(
        "analyse",
        (
            exchange_activations,
            lift_masks,
            invert_permutations,
            find_sequence_axes,
            choose_strategy,
            choose_layout,
            globalize_sharded_lengths,
            find_local_permutations,
            split_tail,
            decide_placements,
            find_region_heads,
            find_scan_states,
            keep_cache_sharded,
        ),
    ),
    # from the whole sequence to this rank's tokens: the graph computes its values again after the last
    Stage(
        "shard",
        (
            read_document_ids,
            rewrite_positions,
            localize_shapes,
            rewrite_attention,
            rewrite_sequence_mixers,
            pass_scan_states,
            split_region_heads,
            gather_whole_regions,
            insert_boundaries,
        ),
        runs_between_passes=False,
    ),
    Stage("gradients", (reduce_grads,)),
)
DECODE = Stage("decode", (rewrite_decode_attention,))
CHECK = Stage("check", (check_gradient_paths,))
PIPELINE = tuple(run_pass for stage in (PREPARE, *PREFILL, CHECK) for run_pass in stage.passes)  # a prefill's passes


def run_pipeline(ctx: PassContext) -> None:
    """Every stage on ``ctx.gm``, in order; the graph stays unchanged when it has no attention. A refusal
    is recorded in the report, with the chain of ops from the attention to the blocking op, and raised
    with that chain added to its message. The passes' runs on fake values save nothing through a user's
    saved-tensor hooks (a non-reentrant checkpoint around the first call counts what its forward saves)."""
    with torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
        _run_stages(ctx)


def _keep(tensor):
    return tensor


def _run_stages(ctx: PassContext) -> None:
    report, runner = ctx.report, PassRunner(ctx)
    try:
        runner.run(PREPARE)
        if not ctx.attention and not ctx.mixers and not ctx.carried_inputs:
            report.unchanged = "no attention found"
            report.warnings.append("no attention in this graph: it runs unchanged (replicated) on every rank")
            stages = ()
        elif any(is_decode_step(m) for m in ctx.attention):
            if ctx.carried_inputs:
                raise NotSupportedError(
                    "A decode step against a KV cache that the prefill returned sequence-sharded (SequenceSharded "
                    "keys and values in a DynamicCache): decode against a sharded cache with ringpass.ShardedCache "
                    "(or ringpass.generate), or compile with cache='gathered' to hold the cache whole on every rank."
                )
            stages = (DECODE,)
        else:
            stages = PREFILL
        for stage in (*stages, CHECK):
            runner.run(stage)
    except RunsWhole:  # strategy="auto" chose no sequence parallelism: the backend compiles the graph as captured
        return
    except NotSupportedError as error:
        node = getattr(error, "node", None)
        chain = op_chain(ctx.gm, [m.output for m in ctx.attention], node) if node is not None else []
        report.refusal = Refusal(
            str(error),
            op_label(node) if node is not None else "",
            short_source(node) if node is not None else "",
            chain,
        )
        if len(chain) > 1:
            error.args = (f"{error}\nChain of ops between the attention and the blocking op: {' -> '.join(chain)}",)
        raise
    if stages is PREFILL:
        report.layout, report.seq_len = ctx.layout_kind, plain(ctx.sequence.global_seq_len)
        report.activation_bytes = _activation_bytes(ctx)


def _activation_bytes(ctx: PassContext) -> dict:
    """Bytes of the values the graph computes on this rank's tokens (per rank, and the same values at full
    length), and of the values computed whole on every rank; each value counted once, views (which own
    no memory) not at all."""
    traced_length, global_length = plain(ctx.sequence.seq_len), plain(ctx.sequence.global_seq_len)
    local = local_length(ctx.layout_kind, ctx.world_size, global_length)
    per_rank = unsharded = whole = 0
    for node, placement in ctx.placement.items():
        value = example_value(node)
        if node.op == "placeholder" or not isinstance(value, torch.Tensor) or compat.is_view(value):
            continue
        if placement == LOCAL:
            per_rank += nbytes(value) * local // traced_length
            unsharded += nbytes(value) * global_length // traced_length
        elif placement == HEADS:  # every token of H / P heads
            per_rank += nbytes(value) // ctx.world_size
            unsharded += nbytes(value)
        elif placement == FULL:
            whole += nbytes(value)
    return {"per_rank": per_rank, "unsharded": unsharded, "whole": whole}
