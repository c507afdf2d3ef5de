"""Refuse a rewrite that cut a gradient path: the second half of the safety net, the pipeline's last step.

Matches every graph input that `record_gradient_paths` found training through the captured graph (its
gradient reached an output). Walks the rewritten graph the same way (`gradient_reach`, the same rules) and
refuses, with `NotSupportedError`, when such an input's gradient reaches no output any more: the rewritten
graph would compute the right numbers while the value silently never trains (a learned bias table
lifted into a program input the ring op returns no gradient for, a use the rewrite dropped or detached).
The message names the value as the user knows it (``model.layers.0.attn.bias.weight``), the op that cut
its path with its source line (an op that reads it but passes no gradient: the ring op and the argument;
else the op of its captured path that the rewrite removed) and what to do. Runs after every rewrite:
the ring's, a decode step's (`rewrite_decode_attention`) and a graph without attention. Writes nothing.
"""

from __future__ import annotations

import torch.fx as fx

from lowering import compat
from ringpass.fx.context import PassContext
from ringpass.fx.gradient_reach import (
    GRADIENT_ARGUMENTS,
    NO_GRADIENT,
    CapturedGradients,
    GradientRules,
    flat_nodes,
    gradient_reach,
    ringpass_op,
)
from ringpass.fx.nodes import op_label, refusal, user_name

SHOWN = 3  # other values named after the first


def check_gradient_paths(ctx: PassContext) -> None:
    record: CapturedGradients = getattr(ctx, "gradient_paths", None)
    if not record or not record.inputs:
        return
    graph = ctx.gm.graph
    rules = GradientRules(record.trusted)
    live, _ = gradient_reach(ctx.gm, rules)
    now = {n.target: n for n in graph.nodes if n.op == "placeholder"}
    lost = []
    for start in record.inputs:
        current = start if _in_graph(start, graph) else now.get(record.targets[start])
        if current is None or current not in live:
            lost.append((start, current))
    if not lost:
        return
    start, current = lost[0]
    name = user_name(current if current is not None else start)
    cut, blocking = _where_cut(graph, rules, live, record, start, current)
    others = [user_name(c if c is not None else s) for s, c in lost[1:]]
    also = ""
    if others:
        shown = ", ".join(f"`{o}`" for o in others[:SHOWN])
        shown += f" and {len(others) - SHOWN} more" if len(others) > SHOWN else ""
        also = f" (so would {len(others)} other value{'s' if len(others) > 1 else ''}: {shown})"
    raise refusal(
        f"The gradient of `{name}` no longer reaches the outputs after the ring rewrite: {cut}. Training would "
        f"silently leave this value unchanged{also}. This is a ringpass bug: please report this model. To run it "
        "now, freeze the value (`requires_grad_(False)`) if it need not train, or run inference under "
        "`torch.no_grad()`.",
        blocking,
    )


def _where_cut(
    graph: fx.Graph, rules: GradientRules, live: set, record: CapturedGradients, start: fx.Node, current
) -> tuple[str, fx.Node]:
    """(what cut the path, in words; the node to name as the blocking op)."""
    if current is None:
        return "the rewritten graph no longer reads it", start
    reached = _reached_from(current, rules)
    path = record.path(start)
    on_path = {n: i for i, n in enumerate(path)}
    order = {n: i for i, n in enumerate(graph.nodes)}
    blocked = [(r, u) for r in reached for u in r.users if u in live and not rules.passes(r, u)]
    if blocked:  # an op that reads it (or a value carrying its gradient) and passes no gradient on
        r, u = max(
            blocked,
            key=lambda e: (
                ringpass_op(e[1]) is not None or not rules.is_trusted(e[1]),
                on_path.get(e[0], -1),
                order[e[0]],
            ),
        )
        via = f" through {user_name(r)}" if r is not current and rules.is_trusted(r) else ""
        return f"it reaches {user_name(u)}{via}{_as_argument(u, r)}, {_why_not(u)}", u
    last = max((i for i, n in enumerate(path) if n in reached), default=0)
    if last + 1 < len(path) and path[last + 1].op != "output":
        removed = path[last + 1]
        fate = "which the rewrite removed" if not _in_graph(removed, graph) else "which no longer leads to an output"
        via = f" (through {user_name(path[last])})" if last > 0 else ""
        return f"it fed {user_name(removed)}{via}, {fate}, and nothing else passes its gradient on", removed
    return "no op of the rewritten graph passes its gradient on", current


def _reached_from(start: fx.Node, rules: GradientRules) -> list[fx.Node]:
    """The nodes ``start``'s gradient flows back from in the rewritten graph (edges that carry one), in
    the order found."""
    seen, pending = {start: None}, [start]
    while pending:
        node = pending.pop()
        for user in node.users:
            if user not in seen and rules.passes(node, user):
                seen[user] = None
                pending.append(user)
    return list(seen)


def _as_argument(op: fx.Node, arg: fx.Node) -> str:
    """ " as its `bias_inputs`" for a ringpass op reading ``arg`` in that argument, else ""."""
    found = ringpass_op(op)
    if found is None:
        return ""
    bound = dict(zip(found[1], op.args)) | dict(op.kwargs)
    names = [k for k, v in bound.items() if arg in flat_nodes(v)]
    return f" as its argument `{names[0]}`" if names else ""


def _why_not(op: fx.Node) -> str:
    found = ringpass_op(op)
    if found is not None and found[0] in GRADIENT_ARGUMENTS:
        return "for which the op's backward returns no gradient"
    if found is not None:
        return "an op with an autograd formula that says nothing of this argument"
    if op_label(op) in NO_GRADIENT:
        return "which passes no gradient"
    return "which no longer passes its gradient on"


def _in_graph(node: fx.Node, graph: fx.Graph) -> bool:
    return node.graph is graph and not compat.erased(node)
