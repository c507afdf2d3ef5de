"""The chain of ops between an attention and the op that blocks its rewrite, as a refusal names it."""

from __future__ import annotations

import networkx as nx
import torch.fx as fx

from ringpass.fx.nodes import op_label, user_name

LONGEST_CHAIN = 12


def _graph_of(gm: fx.GraphModule) -> nx.DiGraph:
    graph = nx.DiGraph()
    for node in gm.graph.nodes:
        graph.add_node(node)
        for arg in node.all_input_nodes:
            graph.add_edge(arg, node)
    return graph


def op_chain(gm: fx.GraphModule, attentions: list[fx.Node], blocking: fx.Node) -> list[str]:
    """The shortest chain of ops between an attention (or a ring op that replaced one) and ``blocking``,
    in either direction, as user-readable steps; just the blocking op when no attention reaches it."""
    graph = _graph_of(gm)
    sources = [a for a in attentions if a in graph] + [n for n in gm.graph.nodes if op_label(n) == "ring_attention"]
    best = None
    for source in sources:
        for start, end in ((source, blocking), (blocking, source)):
            if start in graph and end in graph and nx.has_path(graph, start, end):
                path = nx.shortest_path(graph, start, end)
                if best is None or len(path) < len(best):
                    best = path
    path = best or [blocking]
    ends = (0, len(path) - 1)  # the ends carry their module and source line; ops between, their name
    steps = [
        user_name(node) if i in ends else op_label(node)
        for i, node in enumerate(path)
        if i in ends or op_label(node) != "getitem"
    ]
    if len(steps) > LONGEST_CHAIN:
        steps = (
            steps[: LONGEST_CHAIN // 2] + [f"... {len(steps) - LONGEST_CHAIN} more ..."] + steps[-LONGEST_CHAIN // 2 :]
        )
    return steps
