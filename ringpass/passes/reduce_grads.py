"""Make parameter gradients mean what the option ``grads`` says.

Each rank's backward sees only its own tokens, so a gradient that flows back from the sharded part of
the graph (local activations, partial sums) is *partial*: this rank's share. One that flows back only
through replicated values (which every rank computes identically) is *whole*. Matches every replicated
value that needs a gradient and classifies it from its users (in reverse order):

- ``reduced`` (every rank ends with the unsharded model's gradient): a partial leaf (parameter, input) is
  wrapped once in `reduce_grad` (the backward all-reduces it); a value whose gradient is partial along some
  uses and whole along others has each partial use wrapped;
- ``mean`` (an outer FSDP2 / DDP averages over the ring's ranks, `ringpass.frontend.wrappers`): the same places are
  wrapped in `scale_grad(P)` instead when every input their gradient reaches is a parameter, so that the
  wrapper's mean is the full gradient and the wrapper's reduction is the only one; other inputs' gradients
  (bound for the graph that computed them) are still reduced;
- ``local`` (each rank keeps its share; a hand-written sum over the ring's ranks completes it): whole uses
  are wrapped in `scale_grad(1/P)` instead, so that the sum over ranks is the full gradient.

``grads="auto"`` is one of these, chosen by the backend from the wrapper it finds (``ctx.gradients``).
A value held whole on every rank (placement FULL) gets a whole gradient back through its shards (their
backward gathers), but a partial one where the ring reads it as a mask or bias program's input (a learned
bias table's values, a materialised mask): such a value is classified like a replicated one, so the
reduction lands on the leaf it came from (the table, not an S x S tensor).

Each all-reduce is recorded in the report with its size. An all-reduced total (``x.sum(1)`` over the
sequence) that feeds per-token ops again is treated like a leaf whose partial uses are always reduced: its
gradient flows back into every rank's tokens.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from lowering.sequence_ops import reduce_grad, scale_grad
from ringpass.fx.context import FULL, HEADS, LOCAL, NOSEQ, PARTIAL, GradientMode, PassContext
from ringpass.fx.nodes import copy_origin, example_value, is_module_state, nbytes, user_name
from ringpass.fx.report import CollectiveRecord

PART, WHOLE = "partial", "whole"
REDUCE = "all-reduce"


def reduce_grads(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    plan = ctx.gradients or GradientMode(
        "reduced" if ctx.options.grads == "auto" else ctx.options.grads, ctx.world_size
    )
    kinds: dict[fx.Node, set[str]] = {}
    only_parameters: dict[fx.Node, bool] = {}
    for node in reversed(list(graph.nodes)):
        value = example_value(node)
        placement = ctx.placement.get(node, NOSEQ)
        if placement not in (NOSEQ, FULL) or not getattr(value, "requires_grad", False):
            continue
        uses = {user: _use_kind(ctx, user, kinds) for user in node.users}
        kind = set(uses.values()) - {None}
        if placement == FULL and PART not in kind:  # whole through its shards, whose backward gathers
            kinds[node] = kind
            continue
        # A total's gradient flows back into every rank's tokens: it must be whole in every mode.
        leaf = node.op == "placeholder" or node in ctx.totals
        wrap_kind = WHOLE if plan.mode == "local" and node not in ctx.totals else PART
        if kind == {wrap_kind} and leaf:
            wrapped = list(node.users)
        elif len(kind) == 2:
            wrapped = [u for u, k in uses.items() if k == wrap_kind]
        else:
            kinds[node] = kind
            continue
        if wrap_kind == WHOLE:
            action = 1.0 / ctx.world_size
        elif plan.mode == "mean" and node not in ctx.totals and _from_parameters(node, only_parameters):
            action = plan.scale  # the outer wrapper's mean over the ring's ranks sums the scaled shares
        else:
            action = REDUCE
        _wrap(ctx, node, wrapped, action)
        kinds[node] = {WHOLE if wrap_kind == PART else PART}
    trained = [n for n in ctx.gm.graph.nodes if n.op == "placeholder" and is_module_state(n)]
    if any(getattr(example_value(n), "requires_grad", False) for n in trained):
        ctx.report.gradients, ctx.report.gradients_why = plan.mode, plan.why  # what became of parameter gradients


def _use_kind(ctx: PassContext, user: fx.Node, kinds: dict) -> str | None:
    if user.op == "output" or user.target is torch.ops.ringpass.shard_sequence.default:
        return WHOLE
    if ctx.placement.get(user) in (LOCAL, PARTIAL, HEADS):  # per-token or per-head work, the ring's programs
        return PART
    found = kinds.get(user)
    if found is None:
        return None  # no gradient flows back through this use
    return PART if found == {PART} else WHOLE


def _from_parameters(node: fx.Node, memo: dict) -> bool:
    """Whether every input that ``node``'s gradient reaches is a parameter (another input's gradient goes on to
    the graph that computed it, which expects it whole). Walks the ancestors without recursion (a model's
    graph is thousands of nodes deep); ``memo`` keeps the answers between calls."""
    order, stack, seen = [], [node], set()
    while stack:  # every ancestor not answered yet
        current = stack.pop()
        if current in memo or current in seen:
            continue
        seen.add(current)
        order.append(current)
        stack.extend(n for n in current.all_input_nodes if n not in memo)
    for current in sorted(order, key=_position(node.graph)):  # graph order: inputs before their users
        if current.op == "placeholder":
            memo[current] = _is_parameter(current) or not getattr(example_value(current), "requires_grad", False)
        else:
            memo[current] = all(memo[n] for n in current.all_input_nodes)
    return memo[node]


def _position(graph: fx.Graph):
    index = {n: i for i, n in enumerate(graph.nodes)}
    return index.__getitem__


def _is_parameter(node: fx.Node) -> bool:
    example = getattr(node.meta.get("grapharg"), "example", None)
    return isinstance(example if example is not None else example_value(node), torch.nn.Parameter)


def _wrap(ctx: PassContext, node: fx.Node, users: list[fx.Node], action) -> None:
    """Route ``users``' gradients into ``node`` through an all-reduce (``REDUCE``) or a scaling by ``action``."""
    graph = ctx.gm.graph
    with graph.inserting_before(node.next):
        if action is REDUCE:
            wrapped = graph.call_function(reduce_grad, (node, ctx.group_name))
            ctx.report.collectives.append(
                CollectiveRecord(
                    "all-reduce", "backward", f"the gradient of {user_name(node)}", "", nbytes(example_value(node))
                )
            )
        else:
            wrapped = graph.call_function(scale_grad, (node, action))
    copy_origin(wrapped, node)
    wrapped.meta["example_value"] = example_value(node)  # an identity forward: the same value
    ctx.placement[wrapped] = NOSEQ
    for user in users:
        user.replace_input_with(node, wrapped)
