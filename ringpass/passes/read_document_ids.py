"""With the documents layout: each token's document id, on the host, before anything is sharded.

Matches ``ctx.document_ids`` (the ids value the documents masks read, `choose_layout`). Moves the ops that compute it
(from the graph's inputs: ``cumsum(diff(position_ids) != 1)`` and the like) to the graph's entry, in their order, and
writes ``ringpass::documents_on_host`` of it there: one copy to the host per call, from which every sequence op plans
the `lowering.DocumentLayout` of this call's packing (`PassContext.layout_kwargs`). Writes ``ctx.document_ids`` (the
host copy).
"""

from __future__ import annotations

import torch
from torch import fx

from ringpass.fx.context import FULL, PassContext


def read_document_ids(ctx: PassContext) -> None:
    if ctx.document_ids is None:
        return
    graph, ids = ctx.gm.graph, ctx.document_ids
    computed = _ancestors(ids)
    anchor = [n for n in graph.nodes if n.op == "placeholder"][-1]
    for node in [n for n in graph.nodes if n in computed]:  # in graph order: each after what it reads
        anchor.append(node)
        anchor = node
    with graph.inserting_after(anchor):
        host = graph.call_function(torch.ops.ringpass.documents_on_host.default, (ids,))
    ctx.placement[host] = FULL
    ctx.document_ids = host


def _ancestors(node: fx.Node) -> set[fx.Node]:
    """The ops ``node`` is computed by (itself included), back to the graph's inputs."""
    found, todo = set(), [node]
    while todo:
        current = todo.pop()
        if current.op == "placeholder" or current in found:
            continue
        found.add(current)
        todo.extend(current.all_input_nodes)
    return found
