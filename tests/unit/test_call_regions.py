"""`ringpass.fx.call_regions`: the function calls of a captured graph, told from its nodes' stack traces."""

from __future__ import annotations

import functools
import operator

import torch
import torch.fx as fx

from ringpass.fx.call_regions import boundary, enclosing_calls


def _inner(x):
    return torch.tanh(x) * 2


def _outer(x, y):
    return _inner(x + y) - y


def _wrapper(fn):
    @functools.wraps(fn)
    def wrapped(*args):
        return fn(*args)

    return wrapped


_wrapped_outer = _wrapper(_outer)


class TwoCalls(torch.nn.Module):
    def forward(self, x):
        y = x.exp()
        a = _wrapped_outer(x, y)  # the same function called twice: two calls
        b = _wrapped_outer(a, y)
        return a + b


def _graph() -> fx.GraphModule:
    captured = []

    def backend(gm, inputs):
        captured.append(gm)
        return gm

    torch._dynamo.reset()
    torch.compile(TwoCalls(), backend=backend, fullgraph=True)(torch.randn(3))
    return captured[0]


def test_each_call_is_its_own_run_of_nodes_innermost_first_a_wrapper_merged():
    gm = _graph()
    tanhs = [n for n in gm.graph.nodes if n.target is torch.tanh]
    assert len(tanhs) == 2
    calls = [enclosing_calls(gm.graph, tanh) for tanh in tanhs]
    for found in calls:
        assert [function for function, _, _ in found] == ["_inner", "_outer"]  # `wrapped` only calls `_outer`
        inner, outer = found[0][2], found[1][2]
        assert [n.target for n in inner] == [torch.tanh, operator.mul]
        assert [n.target for n in outer] == [operator.add, torch.tanh, operator.mul, operator.sub]
        assert "test_call_regions.py" in found[1][1] and "in forward" in found[1][1]  # called from forward
    assert not set(calls[0][1][2]) & set(calls[1][1][2])  # the two calls of _outer: no node in common
    assert calls[0][1][1] != calls[1][1][1]  # from two lines


def test_a_calls_boundary_is_what_it_reads_and_what_is_read_of_it():
    gm = _graph()
    first_tanh = next(n for n in gm.graph.nodes if n.target is torch.tanh)
    _, _, outer = enclosing_calls(gm.graph, first_tanh)[1]
    entries, exits = boundary(outer)
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    exp = next(n for n in gm.graph.nodes if n.op == "call_method" and n.target == "exp")
    assert entries == [x, exp]
    assert exits == [outer[-1]]  # `_outer`'s result, read by the next call and by `a + b`
