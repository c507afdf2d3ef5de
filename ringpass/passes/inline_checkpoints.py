"""Open activation-checkpoint regions, so the other passes see the attention and activations inside.

Matches ``torch.ops.higher_order.tag_activation_checkpoint(body, *args)``: what Dynamo makes of
``torch.utils.checkpoint.checkpoint`` and of Hugging Face's ``gradient_checkpointing_enable()`` (reentrant
or not). Writes the body's nodes into the graph in place of the call (its placeholders become the call's
arguments, the ``getitem``s of its result the body's outputs), each tagged as the checkpoint HOP tags
them (``recompute = PREFER_RECOMPUTE``, one ``ac_graph_id`` per region), and removes the body's attribute.

The tags travel through AOTAutograd's tracing to the aten graph, whose partitioner recomputes the region
in the backward as checkpointing would, except what `rewrite_attention` marks ``MUST_SAVE``: the ring
attention's out and LSE, so the backward never repeats a forward ring (its communication) and the
attention's backward reads the saved LSE. Each rank keeps 1/P of what checkpointing keeps. (The inner
compiler ``"eager"`` runs no partitioner: there the region's activations are kept.)
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ringpass.graph import describe, refusal
from ringpass.passes.context import PassContext

CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint
REGION_IDS = 1 << 20  # ac_graph_id of the opened regions, apart from Dynamo's own


def inline_checkpoints(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    calls = [n for n in graph.nodes if n.op == "call_function" and n.target is CHECKPOINT]
    for region, call in enumerate(calls):
        body_attr = call.args[0]
        body: fx.GraphModule = getattr(ctx.gm, body_attr.target)
        env = dict(zip([n for n in body.graph.nodes if n.op == "placeholder"], call.args[1:]))
        with graph.inserting_before(call):
            for node in body.graph.nodes:
                if node.op == "output":
                    results = fx.node.map_arg(node.args[0], env.__getitem__)
                elif node.op != "placeholder":
                    env[node] = graph.node_copy(node, env.__getitem__)
                    env[node].meta.update(recompute=CheckpointPolicy.PREFER_RECOMPUTE, ac_graph_id=REGION_IDS + region)
        for user in list(call.users):
            if user.target is not operator.getitem:
                raise refusal(f"An activation-checkpoint region's result is used whole by {describe(user)}; "
                              "please report this model.", user)
            user.replace_all_uses_with(results[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(call)
        if not body_attr.users:
            graph.erase_node(body_attr)
            delattr(ctx.gm, body_attr.target)
    if calls:
        ctx.report.warnings.append(
            f"{len(calls)} activation-checkpoint region(s) opened: recomputed in the backward except ring attention "
            "(its out and LSE are saved, so no forward ring is repeated); with compiler='eager' nothing is recomputed")
