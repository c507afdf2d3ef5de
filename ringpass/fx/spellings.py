"""The one table of op spellings: how an FX node names its op, and the named sets of ops the passes match.

Method spellings are strings (``x.float()`` is ``call_method`` ``"float"``), function spellings the
functions themselves; `op_name` gives one name for both (``operator.truediv`` and ``x.__truediv__`` are
``"div"``, as the aten op is called).
"""

from __future__ import annotations

import operator
from functools import cache

import torch
import torch.fx as fx
import torch.nn.functional as F

from lowering import compat

# ---- values kept entry by entry ------------------------------------------------------------------------
CASTS = frozenset({"to", "type", "type_as", "float", "double", "half", "bfloat16", "long", "int", "bool"})
INTEGER_CASTS = frozenset({"long", "int", "bool"})  # a floating value becomes another number
COPIES = frozenset({"contiguous", "clone"})  # the same values in a new tensor, gradient and all
KEEP_VALUES = CASTS | COPIES | {"detach"}  # each entry of the result is a function of the same entry alone
KEEP_FLOATS = (CASTS - INTEGER_CASTS) | COPIES  # a floating value stays itself (to its dtype's precision) and trains

# ---- shapes --------------------------------------------------------------------------------------------
VIEWS = frozenset({"view", "reshape", torch.reshape})
EXPANDS = frozenset({"expand", "repeat", torch.broadcast_to})
FLATTENS = frozenset({"flatten", torch.flatten})  # reshapes that spell no sizes
LIKE = frozenset({"zeros_like", "ones_like", "full_like", "empty_like"})  # shaped like their first argument
CREATORS = frozenset(
    {
        torch.zeros,
        torch.ones,
        torch.empty,
        torch.full,
        torch.randn,
        torch.rand,
        "new_zeros",
        "new_ones",
        "new_empty",
        "new_full",
    }
)  # new tensors of sizes given as numbers
REARRANGE = (
    KEEP_VALUES
    | LIKE
    | {
        "view",
        "reshape",
        "transpose",
        "permute",
        "unsqueeze",
        "squeeze",
        "expand",
        "expand_as",
        "unflatten",
        "flatten",
        "view_as",
        "reshape_as",
        "t",
        "size",
        "dim",
        "numel",
        "repeat",
        "requires_grad_",
        "stack",
        "getattr",
        "pad",
        "movedim",
        "swapaxes",
        "broadcast_to",
        "copy_",
        "new_empty",
        "new_zeros",
        "new_ones",
        "new_full",
        "view_as_real",
        "view_as_complex",
    }
)  # ops that only move, cast or copy values, or read sizes

# ---- arithmetic on scores ------------------------------------------------------------------------------
MUL = frozenset({operator.mul, torch.mul, "mul"})
DIV = frozenset({operator.truediv, torch.div, "div"})
ADD = frozenset({operator.add, operator.iadd, torch.add, "add"})
TANH = frozenset({torch.tanh, "tanh"})

# ---- attention and the graph's own structure -------------------------------------------------------------
SDPA = frozenset({compat.sdpa_binding, F.scaled_dot_product_attention})
FLEX = torch.ops.higher_order.flex_attention
CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint
BODY_CALLS = {CHECKPOINT: 1, torch.ops.higher_order.invoke_subgraph: 2, torch.ops.higher_order.wrap: 1}
"""Higher-order ops that run their body once, in place -> the position of the body's first operand."""
PROMPT_SLOTS = (torch.ops.ringpass.prompt_slots, torch.ops.ringpass.prompt_slots.default)  # a ShardedCache's prefill

OPERATOR_NAMES = {
    "truediv": "div",
    "floordiv": "floor_divide",
    "and_": "bitwise_and",
    "or_": "bitwise_or",
    "xor": "bitwise_xor",
    "invert": "bitwise_not",
    "iadd": "add",
    "isub": "sub",
    "imul": "mul",
    "itruediv": "div",
}


def calls(node: fx.Node, targets) -> bool:
    """``node`` calls one of ``targets`` (functions, or method names as strings)."""
    return node.op in ("call_function", "call_method") and node.target in targets


def op_name(node: fx.Node) -> str:
    """The op's name as aten calls it, whether the graph calls a method, a function or an operator."""
    if node.op == "call_method":
        if node.target.startswith("__") and node.target.endswith("__"):  # x.__and__(y): as operator.and_
            bare = node.target[2:-2]
            return OPERATOR_NAMES.get(bare, OPERATOR_NAMES.get(bare + "_", bare))
        return node.target
    name = getattr(node.target, "__name__", str(node.target))
    return OPERATOR_NAMES.get(name, name) if node.target.__module__ in ("_operator", "operator") else name


def is_pointwise(node: fx.Node) -> bool:
    """An aten op with the ``pointwise`` tag (elementwise, broadcasting)."""
    return is_pointwise_name(op_name(node))


UNTAGGED_POINTWISE = frozenset({"floor_divide"})  # elementwise, but without the tag in torch (2.13 to 2.15)


@cache
def is_pointwise_name(name: str) -> bool:
    if name in UNTAGGED_POINTWISE:
        return True
    packet = getattr(torch.ops.aten, name, None)
    if packet is None or not hasattr(packet, "overloads"):
        return False
    return any(torch.Tag.pointwise in getattr(packet, overload).tags for overload in packet.overloads())
