"""Open the subgraphs Dynamo wraps around parts of a model, so the other passes see the attention inside.

Matches the higher-order ops whose body is the user's own code run once, in place:
- ``tag_activation_checkpoint(body, *args)``: ``torch.utils.checkpoint.checkpoint`` and Hugging Face's
  ``gradient_checkpointing_enable()`` (reentrant or not);
- ``invoke_subgraph(body, identifier, *args)``: ``torch.compiler.nested_compile_region`` (one body shared by
  every layer that calls it);
- ``wrap(body, *args)``: Dynamo's plain wrapper.
Writes each body's nodes into the graph in place of the call (its placeholders become the call's arguments,
the ``getitem``s of its result the body's outputs; nested bodies come along and are opened in turn) and
removes the body once no call uses it. A body's ``p.item()`` on an argument that a call passes as a number
already (Dynamo's later calls of a shared body under ``dynamic=True``) reads that number. Checkpointed nodes
keep checkpointing's tags (``recompute = PREFER_RECOMPUTE``, one ``ac_graph_id`` per region); the report
warns how many checkpoint regions were opened.

The tags travel through AOTAutograd's tracing to the aten graph, whose partitioner recomputes the region
in the backward as checkpointing would, except what `rewrite_attention` marks ``MUST_SAVE``: the ring
attention's out and LSE, so the backward never repeats a forward ring (its communication) and the
attention's backward reads the saved LSE. Each rank keeps 1/P of what checkpointing keeps. (The inner
compiler ``"eager"`` runs no partitioner: there the region's activations are kept.)

Any other higher-order op whose body calls SDPA or flex_attention (``torch.cond``, ``scan``, a custom
autograd Function) is refused: the ring cannot rewrite it there, and running it unsharded would be quiet.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from lowering import compat
from ringpass.fx.context import PassContext
from ringpass.fx.nodes import describe, example_value, refusal
from ringpass.fx.spellings import BODY_CALLS, CHECKPOINT, FLEX, SDPA

ATTENTION_OPS = SDPA | {FLEX}
REGION_IDS = 1 << 20  # ac_graph_id of the opened regions, apart from Dynamo's own


def inline_subgraphs(ctx: PassContext) -> None:
    graph, checkpoints = ctx.gm.graph, 0
    while calls := [n for n in graph.nodes if n.op == "call_function" and n.target in BODY_CALLS]:
        for call in calls:
            tags = {}
            if call.target is CHECKPOINT:
                tags = dict(recompute=CheckpointPolicy.PREFER_RECOMPUTE, ac_graph_id=REGION_IDS + checkpoints)
                checkpoints += 1
            _inline(ctx.gm, call, tags)
    _refuse_attention_in_other_bodies(ctx.gm)
    if checkpoints:
        ctx.report.warnings.append(
            f"{checkpoints} activation-checkpoint region(s) opened: recomputed in the backward except ring attention "
            "(its out and LSE are saved, so no forward ring is repeated); with compiler='eager' nothing is recomputed"
        )


def _inline(gm: fx.GraphModule, call: fx.Node, tags: dict) -> None:
    graph, body_attr = gm.graph, call.args[0]
    body: fx.GraphModule = getattr(gm, body_attr.target)
    env = dict(zip([n for n in body.graph.nodes if n.op == "placeholder"], call.args[BODY_CALLS[call.target] :]))
    with graph.inserting_before(call):
        for node in body.graph.nodes:
            if node.op == "output":
                results = fx.node.map_arg(node.args[0], env.__getitem__)
            elif node.op == "get_attr":  # a nested body (or a constant): becomes the graph's own attribute
                name = _free_name(gm, f"{body_attr.target}_{node.target}")
                setattr(gm, name, getattr(body, node.target))
                env[node] = graph.get_attr(name)
            elif _reads_a_number_passed_in(node, env):
                env[node] = env[node.args[0]]
            elif node.op != "placeholder":
                env[node] = graph.node_copy(node, env.__getitem__)
                env[node].meta.update(tags)
    for user in list(call.users):
        if user.target is not operator.getitem:
            raise refusal(
                f"The result of {describe(call)} is used whole by {describe(user)}; please report this model.", user
            )
        user.replace_all_uses_with(results[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(call)
    if not body_attr.users:
        graph.erase_node(body_attr)
        if not any(n.op == "get_attr" and n.target == body_attr.target for n in graph.nodes):
            delattr(gm, body_attr.target)


def _reads_a_number_passed_in(node: fx.Node, env: dict) -> bool:
    """``node`` is ``p.item()`` on a body placeholder whose caller passes a number, not a tensor. Dynamo does this
    with a float attribute under ``dynamic=True`` (``nn.LayerNorm.eps`` unspecialized): the shared body reads it from
    a 0-dim tensor, while a later call passes the ``.item()`` it already took."""
    if node.op != "call_method" or node.target != "item" or node.args[0] not in env:
        return False
    passed = env[node.args[0]]
    return not isinstance(example_value(passed) if isinstance(passed, fx.Node) else passed, torch.Tensor)


def _calls_attention(body: fx.GraphModule) -> bool:
    """The body, or a body nested in it, calls SDPA or flex_attention."""
    for node in body.graph.nodes:
        if node.op in ("call_function", "call_method") and node.target in ATTENTION_OPS:
            return True
        nested = getattr(body, node.target, None) if node.op == "get_attr" else None
        if isinstance(nested, fx.GraphModule) and _calls_attention(nested):
            return True
    return False


def _free_name(gm: fx.GraphModule, name: str) -> str:
    name, i = name.replace(".", "_"), 0
    while hasattr(gm, f"{name}_{i}"):
        i += 1
    return f"{name}_{i}"


def _refuse_attention_in_other_bodies(gm: fx.GraphModule) -> None:
    for call in gm.graph.nodes:
        if call.op != "call_function" or not isinstance(call.target, compat.HigherOrderOperator):
            continue
        for arg in call.args:
            body = getattr(gm, arg.target, None) if isinstance(arg, fx.Node) and arg.op == "get_attr" else None
            if isinstance(body, fx.GraphModule) and _calls_attention(body):
                raise refusal(
                    f"{describe(call)} ({call.target.name()}) holds an attention in its body; the ring backend "
                    "does not rewrite attention there, and running it unsharded would be wrong quietly. Move "
                    "the attention out of it (e.g. replace torch.cond with a plain branch).",
                    call,
                )
