"""Run each function call that keeps its heads apart on every token of this rank's share of the heads.

Matches the `WholeRegion`\\ s with a `HeadSplit` (`find_region_heads`: a chunked scan such as Mamba2's
``mamba2_chunk_scan``). Writes, before the call's first node: ``ringpass::sequence_to_heads`` after each entry that
holds this rank's tokens and has a head dim (one all-to-all: every token of H / P heads), ``ringpass::gather_sequence``
after one with no head dim (read whole: Mamba2's ``B`` and ``C`` with fewer groups than heads; its gradient, each
rank's heads' share, is all-reduced: `reduce_grad`), and
``ringpass::own_heads`` after a whole entry with a head dim (a per-head parameter narrowed to this rank's heads);
``own_heads`` after each node inside the call whose output is the first with a head dim (``B`` repeated to every
head); the head sizes the call's ops spell, divided by P; and ``ringpass::heads_to_sequence`` after each exit (the
all-to-all back to this rank's tokens of every head), which its readers outside the call read instead (a reader
computed whole on every rank reads it all-gathered).

The call's nodes and the inserted ones become `HEADS` (every token of this rank's heads: their gradients are this
rank's share, which `reduce_grads` sums over the ranks); the exchanged exits are `LOCAL`. Each call's `MixerRecord`
(bytes a rank sends per call) and each collective's `CollectiveRecord` go to the report. The calls without a
`HeadSplit` stay for `gather_whole_regions`.
"""

from __future__ import annotations

import torch
import torch.fx as fx

import lowering.head_exchange  # noqa: F401  (registers the ops written here)
from lowering.sequence_ops import reduce_grad
from ringpass.fx.context import HEADS, LOCAL, PassContext
from ringpass.fx.findings import HeadSplit, WholeRegion
from ringpass.fx.nodes import copy_origin, example_value, module_path, nbytes, plain, short_source, user_name
from ringpass.fx.report import CollectiveRecord, MixerRecord
from ringpass.fx.sharded_reads import read_tokens_instead

STRATEGY = (
    "split by heads: every token of {share} of its {heads} heads (a dim it keeps apart) on each rank, "
    "all-to-all in and out"
)


def split_region_heads(ctx: PassContext) -> None:
    for region in ctx.sequence.regions:
        split = ctx.sequence.heads[region]
        if isinstance(split, HeadSplit):
            _split(ctx, region, split)


def _split(ctx: PassContext, region: WholeRegion, split: HeadSplit) -> None:
    graph, first, internal = ctx.gm.graph, region.internal[0], set(region.internal)
    ops = torch.ops.ringpass
    sent = 0
    for entry, head_dim in split.entries.items():
        local = ctx.placement.get(entry) == LOCAL
        if local:
            seq_dim = ctx.sequence.axes[entry][0].dim
            op, kind, args = (
                (ops.gather_sequence.default, "all-gather", (seq_dim,))
                if head_dim is None
                else (ops.sequence_to_heads.default, "all-to-all", (seq_dim, head_dim))
            )
            args += ctx.layout_args()
        elif head_dim is not None:
            op, kind, args = ops.own_heads.default, "", (head_dim, ctx.world_size, ctx.group_name)
        else:
            continue
        with graph.inserting_before(first):
            read = _insert(ctx, op, (entry, *args), first)
            if head_dim is None:  # each rank's heads give it a share of the gradient: summed over the ranks
                read = _insert(ctx, reduce_grad, (read, ctx.group_name), first)
                what = f"the gradient of {user_name(entry)}, read whole by `{region.function}` (split by heads)"
                ctx.report.collectives.append(
                    CollectiveRecord("all-reduce", "backward", what, short_source(first), nbytes(example_value(entry)))
                )
        for user in [u for u in entry.users if u in internal]:
            user.replace_input_with(entry, read)
        if kind:
            size = nbytes(example_value(entry))
            sent += (
                size // ctx.world_size * (ctx.world_size - 1) // ctx.world_size
                if kind == "all-to-all"
                else size // ctx.world_size
            )
            what = f"{user_name(entry)}, read by `{region.function}` (split by heads)"
            ctx.report.collectives.append(CollectiveRecord(kind, "forward", what, short_source(first), size))
    for node, spelled in split.respelled.items():
        node.args = spelled
    for node, head_dim in split.narrowed.items():
        users = list(node.users)
        with graph.inserting_after(node):
            narrowed = _insert(ctx, ops.own_heads.default, (node, head_dim, ctx.world_size, ctx.group_name), node)
        for user in users:
            user.replace_input_with(node, narrowed)
    for node, (seq_dim, head_dim) in split.exits.items():
        outside = [u for u in node.users if u not in internal]
        with graph.inserting_after(node):
            tokens = _insert(ctx, ops.heads_to_sequence.default, (node, seq_dim, head_dim, *ctx.layout_args()), node)
        size = nbytes(example_value(node))
        sent += size // ctx.world_size * (ctx.world_size - 1) // ctx.world_size
        what = f"{user_name(node)}, returned by `{region.function}` (split by heads)"
        ctx.report.collectives.append(CollectiveRecord("all-to-all", "forward", what, short_source(node), size))
        sent += read_tokens_instead(ctx, node, tokens, outside, f"{user_name(node)}, returned by `{region.function}`")
    for node in region.internal:
        ctx.placement[node] = HEADS
    strategy = STRATEGY.format(share=split.heads // ctx.world_size, heads=split.heads)
    if region in ctx.sequence.states:  # scans="state", and no binding
        strategy += f" (state not passed: {ctx.sequence.states[region]})"
    record = MixerRecord(
        module_path(first), region.call_site, f"`{region.function}`: {region.why}", strategy, plain(sent)
    )
    ctx.report.mixers.append(record)


def _insert(ctx: PassContext, op, args: tuple, origin: fx.Node) -> fx.Node:
    """``op(*args)`` at the graph's insertion point, holding the traced value of ``args[0]`` (a pass's view of a
    value: its traced shape), on this rank's heads."""
    node = ctx.gm.graph.call_function(op, args)
    copy_origin(node, origin).meta["example_value"] = example_value(args[0])
    ctx.placement[node] = HEADS
    return node
