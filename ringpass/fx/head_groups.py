"""Heads that repeat in groups, proven from how a value was computed (keys repeated before the rotary embedding).

`repeated_groups(node, dim)` is the largest ``g`` this module can prove such that the value of ``node``
repeats along ``dim`` in consecutive groups of ``g`` (entry ``i`` equals entry ``i - i % g``). Falcon's new
decoder broadcasts each KV head to its query group (``broadcast_to(k, q.shape).flatten(2, 3)``) and only then
applies the rotary embedding; the attention receives ``Hq`` key heads that hold ``Hkv`` distinct ones, and the
ring should send only those. The proof follows the value back through:

- ``broadcast_to`` / ``expand`` (a dim broadcast from size 1 is constant: one group of its whole size);
- ``flatten`` / ``view`` / ``reshape`` that merge whole dims (a constant inner dim of size ``s`` makes groups of
  ``s`` in the merged dim) or keep the dim as it is;
- ``transpose`` / ``permute`` / ``unsqueeze`` (the dim moves), casts and copies;
- deterministic pointwise ops and ``cat`` along another dim: the gcd of their operands' groups, an operand
  broadcast along the dim counting as constant;
- basic indexing (slices, integers, ``None``, ``...``) that keeps the dim whole.

Anything else proves nothing (``g = 1``), so a claim is never made that the values do not support.
"""

from __future__ import annotations

import math
import operator
from functools import cache

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ringpass.fx.nodes import example_value
from ringpass.fx.spellings import KEEP_VALUES, is_pointwise, op_name

MAX_DEPTH = 64  # how far back a proof looks: a repeat is made a few ops before the attention


def repeated_groups(node: fx.Node, dim: int) -> int:
    return _Prover().groups(node, dim, 0)


class _Prover:
    def __init__(self):
        self.memo: dict[tuple[fx.Node, int], int] = {}

    def groups(self, node, dim: int, depth: int) -> int:
        value = example_value(node) if isinstance(node, fx.Node) else None
        if not isinstance(value, torch.Tensor) or not 0 <= dim < value.dim():
            return 1
        size = value.shape[dim]
        if not isinstance(size, int):
            return 1
        if size == 1:
            return 1  # nothing to repeat (a pointwise operand of size 1 is broadcast: see _operand)
        key = (node, dim)
        if key not in self.memo:
            self.memo[key] = 1  # a cycle proves nothing
            self.memo[key] = self._groups(node, value, dim, size, depth) if depth < MAX_DEPTH else 1
        return self.memo[key]

    def _groups(self, node: fx.Node, value, dim: int, size: int, depth: int) -> int:
        if node.op not in ("call_function", "call_method"):
            return 1
        name, args = op_name(node), node.args
        step = depth + 1
        if name in KEEP_VALUES:
            return self.groups(args[0], dim, step)
        if name in ("broadcast_to", "expand"):
            return self._operand(args[0], value, dim, size, step)
        if name in ("flatten", "view", "reshape"):
            return self._reshaped(args[0], value, dim, step)
        if name in ("transpose", "permute", "unsqueeze", "mT"):
            source_dim = _source_dim(node, name, value.dim(), dim)
            return 1 if source_dim is None else self.groups(args[0], source_dim, step)
        if node.target is operator.getitem:
            source = example_value(args[0]) if isinstance(args[0], fx.Node) else None
            if not isinstance(source, torch.Tensor):
                return 1  # an item of a tuple (split, unbind): not followed
            source_dim = _indexed_dim(args[1], source, dim)
            return 1 if source_dim is None else self.groups(args[0], source_dim, step)
        if name == "cat":
            cat_dim = node.kwargs.get("dim", args[1] if len(args) > 1 else 0) % value.dim()
            if cat_dim == dim:
                return 1
            return _gcd(size, [self.groups(t, dim, step) for t in args[0]])
        if is_pointwise(node) and not _random(name):
            return _gcd(size, [self._operand(a, value, dim, size, step) for a in (*args, *node.kwargs.values())])
        return 1

    def _operand(self, arg, out, dim: int, size: int, depth: int) -> int:
        """Groups of a pointwise op's operand along the output's ``dim`` (broadcast operands are constant)."""
        value = example_value(arg) if isinstance(arg, fx.Node) else None
        if not isinstance(value, torch.Tensor):
            return size
        aligned = dim - (out.dim() - value.dim())
        if aligned < 0 or value.shape[aligned] == 1:
            return size
        return self.groups(arg, aligned, depth)

    def _reshaped(self, source, out, dim: int, depth: int) -> int:
        """A reshape that keeps ``dim`` or merges whole source dims into it (inner dims first)."""
        shape = example_value(source).shape
        merged = _merged_dims(tuple(shape), tuple(out.shape), dim)
        if merged is None:
            return 1
        groups = 1
        for d in reversed(merged):  # the inner dim's groups, times the next one's while the inner is constant
            g = shape[d] if shape[d] == 1 else self.groups(source, d, depth)
            groups *= g
            if g != shape[d]:
                break
        return groups


def _gcd(size: int, groups: list) -> int:
    return math.gcd(size, *groups) if groups else size


@cache
def _random(name: str) -> bool:
    packet = getattr(torch.ops.aten, name, None)
    return (
        packet is not None
        and hasattr(packet, "overloads")
        and any(torch.Tag.nondeterministic_seeded in getattr(packet, o).tags for o in packet.overloads())
    )


def _merged_dims(source: tuple, out: tuple, dim: int):
    """The consecutive source dims whose sizes multiply to ``out[dim]`` and that start where ``out[:dim]``
    ends (a flatten, or the dim kept), or None (the dim is split or mixed). Symbolic sizes compare only
    where the comparison is known without a guard."""

    def equal(a, b) -> bool:
        return bool(statically_known_true(a == b))

    before = math.prod(out[:dim])
    for i in range(len(source) + 1):
        if equal(math.prod(source[:i]), before):
            for j in range(i + 1, len(source) + 1):
                if equal(math.prod(source[i:j]), out[dim]):
                    return list(range(i, j))
            return None
    return None


def _source_dim(node: fx.Node, name: str, rank: int, dim: int):
    """The source dim that ``dim`` of a transpose / permute / unsqueeze / mT result comes from."""
    args = node.args
    if name == "mT":
        a, b = rank - 2, rank - 1
    elif name == "transpose":
        if len(args) < 3:
            return None
        a, b = (d % rank for d in args[1:3])
    elif name == "permute":
        order = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
        return order[dim] % rank
    else:  # unsqueeze
        new = args[1] % rank
        return None if dim == new else dim - (dim > new)
    return b if dim == a else a if dim == b else dim


def _indexed_dim(index, source, dim: int):
    """The source dim that ``dim`` of ``source[index]`` comes from when the index is basic (slices, ints,
    None, ...) and leaves that dim whole, else None."""
    index = index if isinstance(index, tuple) else (index,)
    if any(not (isinstance(i, (int, slice)) or i is None or i is Ellipsis) for i in index):
        return None
    consumed = sum(1 for i in index if i is not None and i is not Ellipsis)
    expanded = []
    for i in index:
        expanded += [slice(None)] * (source.dim() - consumed) if i is Ellipsis else [i]
    expanded += [slice(None)] * (source.dim() - sum(1 for i in expanded if i is not None))
    out_dim = source_dim = 0
    for i in expanded:
        if i is None:
            if out_dim == dim:
                return None
            out_dim += 1
            continue
        if isinstance(i, int):
            source_dim += 1
            continue
        if out_dim == dim:
            return source_dim if i == slice(None) else None
        out_dim, source_dim = out_dim + 1, source_dim + 1
    return None
