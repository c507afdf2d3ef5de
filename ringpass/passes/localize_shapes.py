"""Rewrite literal sizes of the sequence axis to this rank's length.

Matches ops on this rank's tokens that spell sizes as numbers (``view``, ``reshape``, ``expand``, and tensors created
with a size of the sequence length), and slices that take the whole sequence at the traced length (``x[:, -N:]``:
spelled ``:``, which takes a shard's whole length, even one padded longer than N). With static shapes Dynamo writes the
whole sequence length into them; writes the local length instead (a merged dimension such as batch x sequence is scaled,
not replaced). With ``inputs="sharded"`` the graph already holds local sizes and nothing changes. With dynamic shapes
the sizes are SymInt inputs instead: uses of the sequence-length input (arithmetic on it, and ``torch.Size`` tuples of
it such as ``x.size()[:-1] + (nf,)``) in local ops get the local length, computed in the graph.

Also matches, with ``inputs="sharded"``, values kept whole on every rank that the graph creates from its (local) length:
an ``arange(n)`` or a ``torch.ones(B, n)`` padding mask that a lifted mask program reads at global positions. Writes the
global length into their sizes, so they cover every position.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ringpass.fx.context import FULL, LOCAL, PassContext
from ringpass.fx.nodes import example_value
from ringpass.fx.sizes import is_size_op, resize_size_args
from ringpass.fx.token_ops import whole_slices_spelled

ARITHMETIC = (operator.add, operator.sub, operator.mul, operator.floordiv, operator.truediv, operator.mod)


def localize_shapes(ctx: PassContext) -> None:
    if ctx.options.inputs == "sharded":
        _globalize_whole_sources(ctx)
    local = ctx.insert_length("local")
    if not ctx.dynamic and local == ctx.sequence.seq_len:
        return
    twins: dict[fx.Node, fx.Node] = {}
    for node in list(ctx.gm.graph.nodes):
        if ctx.placement.get(node) != LOCAL:
            continue
        if is_size_op(node):
            node.args = resize_size_args(node, ctx.sequence.axes[node.args[0]], local, ctx.sequence.seq_len)
        elif ctx.sequence.sources.get(node) == "created":
            node.args = _created_args(ctx, node, local)
        elif node.target is operator.getitem and ctx.sequence.axes.get(node.args[0]):
            axes, shape = ctx.sequence.axes[node.args[0]], example_value(node.args[0]).shape
            node.args = (node.args[0], whole_slices_spelled(node.args[1], shape, axes))
            continue
        else:
            continue  # other uses of the length (x / n, arange(1, n + 1)) keep the global length
        if ctx.dynamic and ctx.options.inputs == "full":
            for arg in node.all_input_nodes:
                twin = _local_twin(ctx, arg, twins)
                if twin is not arg:
                    node.replace_input_with(arg, twin)


def _local_twin(ctx: PassContext, node: fx.Node, twins: dict) -> fx.Node:
    """Dynamic shapes: the local counterpart of a SymInt computed from the sequence length input."""
    if node in ctx.sequence.length_nodes:
        return ctx.insert_length("local")
    if node in twins:
        return twins[node]
    twin = node
    value = node.meta.get("example_value")
    arithmetic = node.target in ARITHMETIC and isinstance(value, torch.SymInt)
    if node.op == "call_function" and (arithmetic or node.target is torch.Size):  # n - 1; Size([B, n, H])
        args = fx.node.map_arg(node.args, lambda a: _local_twin(ctx, a, twins))
        if args != node.args:
            with ctx.gm.graph.inserting_after(node):
                twin = ctx.gm.graph.call_function(node.target, args)
    twins[node] = twin
    return twin


def _globalize_whole_sources(ctx: PassContext) -> None:
    for node, kind in ctx.sequence.sources.items():
        if ctx.placement.get(node) != FULL or kind not in ("positions", "created"):
            continue
        length = ctx.insert_length("global")
        if kind == "created":
            node.args = _created_args(ctx, node, length)
        else:  # arange(n) or arange(0, n[, 1])
            node.args = (length,) if len(node.args) == 1 else (node.args[0], length, *node.args[2:])


def _created_args(ctx: PassContext, node, local):
    """``torch.zeros(B, N, H)`` / ``x.new_zeros((B, N, H))`` / ``torch.zeros(ids.size())`` with N at a sequence
    dim -> the local length."""
    seq_dims = {a.dim for a in ctx.sequence.axes[node]}
    first = 1 if node.op == "call_method" else 0  # x.new_zeros(...) carries the tensor first
    args = list(node.args)
    if isinstance(args[first], fx.Node) and isinstance(example_value(args[first]), tuple):  # zeros(ids.size())
        size, rank = args[first], example_value(node).dim()
        with ctx.gm.graph.inserting_before(node):
            args[first] = tuple(
                local if d in seq_dims else ctx.gm.graph.call_function(operator.getitem, (size, d)) for d in range(rank)
            )
    elif isinstance(args[first], (list, tuple)):  # zeros((B, N, H)), full((B, N), value)
        sizes = list(args[first])
        for d in seq_dims:
            sizes[d] = local
        args[first] = type(args[first])(sizes)
    else:  # zeros(B, N, H)
        for d in seq_dims:
            args[first + d] = local
    return tuple(args)
