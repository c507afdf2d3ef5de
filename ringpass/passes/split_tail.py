"""With ``inputs="per_rank"``, cut off the model's tail that mixes the tokens of a sharded activation.

Matches (only with ``inputs="per_rank"``) the ops after attention that move information between the tokens of an
activation: a shift of the hidden states (``h[:, :-1]``, as TRL's fused LM head scores each position against the
next token), a flatten of a shifted sequence, a boolean pick of the tokens with labels. Anywhere else such an op is
refused (`decide_placements`: only attention may mix sharded tokens). Under ``per_rank`` every rank also holds its
own batch whole at the end of the call, so the *tail* — those ops and everything computed from them — runs once,
on this rank's own batch, after the ring graph: exactly what a data-parallel job runs on that rank, with the
activations it reads assembled whole for their owner (an all-to-all of this rank's N x H values, as
``outputs="auto"`` returns logits under ``per_rank``). Nothing is gathered onto every rank and no rank computes the
tail of another rank's batch. The tail holds no attention (when it does, nothing is cut and the op is refused).

Writes ``ctx.tail`` (`Tail`: the tail as its own graph, where each of its inputs comes from, where each of the
graph's outputs now comes from); removes the tail's nodes from ``ctx.gm``, which returns its remaining outputs and
then the values the tail reads (ring outputs like any other: sharded under ``outputs="auto"``), and from the
sequence findings; an input only the tail reads leaves the gradient check (`check_gradient_paths`: the tail graph,
copied unchanged, keeps its path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ringpass.fx.context import PassContext
from ringpass.fx.nodes import describe, example_value
from ringpass.passes.placements import downstream_of, replaced_by_ring


@dataclass
class Tail:
    """The cut-off tail: ``gm`` takes ``sources`` (per placeholder: ``("input", i)``, the call's i-th argument, or
    ``("output", k)``, the ring graph's k-th output, assembled for this rank) and returns the tail's values;
    ``outputs``: per output of the graph Dynamo captured, ``("ring", k)`` or ``("tail", j)``; ``starts``: the ops
    it begins with, described for the report."""

    gm: fx.GraphModule
    sources: list[tuple[str, int]]
    outputs: list[tuple[str, int]]
    starts: list[str]

    def examples(self) -> list:
        return [example_value(n) for n in self.gm.graph.nodes if n.op == "placeholder"]


def split_tail(ctx: PassContext) -> None:
    if not ctx.per_rank:
        return
    roots = _tail_roots(ctx)
    tail = downstream_of(roots) - {n for n in ctx.gm.graph.nodes if n.op == "output"}
    attention = {n for m in ctx.attention for n in (m.query, m.key, m.value, m.output, *m.internal)}
    if not roots or tail & attention:
        return  # nothing to cut, or the mixing op feeds an attention: decide_placements refuses it
    graph = ctx.gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    read = [a for n in graph.nodes if n in tail for a in n.all_input_nodes if a not in tail]
    read = list(dict.fromkeys(a for a in read if a.op != "get_attr"))
    if not all(_returnable(example_value(a)) for a in read):
        return
    output = next(n for n in graph.nodes if n.op == "output")
    returned = list(output.args[0])
    kept = [v for v in returned if v not in tail]
    cut = [a for a in read if a.op != "placeholder"]
    sources = [
        ("input", placeholders.index(a)) if a.op == "placeholder" else ("output", len(kept) + cut.index(a))
        for a in read
    ]
    tail_outputs = [v for v in returned if v in tail]
    outputs = [("tail", tail_outputs.index(v)) if v in tail else ("ring", kept.index(v)) for v in returned]
    starts = [describe(r) for r in roots if not any(a in tail for a in r.all_input_nodes)]
    ctx.tail = Tail(_tail_graph(ctx.gm, tail, read, tail_outputs), sources, outputs, starts)
    output.args = (type(output.args[0])([*kept, *cut]),)
    tail_only = {p for p in placeholders if p.users and all(u in tail for u in p.users)}
    for node in reversed(list(graph.nodes)):
        if node in tail:
            graph.erase_node(node)
    findings = ctx.sequence
    for table in (findings.axes, findings.mixing, findings.reductions, findings.sources):
        for node in tail:
            table.pop(node, None)
    if ctx.gradient_paths is not None:
        ctx.gradient_paths.inputs = [p for p in ctx.gradient_paths.inputs if p not in tail_only]


def _tail_roots(ctx: PassContext) -> list[fx.Node]:
    """The token-mixing ops that read a sequence-carrying value computed after an attention."""
    after_attention = downstream_of([m.output for m in ctx.attention])
    skipped = replaced_by_ring(ctx) | {m.output for m in ctx.attention}
    return [
        op
        for op in ctx.sequence.mixing
        if op not in skipped and any(a in after_attention and ctx.has_sequence(a) for a in op.all_input_nodes)
    ]


def _returnable(value) -> bool:
    return isinstance(value, (torch.Tensor, torch.SymInt, int, float, bool))


def _tail_graph(gm: fx.GraphModule, tail: set, read: list, returned: list) -> fx.GraphModule:
    """The tail's nodes in a graph of their own, reading ``read`` as placeholders (module state it reads by
    ``get_attr`` is copied from ``gm``)."""
    graph = fx.Graph()
    env = {}
    for node in read:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in gm.graph.nodes:
        if node in tail:
            for a in node.all_input_nodes:
                if a.op == "get_attr" and a not in env:
                    env[a] = graph.node_copy(a)
            env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(tuple(env[v] for v in returned))
    return fx.GraphModule(gm, graph)
