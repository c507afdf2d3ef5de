"""Recognise permutations of this rank's own tokens that are undone again: mixture-of-experts routing.

Matches a ``sort`` / ``argsort`` along the sequence axis of a per-token value (``perm``: expert ids
flattened over tokens and top-k), with its *island*: everything computed from the sorted keys and the
permutation up to the *exits* ``y[argsort(perm)]`` (the inverse permutation, after `invert_permutations`),
which restore token order. The island is token-local, however the sort orders the tokens, when:
- a sequence-carrying value enters it only through a *gather* ``x[perm]`` / ``x[perm // k]``;
- its sequence-carrying values are used only inside it, or by an exit;
- its values without a sequence axis (per-expert counts: ``histc`` / ``bincount`` of the sorted keys, and
  their ``cumsum``) are used only as the segment offsets of a grouped matmul (``offs=``), through casts and
  ``cumsum``: each row is then multiplied by its own expert's weights on one rank as on all of them.
Each rank then sorts, computes and unsorts its own tokens, which gives every token the result the
unsharded model gives it. The island's ops are taken off ``ctx.sequence.mixing`` and ``ctx.sequence.reductions``;
anything else (a count used as a value, such as a load-balancing loss inside the island) leaves them there, and the
op is refused as before.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from ringpass.fx.context import PassContext
from ringpass.fx.nodes import example_value
from ringpass.fx.spellings import CASTS, op_name

SORTS = ("sort", "argsort")
COUNTS = ("histc", "bincount")
OFFSET_STEPS = CASTS | {"cumsum"}  # from counts to offsets


def find_local_permutations(ctx: PassContext) -> None:
    for sort in [n for n in ctx.sequence.mixing if op_name(n) in SORTS]:
        island = _island(ctx, sort) if sort in ctx.sequence.mixing else None  # (an inverse of an island already taken)
        if island is not None:
            for node in island:
                ctx.sequence.mixing.pop(node, None)
                ctx.sequence.reductions.pop(node, None)


def _permutation(sort: fx.Node) -> fx.Node | None:
    if op_name(sort) == "argsort":
        return sort
    indices = [u for u in sort.users if u.target is operator.getitem and u.args[1] == 1]
    return indices[0] if len(indices) == 1 else None


def _island(ctx: PassContext, sort: fx.Node) -> set | None:
    """The island's nodes (sort, gathers, exits included), or None when one of its conditions fails."""
    perm = _permutation(sort)
    if perm is None:
        return None
    inverses = {u for u in perm.users if op_name(u) == "argsort"}
    exits = {u for inv in inverses for u in inv.users}
    if not inverses or not all(e.target is operator.getitem and e.args[1] in inverses for e in exits):
        return None
    island, stack = {sort} | inverses | exits, list(sort.users)
    while stack:  # everything computed from the sorted keys and the permutation, up to the exits
        node = stack.pop()
        if node not in island:
            island.add(node)
            stack += list(node.users)
    for node in island - exits - {sort}:  # (the sort reads the keys in token order)
        if node.op == "output":
            return None  # a permuted value leaves the graph
        outside = [a for a in node.all_input_nodes if (a not in island or a in exits) and ctx.has_sequence(a)]
        if outside and not (_is_gather(node, perm) and outside == [node.args[0]]):
            return None  # a sequence-carrying value in token order meets the permuted ones
        if not ctx.has_sequence(node) and not isinstance(example_value(node), tuple) and not _only_offsets(node):
            return None  # a value computed over the permuted tokens that is not a segment offset
    return island


def _is_gather(node: fx.Node, perm: fx.Node) -> bool:
    """``x[perm]`` or ``x[perm // k]``."""
    if node.target is not operator.getitem:
        return False
    index = node.args[1]
    return index is perm or (
        isinstance(index, fx.Node)
        and index.target is operator.floordiv
        and index.args[0] is perm
        and isinstance(index.args[1], int)
    )


def _only_offsets(node: fx.Node) -> bool:
    """A count or offset (``histc`` / ``bincount`` of the keys, casts, ``cumsum``) whose every use ends as
    the ``offs=`` of a grouped matmul."""
    name = op_name(node)
    if name not in COUNTS and name not in OFFSET_STEPS:
        return False
    return all(
        node in (user.kwargs.get("offs"), user.kwargs.get("offsets")) or _only_offsets(user) for user in node.users
    )
