"""Give every rank the global positions of its own tokens.

Matches sources of the sequence axis that hold positions and run on this rank's tokens: an
``arange(seq_len)`` (RoPE angles, learned position embeddings, position ids), and a slice ``table[:seq_len]``
of a position table (a learned position parameter). Writes ``ringpass::local_positions`` in place of the
arange (cast to its dtype) and ``table.index_select(dim, local_positions)`` in place of the slice, so
position-dependent values are computed for exactly this rank's tokens, in layout order. The new node takes
over the old one's example value, placement and sequence axes; the report lists each rewrite (``positions``).
"""

from __future__ import annotations

import torch

from ringpass.fx.context import LOCAL, PassContext
from ringpass.fx.nodes import copy_origin, example_value, source_line, user_name
from ringpass.fx.sizes import same, value_of


def rewrite_positions(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    for node, kind in list(ctx.sequence.sources.items()):
        if ctx.placement.get(node) != LOCAL or kind not in ("positions", "sliced"):
            continue
        value = example_value(node)
        with graph.inserting_before(node):
            positions = graph.call_function(
                torch.ops.ringpass.local_positions.default, (*ctx.layout_args(), value.device), ctx.layout_kwargs()
            )
            if kind == "positions":
                new = positions if value.dtype == torch.int64 else graph.call_method("to", (positions, value.dtype))
            else:
                new = graph.call_method(
                    "index_select", (_unsliced(ctx, node), ctx.sequence.axes[node][0].dim, positions)
                )
        what = "arange" if kind == "positions" else f"slice of {user_name(node.args[0])}"
        ctx.report.positions.append(f"{what} -> this rank's positions ({source_line(node)})")
        new.meta["example_value"] = value  # later passes read the (global) shape of what it replaces
        copy_origin(new, node)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        ctx.placement[new] = LOCAL
        ctx.sequence.axes[new] = ctx.sequence.axes.pop(node)


def _unsliced(ctx: PassContext, node):
    """``table[..., :n, ...]`` -> ``table[..., :, ...]`` (only the sequence slice is replaced)."""
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    rest = tuple(
        slice(None) if isinstance(i, slice) and same(value_of(i.stop), ctx.sequence.seq_len) else i for i in index
    )
    if all(i == slice(None) for i in rest):
        return node.args[0]
    return ctx.gm.graph.call_function(node.target, (node.args[0], rest))
