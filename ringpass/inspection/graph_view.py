"""The rewritten graph as a networkx graph: what inspection draws, saves and searches.

- `op_chain`: the path of ops from an attention to the op that blocks the rewrite (or from the blocking op
  to the attention it feeds), in the user's words: ``attention in model.layers.0.self_attn (model.py:40)
  -> view -> cumsum at model.py:88``.
- `to_networkx`: every node of an FX graph with its op, target, shape, dtype, placement, sequence dim,
  source line and module path; collectives and ring ops marked. GraphML-safe (no None values).
- `condensed`: one box per module (or attention region, input, collective, refused op), for pictures.
"""

from __future__ import annotations

import networkx as nx
import torch
import torch.fx as fx

from ringpass.fx.nodes import example_value, module_path, op_label, short_source, user_name

PLACEMENT_NAMES = {
    "local": "sharded",
    "full": "whole",
    "partial": "partial",
    "noseq": "replicated",
    "heads": "split by heads",
}
COLLECTIVES = {
    "shard_sequence": "shard",
    "gather_sequence": "all-gather",
    "sequence_to_heads": "all-to-all",
    "heads_to_sequence": "all-to-all",
    "all_reduce_sum": "all-reduce",
    "reduce_grad": "all-reduce (backward)",
    "scale_grad": "scale (backward)",
}


def to_networkx(gm: fx.GraphModule, placement: dict, axes: dict, prefix: str = "", blocking=None) -> nx.DiGraph:
    """One networkx node per FX node (named ``prefix + node.name``), with GraphML-safe attributes;
    ``blocking`` is the op a refusal names (``refused=True``)."""
    graph = nx.DiGraph()
    for node in gm.graph.nodes:
        value = example_value(node)
        label = op_label(node)
        seq_axes = axes.get(node, ())
        graph.add_node(
            prefix + node.name,
            op=node.op,
            target=label,
            name=user_name(node),
            shape=str(list(value.shape)) if isinstance(value, torch.Tensor) else "",
            dtype=str(value.dtype).replace("torch.", "") if isinstance(value, torch.Tensor) else "",
            placement=PLACEMENT_NAMES.get(placement.get(node, ""), "replicated" if node.op != "output" else "output"),
            sequence_dim=seq_axes[0].dim if seq_axes else -1,
            source=short_source(node),
            module=module_path(node),
            collective=COLLECTIVES.get(label, ""),
            ring=label == "ring_attention",
            refused=node is blocking,
        )
        for arg in node.all_input_nodes:
            graph.add_edge(prefix + arg.name, prefix + node.name)
    return graph


def condensed(graph: nx.DiGraph, max_boxes: int = 40) -> nx.DiGraph:
    """Boxes of the graph from `to_networkx`: user inputs, one per module (cut to the depth that keeps at
    most ``max_boxes``), every attention region, every collective. A box's placement is that of most of
    its nodes; edges join boxes whose nodes are joined. Module state and size arithmetic are left out."""
    kept = [n for n, d in graph.nodes(data=True) if _drawn(d)]
    depth = max((len(graph.nodes[n]["module"].split(".")) for n in kept), default=1)
    while depth > 1 and len({_box(graph.nodes[n], depth) for n in kept}) > max_boxes:
        depth -= 1
    boxes = nx.DiGraph()
    members: dict[str, list[str]] = {}
    for n in kept:
        members.setdefault(_box(graph.nodes[n], depth), []).append(n)
    for box, nodes in members.items():
        placements = [graph.nodes[n]["placement"] for n in nodes]
        boxes.add_node(
            box,
            placement=max(set(placements), key=placements.count),
            size=len(nodes),
            kind=_kind(graph.nodes[nodes[0]]),
        )
    owner = {n: box for box, nodes in members.items() for n in nodes}
    for a, b in graph.edges:
        if a in owner and b in owner and owner[a] != owner[b]:
            boxes.add_edge(owner[a], owner[b])
    return boxes


def _drawn(data: dict) -> bool:
    if data["op"] == "placeholder":
        return data["shape"] != "" and "." not in data["name"]  # user inputs, not parameters
    return data["op"] != "output" and data["shape"] != "" or bool(data["collective"]) or data["ring"] or data["refused"]


def _box(data: dict, depth: int) -> str:
    if data["refused"]:
        return f"REFUSED: {data['target']} ({data['source'] or data['module']})"
    if data["op"] == "placeholder":
        return f"input {data['name']}"
    if data["collective"] == COLLECTIVES["reduce_grad"]:
        return "gradients all-reduced (backward)"
    if data["collective"]:
        return f"{data['collective']} ({data['source'] or data['module'] or 'graph'})"
    module = ".".join(data["module"].split(".")[:depth]) if data["module"] else "(top level)"
    return f"ring attention in {data['module'] or 'top level'}" if data["ring"] else module


def _kind(data: dict) -> str:
    if data["refused"]:
        return "refused"
    return (
        "input"
        if data["op"] == "placeholder"
        else "collective"
        if data["collective"]
        else "ring"
        if data["ring"]
        else "module"
    )
