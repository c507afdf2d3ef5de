"""Replace every attention with ring attention over this rank's tokens.

Matches ``ctx.attention`` (found by `find_attention`, masks planned by `lift_masks`). Writes a call of
``ringpass::ring_attention`` on the local q, k, v (GQA/MQA keys and values stay at their own head count:
only those heads travel) with the layout, the mask plan (causal flag, window, mask program id and its
whole inputs), the scale (1/sqrt(head_dim) when the model gave none) and the process group by name, and
removes the SDPA call or the hand-written attention's nodes. 3-D single-head attention gains a head axis
around the call.
"""

from __future__ import annotations

import math
import operator

import torch

from lowering.errors import NotSupportedError
from ringpass.graph import describe, example_value, source_line
from ringpass.passes.context import LOCAL, PassContext


def rewrite_attention(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    for match in ctx.attention:
        q = example_value(match.query)
        for operand in (match.query, match.key, match.value):
            axes = ctx.axes.get(operand, ())
            if ctx.placement.get(operand) != LOCAL or [a.dim % q.dim() for a in axes] != [q.dim() - 2]:
                raise NotSupportedError(
                    f"Attention {describe(match.output)}: its {operand.name} does not carry the sequence on the "
                    "second-to-last axis; ringpass expects q, k, v as [batch, heads, sequence, head_dim]."
                )
        scale = match.scale if match.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        plan = ctx.masks[match.output]
        with graph.inserting_before(match.output):
            operands = [match.query, match.key, match.value]
            if q.dim() == 3:
                operands = [graph.call_method("unsqueeze", (t, 1)) for t in operands]
            ring = graph.call_function(
                torch.ops.ringpass.ring_attention.default,
                (*operands, ctx.layout_kind, ctx.world_size, ctx.graph_length("global"), plan.is_causal, float(scale),
                 ctx.group_name, plan.window, plan.program_id, list(plan.inputs)),
            )
            out = graph.call_function(operator.getitem, (ring, 0))
            if q.dim() == 3:
                out = graph.call_method("squeeze", (out, 1))
        match.output.replace_all_uses_with(out)
        ctx.placement[out] = LOCAL
        ctx.axes[out] = ctx.axes[match.output]
        graph.erase_node(match.output)
        mask = plan.describe()
        heads = f"{q.shape[1]} query / {example_value(match.key).shape[1]} key-value heads"
        ctx.report.attention.append(f"{match.spelling} ({mask}, scale {scale:.4g}, {heads}) -> ringpass::ring_attention at {source_line(match.output)}")
    graph.eliminate_dead_code()  # the rest of hand-written attentions
