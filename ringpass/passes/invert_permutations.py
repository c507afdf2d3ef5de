"""Spell the inverse of a permutation as ``argsort``: one op the sequence probe can run at any length.

Matches ``inv = torch.empty_like(perm); inv[perm] = torch.arange(n)`` with ``n`` the length of ``perm``
(Hugging Face's mixture-of-experts forward restores token order this way after sorting by expert). The
``arange`` spells the length as a literal, which the probe at another length cannot follow. Writes
``inv = torch.argsort(perm)`` (the same values: the inverse permutation) and removes the three nodes.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ringpass.fx.context import PassContext
from ringpass.fx.nodes import example_value
from ringpass.fx.sizes import same


def invert_permutations(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    for store in [n for n in graph.nodes if n.op == "call_function" and n.target is operator.setitem]:
        inverse, perm, values = store.args
        if not (_is_empty_like(inverse, perm) and _is_arange_over(values, perm)):
            continue
        if not all(
            user is store or (user.target is operator.getitem and user.args[1] is inverse) for user in inverse.users
        ):
            continue  # the buffer is read otherwise than as an index
        with graph.inserting_before(store):
            argsort = graph.call_function(torch.argsort, (perm,))
        argsort.meta.update(
            {
                key: inverse.meta[key]
                for key in ("example_value", "stack_trace", "nn_module_stack")
                if key in inverse.meta
            }
        )
        graph.erase_node(store)
        inverse.replace_all_uses_with(argsort)
        graph.erase_node(inverse)
        if not values.users:
            graph.erase_node(values)


def _is_empty_like(node, perm) -> bool:
    return (
        isinstance(node, fx.Node)
        and node.op == "call_function"
        and node.target is torch.empty_like
        and node.args[:1] == (perm,)
        and len(node.users) >= 2
    )


def _is_arange_over(node, perm) -> bool:
    """``arange(len(perm))`` (a literal or a size of the graph)."""
    if not isinstance(node, fx.Node) or node.target is not torch.arange or len(node.args) != 1:
        return False
    order = example_value(perm)
    return isinstance(order, torch.Tensor) and order.dim() == 1 and same(example_value(node).shape[0], order.shape[0])
