"""Decide where every value lives: the whole sequence on every rank, or this rank's tokens.

Matches the findings of `find_sequence_axes` (after `find_local_permutations` took ops off ``ctx.sequence.mixing``).
The scores, probabilities and masks of hand-written attention, and what only feeds them, are taken off
``ctx.sequence.axes`` and ``ctx.sequence.mixing`` first (the rewrite removes them). A value with a sequence axis is
*local* (this rank's tokens, in layout order) unless an op that moves information between tokens needs it whole:
then it and its sequence-carrying ancestors are *full* (run on every rank, which is fine for per-token vectors such
as labels and position ids). Such an op on a value that comes out of attention cannot be sharded and is refused. The
values of a function call computed whole (``ctx.sequence.regions``: a chunked scan) are *full* too, while the values
it reads stay local (`gather_whole_regions` all-gathers them). A
reduction over the sequence of a local value is *partial* (summed over the ranks at the boundary). Values without a
sequence axis are replicated (*noseq*).

Writes ``ctx.placement`` (a `Placement` for every node), the report's inputs (sharded, kept whole and why,
replicated) and values computed whole; raises on a token-mixing op over a sharded activation, and, with
``inputs="sharded"``, on one that needs the whole sequence of a sharded activation input (a sharded
per-token vector, ``[B, N]`` labels, a padding mask or segment ids, or what a lifted mask program
reads, goes to ``ctx.gathered_inputs`` instead: every rank all-gathers it); so does an input that arrived
sequence-sharded from another graph (``ctx.carried_inputs``) and is needed whole.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ringpass.fx.context import FULL, LOCAL, NOSEQ, PARTIAL, PassContext
from ringpass.fx.nodes import describe, example_value, is_module_state, nbytes, plain, refusal, user_name
from ringpass.fx.report import ValueRecord


def decide_placements(ctx: PassContext) -> None:
    for node in replaced_by_ring(ctx):  # scores, probabilities and masks of hand-written attention
        ctx.sequence.mixing.pop(node, None)
        ctx.sequence.axes.pop(node, None)
    for match in ctx.attention:  # `probs @ v` sums over the keys: the ring does that
        ctx.sequence.mixing.pop(match.output, None)
    needs_full = _needs_full(ctx)
    after_attention = downstream_of([m.output for m in ctx.attention])
    mixer_inputs = {m.output: m.input for m in ctx.mixers}
    computed_whole = {node for region in ctx.sequence.regions for node in region.internal}
    for node in ctx.gm.graph.nodes:
        if node in computed_whole or node is ctx.document_ids:
            # a function call run on the whole sequence (its entries are all-gathered), or the document ids the
            # documents layout is planned from
            ctx.placement[node] = FULL
        elif node in ctx.sequence.reductions and any(ctx.placement.get(a) == LOCAL for a in node.all_input_nodes):
            ctx.placement[node] = PARTIAL
        elif not ctx.has_sequence(node):
            ctx.placement[node] = NOSEQ
        elif node in needs_full or node in ctx.sequence.mixing:
            ctx.placement[node] = FULL
            _check_full(ctx, node, needs_full.get(node, node), after_attention)
        elif node in mixer_inputs and ctx.placement.get(mixer_inputs[node]) == FULL:
            ctx.placement[node] = FULL  # a sequence mixer on a value computed whole: computed whole too
        elif _element_of_whole_tuple(ctx, node):
            # an element of a tuple computed whole (`sort`'s values, its indices needed whole)
            ctx.placement[node] = FULL
        else:
            ctx.placement[node] = LOCAL
    _record(ctx, needs_full)


def _element_of_whole_tuple(ctx: PassContext, node: fx.Node) -> bool:
    source = node.args[0] if node.target is operator.getitem else None
    return ctx.placement.get(source) == FULL and isinstance(example_value(source), (tuple, list))


def _record(ctx: PassContext, needs_full: dict) -> None:
    """The report's inputs (sharded, kept whole and why, replicated) and the values computed whole."""
    whole_ops: dict[str, None] = {}
    computed_whole = {node for region in ctx.sequence.regions for node in region.internal}
    for node in ctx.gm.graph.nodes:
        placement, value = ctx.placement.get(node), example_value(node)
        if node.op == "placeholder" and not is_module_state(node) and isinstance(value, torch.Tensor):
            carried = "exchanged" if node in ctx.exchanged_inputs else "carried"
            kind = {LOCAL: carried if node in ctx.carried_inputs else "sharded", FULL: "whole"}.get(
                placement, "replicated"
            )
            needed_by = needs_full.get(node, node)
            why = (
                ""
                if kind != "whole"
                else (
                    "the documents layout is planned from it"
                    if node is ctx.document_ids
                    else "read by the ring's mask program"
                    if needed_by in ctx.masks.whole_values
                    else f"read by {describe(needed_by)}"
                )
            )
            dim = ctx.sequence.axes[node][0].dim if kind != "replicated" else None
            ctx.report.inputs.append(
                ValueRecord(
                    user_name(node),
                    [plain(s) for s in value.shape],
                    str(value.dtype).replace("torch.", ""),
                    kind,
                    dim,
                    why,
                    nbytes(value),
                )
            )
        elif placement == FULL and node.op != "placeholder" and node not in computed_whole:
            whole_ops[user_name(node)] = None  # (a function call computed whole is a mixer of the report's)
    ctx.report.computed_whole = list(whole_ops)


def replaced_by_ring(ctx: PassContext) -> set[fx.Node]:
    """Nodes that only feed the inside of an attention or of a sequence mixer: they disappear with the rewrite."""
    gone = {n for m in ctx.attention for n in m.internal if n is not m.output} | ctx.masks.lifted
    gone |= {n for m in ctx.mixers for n in m.internal}  # a convolution's longer output
    operands = {n for m in ctx.attention for n in (m.query, m.key, m.value)} | ctx.masks.whole_values
    operands |= {n for m in ctx.mixers for n in (m.input, m.weight, m.bias) if n is not None}
    changed = True
    while changed:
        changed = False
        for node in ctx.gm.graph.nodes:
            if (
                node not in gone
                and node not in operands
                and node.op != "placeholder"
                and node.users
                and all(u in gone for u in node.users)
            ):
                gone.add(node)
                changed = True
    return gone


def _needs_full(ctx: PassContext) -> dict[fx.Node, fx.Node]:
    """Sequence-carrying inputs of token-mixing ops and their sequence-carrying ancestors -> the op."""
    needed: dict[fx.Node, fx.Node] = {}
    stack = [(a, op) for op in ctx.sequence.mixing for a in op.all_input_nodes if ctx.has_sequence(a)]
    stack += [(value, value) for value in ctx.masks.whole_values if ctx.has_sequence(value)]  # read whole by the ring
    mixer_inputs = {m.output: [m.input] for m in ctx.mixers}  # (a convolution's output reads it through the conv)
    while stack:
        node, op = stack.pop()
        if node in needed:
            continue
        needed[node] = op
        stack += [(a, op) for a in mixer_inputs.get(node, node.all_input_nodes) if ctx.has_sequence(a)]
    return needed


def downstream_of(roots: list[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack += list(node.users)
    return seen


def _check_full(ctx: PassContext, node: fx.Node, mixing_op: fx.Node, after_attention: set[fx.Node]) -> None:
    why = ctx.sequence.mixing.get(mixing_op, "it needs the whole sequence")
    if node in after_attention:
        raise refusal(
            f"{describe(mixing_op)} cannot run on a sequence-sharded activation: {why}. Only attention and the "
            "sequence mixers ringpass passes state for (causal depthwise convolutions, cumulative sums: "
            "docs/backend.md) may mix the tokens of sharded activations; move this op onto per-token inputs before "
            "attention, or compile this part of the model without the ring backend. (After the last attention, with "
            "each rank passing its own batch, inputs='per_rank' runs such an op on that rank's own values: "
            "docs/training.md.)",
            mixing_op,
        )
    if node in ctx.carried_inputs:  # arrived sequence-sharded from another graph: all-gathered (the report says so)
        ctx.gathered_inputs.add(node)
        return
    if ctx.options.inputs == "sharded" and node.op == "placeholder":
        if mixing_op in ctx.masks.whole_values or example_value(node).dim() <= 2:  # per-token vectors: all-gathered
            ctx.gathered_inputs.add(node)
            return
        raise refusal(
            f"Input {user_name(node)} is passed sharded (inputs='sharded') but {describe(mixing_op)} needs "
            f"the whole sequence ({why}); pass full inputs (inputs='full') instead.",
            mixing_op,
        )
