"""Rewrite masks that Dynamo traced through ``vmap`` into broadcasting, so `lift_masks` can read them.

Matches a *nest* of ``vmap`` levels in the graph (``torch._functorch.predispatch``: ``_vmap_increment_nesting``,
``_add_batch_dim``, ..., ``_remove_batch_dim``, ``_vmap_decrement_nesting``), as Hugging Face builds masks
(``_vmap_for_bhqkv`` over batch, head, query and key indices; EmbeddingGemma's bidirectional mask), when
every batched input is a 1-D index vector (batched on dim 0, so each is a scalar inside) and every op in
the nest acts elementwise (comparisons, logic, casts, ``aten.index`` of tables by those scalars, scalar
constants). Writes each ``_add_batch_dim(t, 0, level)`` as ``t.view`` with ``t`` along the level's own
axis and 1 elsewhere, the chain of ``_remove_batch_dim``s as one ``expand`` to the nest's full shape,
and drops the bookkeeping: the same values, now computed by broadcasting. Example values of the rewritten
nodes are recomputed on fake tensors. Any other nest is left as it is (a mask built from it is refused
later as needing an S x S tensor).
"""

from __future__ import annotations

import torch.fx as fx

from ringpass.fx.context import PassContext
from ringpass.fx.nodes import example_value, is_vmap_bookkeeping, refresh_example_values
from ringpass.fx.spellings import CASTS, is_pointwise, op_name

ELEMENTWISE = CASTS | {"new_ones", "new_zeros", "tensor", "index", "getitem"}


def devectorize_vmaps(ctx: PassContext) -> None:
    for nest in _nests(ctx.gm.graph):
        _rewrite(ctx, nest)


def _predispatch(node: fx.Node, name: str) -> bool:
    return is_vmap_bookkeeping(node) and node.target.__name__ == name


def _nests(graph: fx.Graph) -> list[list[fx.Node]]:
    """The nodes of each outermost vmap nest, from its first increment to its last decrement."""
    nests, current, depth = [], None, 0
    for node in graph.nodes:
        if _predispatch(node, "_vmap_increment_nesting"):
            if depth == 0:
                current = []
            depth += 1
        if current is not None:
            current.append(node)
        if _predispatch(node, "_vmap_decrement_nesting"):
            depth -= 1
            if depth == 0:
                nests.append(current)
                current = None
    return nests


def _rewrite(ctx: PassContext, nest: list[fx.Node]) -> None:
    graph = ctx.gm.graph
    adds = [n for n in nest if _predispatch(n, "_add_batch_dim")]
    removes = [n for n in nest if _predispatch(n, "_remove_batch_dim")]
    body = [n for n in nest if not is_vmap_bookkeeping(n)]
    levels = [n.args[2] for n in adds]
    if not adds or sorted(levels) != list(range(min(levels), min(levels) + len(levels))):
        return
    if any(n.args[1] != 0 or example_value(n.args[0]).dim() != 1 for n in adds):
        return  # a batched input that is not an index vector
    if any(not (is_pointwise(n) or op_name(n) in ELEMENTWISE) for n in body):
        return
    chain = _removal_chain(removes, levels)
    if chain is None:
        return
    rank, first, changed = len(levels), min(levels), set(body)
    for add in adds:
        axis = add.args[2] - first
        with graph.inserting_before(add):
            view = graph.call_method("view", (add.args[0], *([1] * axis), -1, *([1] * (rank - axis - 1))))
        add.replace_all_uses_with(view)
        changed.add(view)
    with graph.inserting_before(chain[-1]):
        full = graph.call_method("expand", (chain[0].args[0], *example_value(chain[-1]).shape))
    chain[-1].replace_all_uses_with(full)
    changed.add(full)
    for node in reversed(nest):
        if is_vmap_bookkeeping(node):
            graph.erase_node(node)
    refresh_example_values(graph, changed)


def _removal_chain(removes: list[fx.Node], levels: list[int]):
    """The ``_remove_batch_dim``s from the innermost level out, each taking the previous one and putting its
    level's axis first; None for any other use of them."""
    chain = sorted(removes, key=lambda n: -n.args[1])
    if [n.args[1] for n in chain] != sorted(levels, reverse=True) or any(n.args[3] != 0 for n in chain):
        return None
    if any(later.args[0] is not earlier or len(earlier.users) != 1 for earlier, later in zip(chain, chain[1:])):
        return None
    return chain
