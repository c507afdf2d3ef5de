"""Sizes in FX graphs: compared without adding guards, and the ops that spell them as numbers.

A ``view`` / ``reshape`` / ``expand`` / ``repeat`` / ``broadcast_to`` spells its output sizes; with static shapes
Dynamo writes the sequence length into them as a literal. `resize_size_args` rescales those literals to
another length: the sequence probe's (`find_sequence_axes`) and this rank's (`localize_shapes`).
"""

from __future__ import annotations

import math

import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ringpass.fx.findings import SeqDim
from ringpass.fx.nodes import describe, example_value, plain, refusal
from ringpass.fx.spellings import EXPANDS, VIEWS


def same(a, b) -> bool:
    """``a == b`` for ints and SymInts, without adding guards (unknown counts as different)."""
    return statically_known_true(a == b)


def value_of(arg):
    """The example value of a node argument (a tensor, a SymInt), or the argument itself (a number)."""
    return example_value(arg) if isinstance(arg, fx.Node) else arg


def is_size_op(node: fx.Node) -> bool:
    """An op that spells its output sizes: ``view`` / ``reshape`` / ``expand`` / ``repeat`` / ``broadcast_to``."""
    return node.op in ("call_method", "call_function") and node.target in VIEWS | EXPANDS


def view_target_dim(node: fx.Node, in_axis: SeqDim, n) -> tuple[int, int]:
    """(output dim holding the sequence, its inner factor) of a reshape of a value whose sequence (of length
    ``n``) is ``in_axis``; refuses a reshape that splits the sequence."""
    in_shape, out_shape = example_value(node.args[0]).shape, example_value(node).shape
    stride = in_axis.inner
    for s in in_shape[in_axis.dim + 1 :]:
        stride *= s
    suffix = 1
    for j in range(len(out_shape) - 1, -1, -1):
        if statically_known_true(suffix <= stride) and statically_known_true(stride < suffix * out_shape[j]):
            if same(stride % suffix, 0) and same((suffix * out_shape[j]) % (stride * n), 0):
                return j, int(stride // suffix)
            break
        suffix *= out_shape[j]
    raise refusal(
        f"{describe(node)} reshapes {tuple(in_shape)} to {tuple(out_shape)}, which splits the sequence axis or "
        "mixes it with other axes; the tokens of a shard would not stay together." + chunked_scan(node, in_axis),
        node,
    )


def chunked_scan(node: fx.Node, axis: SeqDim, n=None, *, static_chunk: bool = False) -> str:
    """Where the reshape ``node`` cuts its input's sequence ``axis`` (of ``n`` tokens) into (chunks, chunk length) at
    the traced sizes (symbolic sizes at the values they were traced with; ``static_chunk``: only a chunk length the op
    spells as a number, as a model's chunk size is), the dims before and after it kept: chunks shorter than the
    sequence, or one chunk it was padded to; a sentence saying it is a chunked scan, else ""."""
    before = [plain(s) for s in example_value(node.args[0]).shape]
    after = [plain(s) for s in example_value(node).shape]
    inner = plain(axis.inner)
    if None in (*before, *after, inner):
        return ""
    token = inner * math.prod(before[axis.dim + 1 :])  # elements from one token to the next
    tokens = before[axis.dim] // inner  # the dim's tokens (times any dim merged in before the sequence)
    n = tokens if n is None else plain(n)
    for d in range(len(after) - 1):
        chunks, chunk = after[d], after[d + 1]
        kept = after[:d] == before[: axis.dim] and math.prod(after[d + 2 :]) == token
        if not kept or chunks * chunk != tokens or (static_chunk and chunk not in _literals(node)):
            continue
        if chunk > 1 and ((chunks > 1 and chunk < n) or (chunks == 1 and chunk > n)):  # or one chunk, padded to
            return (
                f" It cuts the sequence into chunks of {chunk} tokens: a chunked scan (Mamba2's SSD, Gated "
                "DeltaNet's delta rule) that carries a state from chunk to chunk. ringpass runs such a scan whole on "
                "every rank where it is a function call of its own that reads and returns per-token values; this one "
                'is not (docs/backend.md, "Sequence mixers other than attention").'
            )
    return ""


def _literals(node: fx.Node) -> set[int]:
    """The sizes a reshape, view or unflatten spells as numbers (in a tuple too)."""
    args = [a for arg in node.args[1:] for a in (arg if isinstance(arg, (tuple, list)) else (arg,))]
    return {a for a in args if isinstance(a, int)}


def resize_size_args(node: fx.Node, in_axes, length, n) -> tuple:
    """The args of a size op (`is_size_op`) with the literal sizes of its sequence dimensions rescaled from
    ``n`` to ``length``."""
    in_shape = example_value(node.args[0]).shape
    out_shape = list(example_value(node).shape)
    sizes = _spelled_sizes(node)
    if len(sizes) != len(out_shape):  # view(other.shape): sizes come from another tensor at run time
        return node.args
    for axis in in_axes:
        if not axis.aligned:
            continue
        if node.target in EXPANDS:
            j = axis.dim + len(out_shape) - len(in_shape)
            if node.target == "repeat":  # counts, not sizes: k copies of a shard are the shard of k copies
                continue
        else:
            j, _ = view_target_dim(node, axis, n)
        if isinstance(sizes[j], int) and sizes[j] != -1:  # a literal (static shapes); SymInt inputs are handled apart
            sizes[j] = out_shape[j] // n * length
    first = node.args[0]
    if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)):
        return first, type(node.args[1])(sizes)
    return (first, *sizes)


def _spelled_sizes(node: fx.Node) -> list:
    """The sizes a size op spells: ``view(a, b)`` and ``view((a, b))`` alike."""
    rest = list(node.args[1:])
    if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
        return list(rest[0])
    return rest
