"""Where sharded and whole values meet: shard inputs, sum partial results, gather outputs.

Matches edges between placements:
- with ``inputs="sharded"``, a sharded per-token input needed whole (labels before a shift, a padding
  mask a mask program reads): writes ``ringpass::gather_sequence`` after it, so every reader sees the
  whole vector (readers on this rank's tokens shard it again);
- a whole value (an input, or a value a token-mixing op produced) read by an op on this rank's tokens:
  writes ``ringpass::shard_sequence`` (once per value) on that edge;
- a reduction over the sequence of local values: ``sum`` becomes the all-reduced local sum, ``mean`` the
  all-reduced local sum over the global count, a pick of a few tokens (``x[:, 0]``) the all-reduced rows
  of the ranks that hold them (`lowering.sequence_ops.take_positions`), ``cross_entropy(reduction="mean")``
  the all-reduced sum of token losses over the all-reduced count of counted tokens (``ignore_index``
  honoured); padding slots are masked out of all of them;
- a local graph output: ``ringpass::gather_sequence`` (with ``outputs="gathered"``); with ``outputs="auto"`` it
  stays this rank's tokens and goes to ``ctx.carried_outputs`` (the backend returns it as a `SequenceSharded`),
  except an attention's keys or values (a KV cache a prefill returns, for decode steps that hold it whole: gathered
  as before), every output with ``cache="gathered"``, and every output under Ulysses x ring (its groups' token
  order is not one `SequenceSharded` carries yet);
- an input that arrived sequence-sharded (``ctx.carried_inputs``): no collective (it is this rank's tokens
  already); its readers read ``narrow(input, dim, 0, local length).contiguous()``, the input itself at run time.
Records every inserted collective (bytes per call) and every graph output with its placement in the report.
The inserted nodes get placements and sequence axes in ``ctx``; all-reduced totals go to ``ctx.totals``
(`reduce_grads` makes their gradient whole) and a gathered input that a mask program reads to
``ctx.masks.whole_values``.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from lowering.compat import pytree
from lowering.layout import DOCUMENTS_KIND, Layout
from ringpass.fx.context import FULL, LOCAL, NOSEQ, PARTIAL, PassContext
from ringpass.fx.findings import SeqDim
from ringpass.fx.gradient_reach import writes_in_place, written
from ringpass.fx.nodes import copy_origin, describe, example_value, nbytes, plain, refusal, short_source, user_name
from ringpass.fx.report import CollectiveRecord, ValueRecord
from ringpass.fx.sizes import same
from ringpass.fx.static_shapes import needs_static_shapes
from ringpass.fx.token_ops import pick_index, positions_index


def insert_boundaries(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    padded = (  # (a documents layout's ranks hold as many real tokens as the call's packing gives each)
        ctx.dynamic
        or ctx.layout_kind == DOCUMENTS_KIND
        or Layout(ctx.layout_kind, ctx.world_size, ctx.sequence.global_seq_len).padded_len
        != ctx.sequence.global_seq_len
    )
    shards: dict[fx.Node, fx.Node] = {}
    for node in list(graph.nodes):
        placement = ctx.placement.get(node)
        if node in ctx.carried_inputs:
            _take_carried(ctx, node, placement)
        elif node.op == "placeholder" and placement == LOCAL and ctx.options.inputs == "full":
            _shard_all_uses(ctx, node)
        if node in ctx.gathered_inputs:
            _gather_all_uses(ctx, node)
        elif placement in (LOCAL, PARTIAL):
            reads_programs_inputs = node.target is torch.ops.ringpass.ring_attention.default
            for arg in node.all_input_nodes:  # the ring's mask and bias programs read their inputs whole
                if ctx.placement.get(arg) == FULL and not (reads_programs_inputs and arg in ctx.masks.whole_values):
                    node.replace_input_with(arg, _shard(ctx, arg, shards))
        if placement == PARTIAL:
            _all_reduce(ctx, node, padded)
    _gather_outputs(ctx)


def _take_carried(ctx: PassContext, placeholder: fx.Node, placement) -> None:
    """An input that arrived sequence-sharded is this rank's tokens already, if the graph reads it along the same
    dimension: its readers get ``narrow(input, dim, 0, local length).contiguous()``, which is the input itself at
    run time and says, on the traced (whole) value, what the graph computes on (the passes' fake runs)."""
    dim = ctx.carried_inputs[placeholder]
    found = [axis.dim for axis in ctx.sequence.axes.get(placeholder, ())]
    if placement not in (LOCAL, FULL) or found != [dim]:
        raise refusal(
            f"Input {user_name(placeholder)} arrives sharded along dim {dim}, but this graph reads its sequence "
            f"along {found or 'no dimension'}; call .full_tensor() on it before this call.",
            placeholder,
        )
    if placement == FULL:  # needed whole: `_gather_all_uses` gathers it
        return
    users, length, graph = list(placeholder.users), ctx.insert_length("local"), ctx.gm.graph
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_after(length) if isinstance(length, fx.Node) else graph.inserting_before(first_op):
        narrowed = graph.call_function(torch.narrow, (placeholder, dim, 0, length))
    with graph.inserting_after(narrowed):
        local = graph.call_method("contiguous", (narrowed,))
    copy_origin(local, placeholder).meta["example_value"] = example_value(placeholder)
    ctx.placement[local], ctx.sequence.axes[local] = LOCAL, ctx.sequence.axes[placeholder]
    for user in users:
        user.replace_input_with(placeholder, local)


def _shard_dim(ctx: PassContext, node: fx.Node) -> int:
    axes = ctx.sequence.axes[node]
    if len(axes) != 1 or not axes[0].aligned or not same(example_value(node).shape[axes[0].dim], ctx.sequence.seq_len):
        raise refusal(
            f"{describe(node)} would have to be sharded or gathered along a sequence axis merged with others "
            "(e.g. batch x sequence flattened); keep the sequence a dimension of its own there, "
            "or use outputs='sharded'.",
            node,
        )
    return axes[0].dim


def _shard_node(ctx: PassContext, node: fx.Node) -> fx.Node:
    dim = _shard_dim(ctx, node)
    shard = copy_origin(
        ctx.gm.graph.call_function(
            torch.ops.ringpass.shard_sequence.default, (node, dim, *ctx.layout_args()), ctx.layout_kwargs()
        ),
        node,
    )
    shard.meta["example_value"] = example_value(node)  # the full value's metadata (dtype, rank) for later passes
    ctx.placement[shard] = LOCAL
    ctx.sequence.axes[shard] = ctx.sequence.axes[node]
    _record_shard(ctx, node)
    return shard


def _shard_all_uses(ctx: PassContext, placeholder: fx.Node) -> None:
    length = ctx.length_of_input()  # the input's full length stays full
    users = [u for u in placeholder.users if u is not length]
    first_op = next(n for n in ctx.gm.graph.nodes if n.op != "placeholder")  # after every input (sizes too)
    with ctx.gm.graph.inserting_before(first_op):
        shard = _shard_node(ctx, placeholder)
    if ctx.document_ids is not None:  # which the shard reads
        ctx.document_ids.append(shard)
    for user in users:
        user.replace_input_with(placeholder, shard)


def _gather_all_uses(ctx: PassContext, placeholder: fx.Node) -> None:
    users = list(placeholder.users)
    args = (placeholder, ctx.sequence.axes[placeholder][0].dim, *ctx.layout_args())
    order = {n: i for i, n in enumerate(ctx.gm.graph.nodes)}
    with ctx.gm.graph.inserting_after(
        max((a for a in args if isinstance(a, fx.Node)), key=order.get)
    ):  # after the length
        whole = copy_origin(
            ctx.gm.graph.call_function(torch.ops.ringpass.gather_sequence.default, args, ctx.layout_kwargs()),
            placeholder,
        )
    whole.meta["example_value"] = example_value(placeholder)
    ctx.placement[whole], ctx.sequence.axes[whole] = FULL, ctx.sequence.axes[placeholder]
    if placeholder in ctx.masks.whole_values:  # the ring's programs read the gathered vector, not a shard of it
        ctx.masks.whole_values.add(whole)
    for user in users:
        user.replace_input_with(placeholder, whole)
    ctx.report.collectives.append(
        CollectiveRecord(
            "all-gather",
            "forward",
            f"input {user_name(placeholder)} (passed sharded, needed whole)",
            short_source(placeholder),
            nbytes(example_value(placeholder)) * (1 if placeholder in ctx.carried_inputs else ctx.world_size),
        )
    )


def _shard(ctx: PassContext, node: fx.Node, shards: dict) -> fx.Node:
    """This rank's tokens of a whole value, taken once, after the last op that writes the value in place (an
    unrolled recurrence filling ``out[:, t] = state`` step by step: RecurrentGemma)."""
    if node not in shards:
        graph = ctx.gm.graph
        writers = [n for n in graph.nodes if writes_in_place(n) and node in written(n)]
        with graph.inserting_after(_after_document_ids(ctx, writers[-1] if writers else node)):
            shards[node] = _shard_node(ctx, node)
    return shards[node]


def _after_document_ids(ctx: PassContext, node: fx.Node) -> fx.Node:
    """``node``, or the host copy of the document ids where that comes later (the documents layout's sequence ops
    read it: `read_document_ids` put it after the inputs and what the ids are computed from)."""
    if ctx.document_ids is None:
        return node
    for current in ctx.gm.graph.nodes:
        if current is ctx.document_ids:
            return node
        if current is node:
            return ctx.document_ids
    return node


def _record_shard(ctx: PassContext, node: fx.Node) -> None:
    """Sharding is free forward; a value that needs a gradient gathers it in the backward."""
    value = example_value(node)
    if getattr(value, "requires_grad", False):
        ctx.report.collectives.append(
            CollectiveRecord(
                "all-gather",
                "backward",
                f"the gradient of {user_name(node)} (sharded here)",
                short_source(node),
                nbytes(value),
            )
        )


def _token_mask(ctx: PassContext, like: fx.Node, axis: SeqDim) -> fx.Node:
    """A bool tensor that broadcasts against ``like``: False at this rank's padding slots."""
    graph = ctx.gm.graph
    value = example_value(like)
    mask = graph.call_function(
        torch.ops.ringpass.local_token_mask.default, (*ctx.layout_args(), value.device), ctx.layout_kwargs()
    )
    if not same(value.shape[axis.dim], ctx.sequence.seq_len):  # a merged (outer x sequence x inner) dimension
        mask = graph.call_method("view", (mask, 1, -1, 1))
        size = graph.call_method("size", (like, axis.dim))
        tokens = graph.call_function(operator.mul, (ctx.insert_length("local"), axis.inner))
        outer = graph.call_function(operator.floordiv, (size, tokens))
        mask = graph.call_method("expand", (mask, outer, -1, axis.inner))
        mask = graph.call_method("reshape", (mask, -1))
    shape = [1] * value.dim()
    shape[axis.dim] = -1
    return graph.call_method("view", (mask, *shape))


def _masked(ctx: PassContext, before: fx.Node, arg: fx.Node, fill) -> fx.Node:
    """``where(token_mask, arg, fill)``, inserted before ``before``."""
    with ctx.gm.graph.inserting_before(before):
        mask = _token_mask(ctx, arg, ctx.sequence.axes[arg][0])
        return ctx.gm.graph.call_function(torch.where, (mask, arg, fill))


def _all_reduce(ctx: PassContext, node: fx.Node, padded: bool) -> None:
    graph = ctx.gm.graph
    kind = ctx.sequence.reductions[node]
    users = list(node.users)
    if kind == "cross_entropy":
        total = _cross_entropy(ctx, node, padded)
    elif kind == "pick":
        total = _pick(ctx, node)
    else:
        local_input = next(a for a in node.all_input_nodes if ctx.placement.get(a) == LOCAL)
        if padded:
            node.replace_input_with(local_input, _masked(ctx, node, local_input, 0.0))
        with graph.inserting_before(node.next):
            total = _global_sum(ctx, node, local_input, kind)
    for user in users:
        user.replace_input_with(node, total)
    total.meta["example_value"] = example_value(node)
    copy_origin(total, node)
    ctx.totals.add(total)
    if not node.users:
        graph.erase_node(node)
    ctx.placement[total] = NOSEQ


def _reduce(ctx: PassContext, tensor: fx.Node, origin: fx.Node, what: str, size: int) -> fx.Node:
    """``all_reduce_sum(tensor)`` standing for ``origin``, recorded in the report (``size`` bytes per call)."""
    reduced = ctx.gm.graph.call_function(torch.ops.ringpass.all_reduce_sum.default, (tensor, ctx.group_name))
    ctx.report.collectives.append(CollectiveRecord("all-reduce", "forward", what, short_source(origin), size))
    return copy_origin(reduced, origin)


def _global_sum(ctx: PassContext, node: fx.Node, local_input: fx.Node, kind: str) -> fx.Node:
    graph, size = ctx.gm.graph, nbytes(example_value(node))
    if kind == "sum":
        return _reduce(ctx, node, node, "the sum over the sequence", size)
    # mean: local mean x local count, summed, over the global count (counts measured at run time)
    local_count = graph.call_function(
        operator.floordiv, (graph.call_method("numel", (local_input,)), graph.call_method("numel", (node,)))
    )
    reduced = _reduce(
        ctx, graph.call_function(operator.mul, (node, local_count)), node, "the mean over the sequence (as a sum)", size
    )
    per_token = graph.call_function(operator.floordiv, (local_count, ctx.insert_length("local")))
    global_count = graph.call_function(operator.mul, (per_token, ctx.insert_length("global")))
    return graph.call_function(operator.truediv, (reduced, global_count))


def _pick(ctx: PassContext, node: fx.Node) -> fx.Node:
    """``x[:, 0]`` / ``x[:, -4:]`` on this rank's tokens: the rows at those global positions where this rank
    holds them (zero elsewhere), summed over the ranks: every rank has them, for their bytes alone."""
    seq_dims = lambda a: {axis.dim for axis in ctx.sequence.axes.get(a, ())}  # noqa: E731
    if pick_index(node, seq_dims) is None:
        return _pick_at_data_positions(ctx, node, positions_index(node, seq_dims))
    dim, index = pick_index(node, seq_dims)
    if isinstance(index, int):
        positions = [index]
    elif ctx.dynamic:
        positions = _last_positions(index)
        if positions is None:
            raise needs_static_shapes(
                ctx,
                f"{describe(node)} picks a slice of tokens whose length depends on the sequence length; "
                "with dynamic shapes only single positions (x[:, 0], x[:, -1]) and the last tokens "
                "(x[:, -4:]) are supported. Compile with dynamic=False.",
                f"{describe(node)} picks a slice of tokens whose length depends on the sequence length",
                node,
            )
    else:
        positions = list(range(*index.indices(plain(ctx.sequence.global_seq_len))))
    graph = ctx.gm.graph
    with graph.inserting_before(node):
        rows = graph.call_function(
            torch.ops.ringpass.take_positions.default,
            (node.args[0], dim, positions, *ctx.layout_args()),
            ctx.layout_kwargs(),
        )
        if isinstance(index, int):
            rows = graph.call_method("squeeze", (rows, dim))
        return _reduce(
            ctx,
            rows,
            node,
            f"the token(s) at position(s) {positions} picked by every rank",
            nbytes(example_value(node)),
        )


def _last_positions(index: slice):
    """``x[:, -k:]`` (``-k:-j``, a positive step): the positions counted from the end, whatever the length;
    else None."""
    start, stop, step = index.start, index.stop, 1 if index.step is None else index.step
    if not (
        isinstance(start, int)
        and start < 0
        and (stop is None or isinstance(stop, int) and start <= stop < 0)
        and isinstance(step, int)
        and step > 0
    ):
        return None
    return list(range(start, 0 if stop is None else stop, step))


def _pick_at_data_positions(ctx: PassContext, node: fx.Node, entry: int) -> fx.Node:
    """``x[i0, .., positions, ..]`` (positions: global, a replicated tensor): the same index on this rank's
    slots (`position_slots`), rows it does not hold zeroed, summed over the ranks."""
    graph = ctx.gm.graph
    source, index = node.args[0], list(node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],))
    trailing = example_value(source).dim() - len(index)
    with graph.inserting_before(node):
        slots = graph.call_function(
            torch.ops.ringpass.position_slots.default, (index[entry], *ctx.layout_args()), ctx.layout_kwargs()
        )
        index[entry] = graph.call_function(operator.getitem, (slots, 0))
        held = graph.call_function(operator.getitem, (slots, 1))
        rows = graph.call_function(operator.getitem, (source, tuple(index)))
        held = graph.call_function(operator.getitem, (held, (Ellipsis, *[None] * trailing)))
        rows = graph.call_function(torch.where, (held, rows, graph.call_method("new_zeros", (rows, ()))))
        return _reduce(
            ctx, rows, node, "the tokens at data-dependent positions picked by every rank", nbytes(example_value(node))
        )


def _cross_entropy(ctx: PassContext, node: fx.Node, padded: bool) -> fx.Node:
    """sum of token losses / number of counted tokens, both summed over the ranks."""
    graph = ctx.gm.graph
    args = node.normalized_arguments(ctx.gm, normalize_to_only_use_kwargs=True).kwargs
    if args.get("weight") is not None or args.get("label_smoothing", 0.0):
        raise refusal(
            f"{describe(node)}: cross_entropy with class weights or label smoothing is not supported yet.", node
        )
    target, ignore = args["target"], args.get("ignore_index", -100)
    if ctx.placement.get(target) != LOCAL or example_value(target).dtype.is_floating_point:
        raise refusal(f"{describe(node)}: the cross-entropy target must be per-token class indices.", node)
    if padded:
        target = _masked(ctx, node, target, ignore)
    with graph.inserting_before(node):
        token_sum = graph.call_function(
            F.cross_entropy, (args["input"], target), {"ignore_index": ignore, "reduction": "sum"}
        )
        loss = _reduce(ctx, token_sum, node, "the cross-entropy loss sum", nbytes(example_value(node)))
        if args.get("reduction", "mean") == "sum":
            return loss
        counted = graph.call_method("sum", (graph.call_function(operator.ne, (target, ignore)),))
        count = _reduce(ctx, counted, node, "the cross-entropy count of counted tokens", 8)  # an int64 count
        return graph.call_function(operator.truediv, (loss, count))


def _gather_outputs(ctx: PassContext) -> None:
    """Gathers this rank's tokens of local outputs (``outputs="gathered"``) or leaves them to be carried
    (``"auto"``); records every output, numbered by its position among the graph's outputs."""
    output = next(n for n in ctx.gm.graph.nodes if n.op == "output")
    gathered: dict[fx.Node, fx.Node] = {}
    caches = {node for match in ctx.attention for node in (match.key, match.value)}  # a KV cache a prefill returns
    carries = ctx.options.outputs == "auto" and ctx.options.cache != "gathered" and not ctx.ulysses
    describing = {i for mask in ctx.mask_outputs.values() for i in mask.crossings}  # a mask's description leaves whole
    for index, arg in enumerate(pytree.tree_leaves(output.args[0])):
        value, placement = (example_value(arg), ctx.placement.get(arg)) if isinstance(arg, fx.Node) else (None, None)
        if not isinstance(value, torch.Tensor):
            continue
        kind = {LOCAL: "sharded", FULL: "whole"}.get(placement, "replicated")
        dim = _shard_dim(ctx, arg) if placement == LOCAL else None
        shape, size = [plain(s) for s in value.shape], nbytes(value)
        if dim is not None and ctx.options.inputs == "sharded":  # the graph saw one rank's length
            shape[dim], size = shape[dim] * ctx.world_size, size * ctx.world_size
        if placement == LOCAL and carries and arg not in caches and index not in describing:
            kind = "assembled" if ctx.per_rank else "carried"  # per_rank: `PerRankGraph` assembles it for its owner
            ctx.carried_outputs[index] = dim
        elif placement == LOCAL and ctx.options.outputs != "sharded":
            kind = "gathered"
            if arg not in gathered:
                with ctx.gm.graph.inserting_before(output):
                    gathered[arg] = copy_origin(
                        ctx.gm.graph.call_function(
                            torch.ops.ringpass.gather_sequence.default,
                            (arg, dim, *ctx.layout_args()),
                            ctx.layout_kwargs(),
                        ),
                        arg,
                    )
                output.replace_input_with(arg, gathered[arg])
                ctx.placement[gathered[arg]] = FULL
                ctx.report.collectives.append(
                    CollectiveRecord(
                        "all-gather",
                        "forward",
                        f"output {index} (outputs='auto' keeps each rank's tokens instead)",
                        short_source(arg),
                        size,
                    )
                )
        ctx.report.outputs.append(
            ValueRecord(
                f"output {index}",
                shape,
                str(value.dtype).replace("torch.", ""),
                kind,
                dim,
                f"from {user_name(arg)}",
                size,
            )
        )
