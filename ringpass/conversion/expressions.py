"""The expressions an artifact stores, evaluated without running code from the file.

A converted model keeps two kinds of strings: Dynamo's source paths of the graph's inputs
(``L['input_ids'].size()[1]``, ``L['self']._modules['embed']._parameters['weight']``, ``G['scale']``) and, for a
dynamic conversion, Dynamo's shape conditions over them (``2 <= L['t0'] and L['t1'].size()[1] == L['t0']``). Read
from a file, such a string is data: `evaluate` parses it (`ast`) and walks it here, never with ``eval``, in a closed
grammar:

- names bound by the caller (``L``, ``G``), numbers, strings, booleans and None;
- ``x[k]`` with a constant ``k``; ``x.name`` where ``name`` is not a dunder (``__class__``, ``__globals__``: the
  ways out of a value to code are closed);
- calls of the size methods of a tensor (``size``, ``stride``, ``dim``, ``numel``, ``storage_offset``), of the
  math that printed shape conditions use (``max``, ``min``, ``abs``, ``int``, ``float``, ``math.floor``,
  ``math.ceil``, ``math.trunc``, torch's ``sym_max`` / ``sym_min`` / ``sym_float`` / ``sym_int``) and of Dynamo's
  getters its paths name (``___tuple_iterator_getitem``, ``___odict_getitem``), nothing else;
- comparisons, ``and`` / ``or`` / ``not``, ``+ - * / // %`` and unary minus.

Anything else is refused with `InvalidInputError`, naming the construct: the file is not run (the way
``torch.load(weights_only=True)`` reads tensors and refuses code).
"""

from __future__ import annotations

import ast
import functools
import math
import operator
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

from lowering.errors import InvalidInputError

SIZE_METHODS = frozenset({"size", "stride", "dim", "numel", "storage_offset"})
FUNCTIONS = {
    "max": max,
    "min": min,
    "abs": abs,
    "int": int,
    "float": float,
    # what torch's printer of shape conditions may name besides math (`symbolic_shapes.SYMPY_INTERP`)
    "IsNonOverlappingAndDenseIndicator": SYMPY_INTERP["IsNonOverlappingAndDenseIndicator"],
    "cast_symbool_to_symint_guardless": SYMPY_INTERP["cast_symbool_to_symint_guardless"],
}
MODULES = {"math": math, "torch": torch}  # read only for the functions below
MODULE_FUNCTIONS = frozenset(
    {math.floor, math.ceil, math.trunc, torch.sym_max, torch.sym_min, torch.sym_float, torch.sym_int}
)
BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
UNARY = {ast.Not: operator.not_, ast.USub: operator.neg, ast.UAdd: operator.pos}
COMPARE = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}


def evaluate(text: str, names: dict[str, Any], getters: dict[str, Any] | None = None) -> Any:
    """The value of ``text`` with ``names`` bound (``getters``: Dynamo's helper functions a path may call)."""
    return _Walk(text, names, getters or {}).value(parse(text).body)


@functools.lru_cache(maxsize=4096)
def parse(text: str) -> ast.Expression:
    try:
        return ast.parse(text, mode="eval")
    except SyntaxError as error:
        raise InvalidInputError(
            f"load: the artifact holds an expression that does not parse: {text!r} ({error})."
        ) from None


class _Walk:
    def __init__(self, text: str, names: dict, getters: dict):
        self.text, self.names, self.getters = text, names, getters

    def refuse(self, what: str) -> InvalidInputError:
        return InvalidInputError(
            f"load: the artifact holds an expression with {what}, which a converted model never stores: {self.text!r}. "
            "Loading evaluates no code from a file; convert and save the model again with ringpass."
        )

    def value(self, node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and (node.value is None or type(node.value) in (bool, int, float, str)):
            return node.value
        if isinstance(node, ast.Name):
            for scope in (self.names, self.getters, FUNCTIONS, MODULES):
                if node.id in scope:
                    return scope[node.id]
            raise self.refuse(f"the name {node.id!r}")
        if isinstance(node, ast.Subscript):
            key = node.slice
            if not isinstance(key, ast.Constant) or type(key.value) not in (int, str):
                raise self.refuse("a subscript that is not a constant")
            return self.value(node.value)[key.value]
        if isinstance(node, ast.Attribute):
            if node.attr.startswith("__"):
                raise self.refuse(f"the attribute {node.attr!r}")
            return getattr(self.value(node.value), node.attr)
        if isinstance(node, ast.Call):
            return self.call(node)
        if isinstance(node, ast.Compare):
            left = self.value(node.left)
            for op, right_node in zip(node.ops, node.comparators):
                if type(op) not in COMPARE:
                    raise self.refuse(f"the comparison {type(op).__name__}")
                right = self.value(right_node)
                if not COMPARE[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(node, ast.BoolOp):
            values = (self.value(v) for v in node.values)
            return all(values) if isinstance(node.op, ast.And) else any(values)
        if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
            return UNARY[type(node.op)](self.value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
            return BINARY[type(node.op)](self.value(node.left), self.value(node.right))
        raise self.refuse(f"a {type(node).__name__}")

    def call(self, node: ast.Call) -> Any:
        if node.keywords:
            raise self.refuse("a call with keyword arguments")
        function = self.value(node.func)
        allowed = (
            any(function is f for f in FUNCTIONS.values())
            or any(function is f for f in self.getters.values())
            or function in MODULE_FUNCTIONS
            or (
                isinstance(getattr(function, "__self__", None), torch.Tensor)
                and getattr(function, "__name__", "") in SIZE_METHODS
            )
        )
        if not allowed:
            raise self.refuse(f"a call of {ast.unparse(node.func)!r}")
        return function(*(self.value(a) for a in node.args))
