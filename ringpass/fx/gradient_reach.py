"""Which values of a graph pass a gradient on to its outputs: the rules both halves of the rewrite's safety net
use (`record_gradient_paths` on the captured graph, `check_gradient_paths` on the rewritten one).

An edge ``arg -> node`` carries a gradient (`GradientRules.passes`) when ``arg`` is a floating tensor
that can carry one and ``node`` passes it on:
- a node Dynamo captured: its example value requires grad (Dynamo computed it under autograd: ``detach``,
  comparisons, integer results and ``no_grad`` regions give False), except where the op's own rule says
  otherwise: ringpass custom ops (`GRADIENT_ARGUMENTS`) and flex_attention's mask_mod buffers;
- a node a pass inserted or re-targeted (its example value is missing, recomputed, or copied from the node
  it replaced, so its ``requires_grad`` proves nothing about the edge): by the op. A ringpass custom op
  passes only the arguments its autograd formula differentiates (`GRADIENT_ARGUMENTS`; an op with no
  formula raises in the backward, which is loud, so it passes them all); ``detach``, sizes, comparisons,
  ``*_like`` / ``new_*`` creators and casts to integer or bool types pass nothing; any other op passes
  its floating tensor arguments.
An in-place write (``setitem``, ``copy_``, ``x.add_(y)``) passes its arguments on to the tensor it writes
(and the tensors that one views) when a later reader of that tensor carries the gradient on. The bodies
of ``checkpoint``, ``nested_compile_region`` and ``wrap`` (the subgraphs `inline_subgraphs` opens) are
walked too, so an argument their body never differentiates is not counted as reaching.
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from lowering import compat
from lowering import op as ring_op
from ringpass.fx.nodes import example_value, op_label
from ringpass.fx.spellings import BODY_CALLS, FLEX, INTEGER_CASTS, LIKE

EVERY = "*"  # every tensor argument

# What the autograd formula of each ringpass op returns a gradient for, by the op's argument names (a name
# whose argument is a list of tensors covers each of them). Its formula returns None for every other tensor
# argument: a value whose only way to the outputs goes through one of those would silently stop training.
# A ringpass op with no autograd formula raises in the backward (loud): it passes every argument here. A new
# op with a formula must say here what it differentiates (tests/unit/test_gradient_paths.py checks both).
GRADIENT_ARGUMENTS: dict[str, tuple] = {
    "ring_attention": ("q", "k", "v", *ring_op.PROGRAM_INPUTS),  # and the lists its mask and bias programs read
    "ring_attention_backward": (EVERY,),  # its own formula raises (no double backward): loud
    "shard_sequence": ("x",),
    "gather_sequence": ("x",),
    "all_reduce_sum": ("x",),
    "take_positions": ("x",),
    "ulysses_heads_to_tokens": ("x",),
    "ulysses_tokens_to_heads": ("x",),
    "sequence_to_heads": ("x",),
    "heads_to_sequence": ("x",),
    "own_heads": ("x",),
    "place_own_heads": ("x",),
    "chunk_summaries": ("summaries",),
    "causal_conv1d": ("x", "weight", "bias"),
    "causal_conv1d_backward": (EVERY,),  # no formula of its own (no double backward): loud
    "sequence_cumsum": ("x",),
    "sequence_cumsum_backward": (EVERY,),
    "reduce_grad": ("x",),  # also the Python functions lowering.sequence_ops.reduce_grad / scale_grad
    "scale_grad": ("x",),
}

# Ops that return no gradient to any argument: sizes, detaching, comparisons, fresh tensors shaped like one.
NO_GRADIENT = (
    LIKE
    | INTEGER_CASTS
    | {
        "detach",
        "detach_",
        "size",
        "dim",
        "numel",
        "stride",
        "data_ptr",
        "item",
        "tolist",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "logical_not",
        "logical_and",
        "logical_or",
        "logical_xor",
        "bitwise_not",
        "invert",
        "isnan",
        "isinf",
        "isfinite",
        "signbit",
        "argmax",
        "argmin",
        "argsort",
        "argwhere",
        "nonzero",
        "searchsorted",
        "bucketize",
        "rand_like",
        "randn_like",
        "randint_like",
        "new_zeros",
        "new_ones",
        "new_empty",
        "new_full",
        "new_tensor",
        "short",
        "byte",
        "char",
        "_set_grad_enabled",
    }
)
IN_PLACE_FUNCTIONS = {operator.setitem}
# flex_attention(q, k, v, score_mod, block_mask, scale, kernel_options, score_buffers, mask_buffers)
FLEX_MASK_BUFFERS = 8


@dataclass
class CapturedGradients:
    """What `record_gradient_paths` found in the captured graph."""

    inputs: list = field(default_factory=list)  # placeholders whose gradient reached an output, in graph order
    targets: dict = field(default_factory=dict)  # placeholder -> its target (to find it if a pass replaced it)
    step: dict = field(default_factory=dict)  # node -> the next node on one gradient path to an output
    trusted: dict = field(default_factory=dict)  # id(example value) -> (value, {(op, target)} of captured nodes)

    def path(self, start: fx.Node) -> list[fx.Node]:
        """``start`` and the captured nodes on its recorded path to an output (the output node last)."""
        path = [start]
        while path[-1] in self.step and len(path) <= len(self.step):
            path.append(self.step[path[-1]])
        return path


class GradientRules:
    """Whether an edge ``arg -> user`` carries a gradient (see the module docstring). ``trusted``: the captured
    example values (`captured_values`); without it every node is judged by its op."""

    def __init__(self, trusted: dict | None = None):
        self.trusted = trusted or {}
        self.through_body: dict[fx.Node, set] = {}  # a body op -> the operands its body differentiates

    def is_trusted(self, node: fx.Node) -> bool:
        value = example_value(node)
        entry = self.trusted.get(id(value)) if value is not None else None
        return entry is not None and entry[0] is value and (node.op, node.target) in entry[1]

    def may_carry(self, node: fx.Node) -> bool:
        """``node``'s value is (or holds) a floating tensor that can carry a gradient."""
        value = example_value(node)
        if value is None:
            return node.op != "get_attr"  # unknown (inserted without a value): judged by its users' rules
        if self.is_trusted(node):
            return requires_grad(value)
        return _floating(value)

    def passes(self, arg: fx.Node, user: fx.Node) -> bool:
        if not self.may_carry(arg):
            return False
        if user.op == "output":
            return True
        if user.op not in ("call_function", "call_method"):
            return False
        differentiated = differentiable_arguments(user)
        if differentiated is not None:
            return arg in differentiated
        if user in self.through_body:
            return arg in self.through_body[user]
        if user.target is FLEX and arg in flat_nodes(_argument(user, FLEX_MASK_BUFFERS, "mask_mod_other_buffers")):
            return False  # a mask_mod reads its buffers for booleans
        if self.is_trusted(user):
            return requires_grad(example_value(user))
        if op_label(user) in NO_GRADIENT or _casts_to_non_floating(user):
            return False
        value = example_value(user)
        return value is None or _floating(value)


def differentiable_arguments(node: fx.Node) -> set | None:
    """The argument nodes a ringpass op's backward returns a gradient for (or would raise for), or None when
    ``node`` calls no ringpass op."""
    op = ringpass_op(node)
    if op is None:
        return None
    name, names = op
    if name in GRADIENT_ARGUMENTS:
        wanted = GRADIENT_ARGUMENTS[name]
    elif not has_autograd_formula(name):
        wanted = (EVERY,)
    else:
        return set()  # a formula nobody described: count on nothing (and test_gradient_paths fails)
    bound = dict(zip(names, node.args)) | dict(node.kwargs)
    chosen = bound.values() if EVERY in wanted else [bound.get(a) for a in wanted]
    return set(flat_nodes(list(chosen)))


def ringpass_op(node: fx.Node) -> tuple[str, list[str]] | None:
    """(name, argument names) of the ringpass custom op or `lowering` function ``node`` calls, else None."""
    target = node.target
    if node.op != "call_function":
        return None
    if isinstance(target, compat.OpOverloadPacket):
        target = getattr(target, "default", None)
    if isinstance(target, compat.OpOverload):
        if target.namespace != "ringpass":
            return None
        schema = compat.schema_of(target)
        return schema.name.split("::")[1], [a.name for a in schema.arguments]
    name = getattr(target, "__name__", "")
    if callable(target) and getattr(target, "__module__", "").startswith("lowering.") and name in GRADIENT_ARGUMENTS:
        return name, list(inspect.signature(target).parameters)
    return None


def has_autograd_formula(name: str) -> bool:
    """A ringpass op with an autograd formula registered (`torch.library.custom_op`'s ``register_autograd``, or an
    Autograd kernel of a `torch.library.Library` op)."""
    opdef = compat.custom_op_defs.get(f"ringpass::{name}")
    if opdef is not None:
        return compat.custom_op_backward(opdef) is not None
    return compat.dispatch_has_kernel_for_dispatch_key(f"ringpass::{name}", "Autograd")


def gradient_reach(
    gm: fx.GraphModule, rules: GradientRules | None = None, outputs: set | None = None
) -> tuple[set, dict]:
    """(the nodes of ``gm`` whose gradient reaches an output, node -> the next node on one such path), in one
    walk from the outputs back. ``outputs``: only these positions of the output tuple count (a body's)."""
    rules = rules or GradientRules()
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    output = next(n for n in graph.nodes if n.op == "output")
    counted = _output_nodes(output, outputs)
    live, step = set(), {}
    for node in reversed(graph.nodes):
        if node.op == "output":
            continue
        if node.op == "call_function" and node.target in BODY_CALLS and isinstance(node.args[0], fx.Node):
            _enter_body(gm, node, live, rules)
        for user in node.users:
            reached = user in live or (user is output and node in counted)
            if reached and rules.passes(node, user):
                live.add(node)
                step[node] = user
                break
        else:
            if writes_in_place(node):  # its arguments reach what it writes, if a later reader carries that on
                for base in written(node):
                    later = [u for u in base.users if order[u] > order[node] and u in live and rules.passes(base, u)]
                    if later:
                        live.add(node)
                        step[node] = later[0]
                        break
    return live, step


def _enter_body(gm: fx.GraphModule, call: fx.Node, live: set, rules: GradientRules) -> None:
    """A body op (checkpoint, ...): the operands whose body placeholder reaches a body output that a live
    ``getitem`` of the call reads."""
    body = getattr(gm, call.args[0].target, None)
    if not isinstance(body, fx.GraphModule):
        return
    users = [u for u in call.users if u in live]
    if any(u.target is not operator.getitem for u in users):
        wanted = None
    else:
        wanted = {u.args[1] for u in users}
    body_live, _ = gradient_reach(body, GradientRules(rules.trusted), wanted) if users else (set(), {})
    operands = call.args[BODY_CALLS[call.target] :]
    inside = [n for n in body.graph.nodes if n.op == "placeholder"]
    rules.through_body[call] = {a for a, p in zip(operands, inside) if isinstance(a, fx.Node) and p in body_live}


def _output_nodes(output: fx.Node, positions: set | None) -> set:
    if positions is None:
        return set(output.all_input_nodes)
    results = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    return set(flat_nodes([results[i] for i in positions if isinstance(i, int) and i < len(results)]))


def writes_in_place(node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in IN_PLACE_FUNCTIONS
    return (
        node.op == "call_method"
        and node.target.endswith("_")
        and not node.target.startswith("__")
        and node.target not in NO_GRADIENT
        and bool(node.args)
        and isinstance(node.args[0], fx.Node)
    )


def written(node: fx.Node) -> list[fx.Node]:
    """The tensor an in-place op writes and the tensors it is a view of (``x[..., :8].copy_(y)`` writes x)."""
    found, current = [], node.args[0]
    while isinstance(current, fx.Node) and current not in found:
        found.append(current)
        value = example_value(current)
        if (
            not (isinstance(value, torch.Tensor) and compat.is_view(value))
            or not current.args
            or not isinstance(current.args[0], fx.Node)
        ):
            break
        current = current.args[0]
    return found


def _casts_to_non_floating(node: fx.Node) -> bool:
    """``x.to(torch.long)``, ``x.type(torch.bool)``: a cast whose dtype argument has no gradient."""
    dtypes = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, torch.dtype)]
    return bool(dtypes) and not any(d.is_floating_point or d.is_complex for d in dtypes)


def _argument(node: fx.Node, position: int, name: str):
    return node.args[position] if len(node.args) > position else node.kwargs.get(name, ())


def flat_nodes(value) -> list[fx.Node]:
    """The nodes in a (nested) argument."""
    found = []
    fx.node.map_arg(value, found.append)
    return found


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _floating(value) -> bool:
    return any(t.is_floating_point() or t.is_complex() for t in _tensors(value))


def requires_grad(value) -> bool:
    """``value`` is (or holds) a floating tensor that requires grad."""
    return any(t.requires_grad and (t.is_floating_point() or t.is_complex()) for t in _tensors(value))
