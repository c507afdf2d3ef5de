"""Where a pass replaces a value by its value on this rank's tokens: the readers outside read the tokens, and those
computed whole on every rank read one all-gather of them."""

from __future__ import annotations

import torch
import torch.fx as fx

from ringpass.fx.context import FULL, LOCAL, PassContext
from ringpass.fx.nodes import copy_origin, example_value, nbytes, short_source
from ringpass.fx.report import CollectiveRecord


def read_tokens_instead(ctx: PassContext, node: fx.Node, tokens: fx.Node, readers: list[fx.Node], what: str) -> int:
    """Points ``readers`` of ``node`` at ``tokens`` (``node``'s value as this rank's tokens, placed `LOCAL`), and
    those placed `FULL` at one ``ringpass::gather_sequence`` of it (recorded in the report as ``what``, "read whole"
    added). Returns the bytes a rank sends to that all-gather (0 where no reader reads it whole)."""
    ctx.placement[tokens], ctx.sequence.axes[tokens] = LOCAL, ctx.sequence.axes[node]
    whole, sent = None, 0
    for reader in readers:
        if ctx.placement.get(reader) == FULL and whole is None:  # read whole too: gathered once
            seq_dim = ctx.sequence.axes[node][0].dim
            with ctx.gm.graph.inserting_after(tokens):
                whole = ctx.gm.graph.call_function(
                    torch.ops.ringpass.gather_sequence.default,
                    (tokens, seq_dim, *ctx.layout_args()),
                    ctx.layout_kwargs(),
                )
            copy_origin(whole, node).meta["example_value"] = example_value(node)
            ctx.placement[whole], ctx.sequence.axes[whole] = FULL, ctx.sequence.axes[node]
            size = nbytes(example_value(node))
            sent = size // ctx.world_size
            record = CollectiveRecord("all-gather", "forward", f"{what} and read whole", short_source(node), size)
            ctx.report.collectives.append(record)
        reader.replace_input_with(node, whole if ctx.placement.get(reader) == FULL else tokens)
    return sent
