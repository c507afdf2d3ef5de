"""Make parameter gradients mean what the option ``grads`` says.

Each rank's backward sees only its own tokens, so a gradient that flows back from the sharded part of
the graph (local activations, partial sums) is *partial*: this rank's share. One that flows back only
through replicated values (which every rank computes identically) is *whole*. Matches every replicated
value that needs a gradient and classifies it from its users (in reverse order):

- ``grads="reduced"`` (every rank ends with the unsharded model's gradient): a partial leaf (parameter,
  input) is wrapped once in `reduce_grad` (the backward all-reduces it); a value whose gradient is
  partial along some uses and whole along others has each partial use wrapped;
- ``grads="local"`` (each rank keeps its share; an outer DDP/FSDP sums over ranks): whole uses are
  wrapped in `scale_grad(1/P)` instead, so that the sum over ranks is the full gradient.

Each all-reduce is recorded in the report with its size. An all-reduced total (``x.sum(1)`` over the sequence) that feeds per-token ops again is treated like a
leaf whose partial uses are always reduced: its gradient flows back into every rank's tokens.
"""

from __future__ import annotations

import torch.fx as fx

from lowering.sequence_ops import reduce_grad, scale_grad
from ringpass.graph import copy_origin, example_value, nbytes, user_name
from ringpass.passes.context import FULL, LOCAL, NOSEQ, PARTIAL, PassContext
from ringpass.report import CollectiveRecord

PART, WHOLE = "partial", "whole"


def reduce_grads(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    kinds: dict[fx.Node, set[str]] = {}
    for node in reversed(list(graph.nodes)):
        value = example_value(node)
        if ctx.placement.get(node, NOSEQ) != NOSEQ or not getattr(value, "requires_grad", False):
            continue
        uses = {user: _use_kind(ctx, user, kinds) for user in node.users}
        kind = set(uses.values()) - {None}
        # A total's gradient flows back into every rank's tokens: it must be whole in either mode.
        leaf = node.op == "placeholder" or node in ctx.totals
        wrap_kind = PART if ctx.options.grads == "reduced" or node in ctx.totals else WHOLE
        if kind == {wrap_kind} and leaf:
            _wrap(ctx, node, list(node.users), wrap_kind)
            kinds[node] = {WHOLE if wrap_kind == PART else PART}
        elif len(kind) == 2:
            _wrap(ctx, node, [u for u, k in uses.items() if k == wrap_kind], wrap_kind)
            kinds[node] = {WHOLE if wrap_kind == PART else PART}
        else:
            kinds[node] = kind
    ctx.report.gradients = ctx.options.grads


def _use_kind(ctx: PassContext, user: fx.Node, kinds: dict) -> str | None:
    if user.op == "output":
        return WHOLE
    if ctx.placement.get(user) in (LOCAL, PARTIAL):
        return PART
    if ctx.placement.get(user) == FULL:  # whole sequence on every rank: its gradient is whole too
        return WHOLE if getattr(example_value(user), "requires_grad", False) else None
    found = kinds.get(user)
    if found is None:
        return None  # no gradient flows back through this use
    return PART if found == {PART} else WHOLE


def _wrap(ctx: PassContext, node: fx.Node, users: list[fx.Node], kind: str) -> None:
    graph = ctx.gm.graph
    with graph.inserting_before(node.next):
        if kind == PART:
            wrapped = graph.call_function(reduce_grad, (node, ctx.group_name))
            ctx.report.collectives.append(CollectiveRecord(
                "all-reduce", "backward", f"the gradient of {user_name(node)}", "", nbytes(example_value(node))))
        else:
            wrapped = graph.call_function(scale_grad, (node, 1.0 / ctx.world_size))
    copy_origin(wrapped, node)
    ctx.placement[wrapped] = NOSEQ
    for user in users:
        user.replace_input_with(node, wrapped)
