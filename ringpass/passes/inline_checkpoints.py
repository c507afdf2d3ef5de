"""Open activation-checkpoint regions, so the other passes see the attention and activations inside.

Matches ``torch.ops.higher_order.tag_activation_checkpoint(body, *args)``: what Dynamo makes of
``torch.utils.checkpoint.checkpoint`` and of Hugging Face's ``gradient_checkpointing_enable()`` (reentrant
or not). Writes the body's nodes into the graph in place of the call (its placeholders become the call's
arguments, the ``getitem``s of its result the body's outputs) and removes the body's attribute.

What this does to memory: the region's activations are kept for the backward instead of recomputed
(recomputing a ring attention would also repeat its communication); each rank keeps only its 1/P share
of them. The report says which regions were opened. Checkpointing through the ring is not built yet.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ringpass.graph import describe, refusal
from ringpass.passes.context import PassContext

CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint


def inline_checkpoints(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    calls = [n for n in graph.nodes if n.op == "call_function" and n.target is CHECKPOINT]
    for call in calls:
        body_attr = call.args[0]
        body: fx.GraphModule = getattr(ctx.gm, body_attr.target)
        env = dict(zip([n for n in body.graph.nodes if n.op == "placeholder"], call.args[1:]))
        with graph.inserting_before(call):
            for node in body.graph.nodes:
                if node.op == "output":
                    results = fx.node.map_arg(node.args[0], env.__getitem__)
                elif node.op != "placeholder":
                    env[node] = graph.node_copy(node, env.__getitem__)
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
            f"{len(calls)} activation-checkpoint region(s) opened: their activations are kept (1/P per rank), not "
            "recomputed in the backward; checkpointing through the ring is not built yet")
