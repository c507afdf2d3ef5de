"""`ringpass.fx.call_regions`: the function calls of a captured graph, told from its nodes' stack traces; and
`ringpass.fx.sizes.chunked_scan`, the reshape that makes such a call a chunked scan."""

from __future__ import annotations

import functools
import operator

import torch
import torch.fx as fx
from hypothesis import given, settings
from hypothesis import strategies as st

from ringpass.fx.call_regions import boundary, enclosing_calls
from ringpass.fx.findings import SeqDim
from ringpass.fx.sizes import chunked_scan


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


def _reshape_node(before: tuple, after: tuple, target="reshape") -> fx.Node:
    """A graph's ``x.reshape(*after)`` (or ``unflatten``) node of an ``x`` of shape ``before``, with example values."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(before, device="meta")
    node = graph.call_method(target, (x, *after))
    node.meta["val"] = torch.empty(after, device="meta")
    return node


@settings(max_examples=200, deadline=None)
@given(
    batch=st.integers(1, 3),
    tokens=st.integers(2, 40),
    chunk=st.integers(1, 45),
    features=st.sampled_from([1, 4, 6]),
    heads_first=st.booleans(),
)
def test_a_reshape_into_chunks_is_read_as_a_chunked_scan_and_nothing_else_is(
    batch, tokens, chunk, features, heads_first
):
    """`chunked_scan`: a sequence of ``tokens`` padded to whole chunks and cut into (chunks, chunk) with the dims after
    it kept (Mamba2's ``[B, N, H, D]``, the delta rule's ``[B, H, N, D]``) is a scan where the chunk is shorter than the
    sequence and longer than one token, or one chunk the sequence was padded to; reshapes that keep the sequence whole
    (heads out of the features, also of a shifted or extended sequence with a batch of one, ``[B * N, F]`` back to
    ``[B, N, F]``, ``[B, N, 1, F]``) never are."""
    padded = -(-tokens // chunk) * chunk
    lead = (batch, 2) if heads_first else (batch,)
    node = _reshape_node((*lead, padded, features), (*lead, padded // chunk, chunk, features))
    found = chunked_scan(node, SeqDim(len(lead)), tokens)
    assert bool(found) == (chunk != tokens and chunk > 1), (found, padded)
    assert not found or f"chunks of {chunk} tokens" in found
    whole = (batch, tokens, features)
    if features % 2 == 0:
        assert not chunked_scan(_reshape_node(whole, (batch, tokens, 2, features // 2)), SeqDim(1), tokens)
        for shifted in (tokens - 1, tokens + 1):  # x[:, 1:] or a token concatenated before, then heads: no cut
            heads = _reshape_node((1, shifted, features), (1, shifted, 2, features // 2))
            assert not chunked_scan(heads, SeqDim(1, aligned=False), tokens)
    assert not chunked_scan(_reshape_node((batch * tokens, features), whole), SeqDim(0), tokens)
    assert not chunked_scan(_reshape_node(whole, (batch, tokens, 1, features)), SeqDim(1), tokens)
    assert not chunked_scan(_reshape_node((batch, tokens * features), whole), SeqDim(1, inner=features), tokens)
    unflattened = _reshape_node((batch, padded, features), (batch, padded // chunk, chunk, features), "unflatten")
    assert bool(chunked_scan(unflattened, SeqDim(1), tokens)) == bool(found)
