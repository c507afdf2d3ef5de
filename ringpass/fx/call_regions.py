"""The function calls of a graph, told from its nodes' stack traces: where a chunked scan begins and ends.

Dynamo inlines the functions a model calls; each node's ``stack_trace`` still names the frames it was traced in
(``mamba2_chunk_scan`` called from ``Mamba2Mixer.forward``, ``torch_chunk_gated_delta_rule`` from
``Qwen3NextGatedDeltaNet.forward``). A call is the run of consecutive nodes traced under one frame of a function
called from one place (the frames above it the same, the line inside it free); `enclosing_calls` lists them around
a node, innermost first; `boundary` the values a call reads from outside it and those read outside it (a
`ringpass.fx.findings.WholeRegion`'s entries and exits); `run_call` runs a call's nodes on values of its entries.
"""

from __future__ import annotations

import functools
import operator
import re

import torch.fx as fx
from torch.fx.node import map_aggregate

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)')


def frames(node: fx.Node) -> tuple[tuple[str, int, str], ...]:
    """(file, line, function) of every frame ``node`` was traced in, outermost first."""
    return _parsed(node.meta.get("stack_trace") or "")


@functools.lru_cache(maxsize=65536)
def _parsed(trace: str) -> tuple[tuple[str, int, str], ...]:
    return tuple((m["file"], int(m["line"]), m["function"]) for m in _FRAME.finditer(trace))


def enclosing_calls(graph: fx.Graph, node: fx.Node) -> list[tuple[str, str, list[fx.Node]]]:
    """(function name, where it is called: "file, line N, in caller", its nodes in graph order) of every function
    call ``node`` was traced in, innermost first (a function and the wrapper that only calls it: one call, where the
    wrapper is called).
    Nodes without a stack trace (Dynamo's bookkeeping) between two of a call's nodes belong to it."""
    stack, order = frames(node), list(graph.nodes)
    at = order.index(node)
    calls = []
    for depth in range(len(stack) - 1, 0, -1):

        def inside(i: int, depth: int = depth) -> bool | None:
            return _in_call(frames(order[i]), stack, depth)

        start = end = at
        while start > 0 and inside(start - 1) is not False and order[start - 1].op != "placeholder":
            start -= 1
        while end + 1 < len(order) and inside(end + 1) is not False and order[end + 1].op != "output":
            end += 1
        while inside(start) is None:  # undecided nodes at the edges stay outside
            start += 1
        while inside(end) is None:
            end -= 1
        file, line, caller = stack[depth - 1]
        call = (stack[depth][2], f"{file}, line {line}, in {caller}", order[start : end + 1])
        if calls and calls[-1][2] == call[2]:  # a wrapper that only calls it (a decorator): called where it is
            call = (calls.pop()[0], *call[1:])
        calls.append(call)
    return calls


def _in_call(theirs: tuple, stack: tuple, depth: int) -> bool | None:
    """Traced in the call of ``stack[depth]``'s function from ``stack[depth - 1]``'s line (None: no trace)."""
    if not theirs:
        return None
    file, _, function = stack[depth]
    return len(theirs) > depth and theirs[:depth] == stack[:depth] and theirs[depth][::2] == (file, function)


def boundary(nodes: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """(entries, exits) of a run of nodes: the values from outside it they read, and theirs read outside it."""
    inside = set(nodes)
    entries = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))
    return entries, [n for n in nodes if any(u not in inside for u in n.users)]


def run_call(gm: fx.GraphModule, nodes, entries: dict[fx.Node, object]) -> dict[fx.Node, object]:
    """Every value of ``nodes`` (a call's, in graph order) computed one by one from ``entries`` (each value the call
    reads from outside it; real or fake tensors)."""
    values = dict(entries)
    for node in nodes:
        args = map_aggregate(node.args, lambda a: values[a] if isinstance(a, fx.Node) else a)
        kwargs = map_aggregate(node.kwargs, lambda a: values[a] if isinstance(a, fx.Node) else a)
        if node.op == "call_method":
            values[node] = getattr(args[0], node.target)(*args[1:], **kwargs)
        elif node.op == "call_function":
            values[node] = node.target(*args, **kwargs)
        elif node.op == "get_attr":
            values[node] = operator.attrgetter(node.target)(gm)
        else:
            raise ValueError(f"a call holds no {node.op} node")
    return values
