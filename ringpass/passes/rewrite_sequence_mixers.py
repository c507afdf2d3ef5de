"""Run every sequence mixer other than attention on this rank's tokens, passing state between the ranks.

Matches ``ctx.mixers`` (`find_sequence_mixers`) whose input is sharded (a mixer whose input is computed whole, because
another op needs it whole, stays as it is: it runs whole on every rank). Writes ``ringpass::causal_conv1d`` in place of
a causal depthwise convolution and its slice, ``ringpass::sequence_cumsum`` in place of a cumsum along the sequence
(`lowering.sequence_mixers`: each chunk of this rank's tokens gets the chunks before it summarised by one all-gather,
O(state) bytes per rank, independent of the sequence's length), with the layout and the process group by name. Each
mixer's `MixerRecord` goes to the report, with the bytes a rank sends per call.
"""

from __future__ import annotations

import torch

from lowering.layout import Layout
from ringpass.fx.context import LOCAL, PassContext
from ringpass.fx.findings import MixerMatch
from ringpass.fx.nodes import copy_origin, example_value, module_path, plain, remove_dead_code, source_line
from ringpass.fx.report import MixerRecord


def rewrite_sequence_mixers(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    for match in ctx.mixers:
        record = MixerRecord(module_path(match.output), source_line(match.output), match.describe(), "")
        ctx.report.mixers.append(record)
        if ctx.placement.get(match.input) != LOCAL:
            record.strategy = "computed whole on every rank (its input is needed whole)"
            continue
        if match.kind == "causal_conv1d" and match.width == 1:
            record.strategy = "on this rank's tokens alone (width 1: no token before is read)"
        layout = (ctx.layout_kind, ctx.world_size, ctx.insert_length("global"), ctx.group_name)
        with graph.inserting_before(match.output):
            if match.kind == "causal_conv1d":
                args = (match.input, match.weight, match.bias, *layout)
                mixer = graph.call_function(torch.ops.ringpass.causal_conv1d.default, args)
            else:
                mixer = graph.call_function(
                    torch.ops.ringpass.sequence_cumsum.default, (match.input, match.dim, *layout)
                )
        copy_origin(mixer, match.output).meta["example_value"] = example_value(match.output)
        ctx.placement[mixer] = LOCAL
        ctx.sequence.axes[mixer] = ctx.sequence.axes[match.output]
        match.output.replace_all_uses_with(mixer)
        graph.erase_node(match.output)
        for node in match.internal:
            graph.erase_node(node)
        if not record.strategy:
            record.strategy, record.bytes_per_call = _state_passing(ctx, match)
    remove_dead_code(graph)


def _state_passing(ctx: PassContext, match: MixerMatch) -> tuple[str, int]:
    """What the mixer's all-gather carries, and its bytes per rank per call (at the traced shapes)."""
    x = example_value(match.input)
    layout = Layout(ctx.layout_kind, ctx.world_size, plain(ctx.sequence.global_seq_len))
    chunks = len(layout.chunks(0))
    others = x.numel() // plain(x.shape[match.dim])  # the summary of one chunk: every value but the sequence's
    if match.kind == "causal_conv1d":
        tokens = min(match.width - 1, layout.chunk_len)
        what = f"state passing: the last {match.width - 1} token(s) of each chunk before, all-gathered"
        return what, plain(chunks * others * tokens * x.element_size())
    return "state passing: each chunk's total, all-gathered", plain(chunks * others * x.element_size())
