"""Rewrite literal sizes of the sequence axis to this rank's length.

Matches ops on this rank's tokens that spell sizes as numbers (``view``, ``reshape``, ``expand``, and
tensors created with a size of the sequence length). With static shapes Dynamo writes the whole
sequence length into them; writes the local length instead (a merged dimension such as batch x
sequence is scaled, not replaced). With ``inputs="sharded"`` the graph already holds local sizes and
nothing changes.
"""

from __future__ import annotations

from ringpass.passes.context import LOCAL, PassContext
from ringpass.passes.sequence_axes import is_size_op, resize_size_args


def localize_shapes(ctx: PassContext) -> None:
    if ctx.local_len == ctx.seq_len:
        return
    for node in ctx.gm.graph.nodes:
        if ctx.placement.get(node) != LOCAL:
            continue
        if is_size_op(node):
            node.args = resize_size_args(node, ctx.axes[node.args[0]], ctx.local_len, ctx.seq_len)
        elif ctx.sources.get(node) == "created":
            node.args = _created_args(ctx, node)


def _created_args(ctx: PassContext, node):
    """``torch.zeros(B, N, H)`` / ``x.new_zeros((B, N, H))`` with N at a sequence dim -> the local length."""
    seq_dims = {a.dim for a in ctx.axes[node]}
    first = 1 if node.op == "call_method" else 0  # x.new_zeros(...) carries the tensor first
    args = list(node.args)
    if isinstance(args[first], (list, tuple)):  # zeros((B, N, H)), full((B, N), value)
        sizes = list(args[first])
        for d in seq_dims:
            sizes[d] = ctx.local_len
        args[first] = type(args[first])(sizes)
    else:  # zeros(B, N, H)
        for d in seq_dims:
            args[first + d] = ctx.local_len
    return tuple(args)
