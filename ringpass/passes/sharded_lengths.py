"""Make every read of the sequence length see the whole sequence when each rank passes its shard.

With ``inputs="sharded"`` Dynamo traces the model on this rank's shard, so a Python read of the length
(``x.shape[1]``, ``input_ids.size(-1)``) gives the local length N/P where the model means N: ESM's token
dropout divides by it, a model may scale by it. Only symbolic shapes leave such reads in the graph.

Matches, with ``inputs="sharded"``:

- static shapes (the sequence length is a number): raises `StaticShardedLengths`, naming the inputs each
  rank passes its shard of and their sequence dims. The front ends answer it by having Dynamo trace the
  frame again with those dims dynamic (`ringpass.frontend.retrace`), which brings the graph back here symbolic.
- a length Dynamo specialised while tracing (``if x.shape[1] == 64``, ``int(n)``, a loop over it): from
  there on Dynamo folds its reads into numbers of this rank's length: refused, naming where.
- symbolic shapes: every SymInt / SymFloat computed from the length (``n / 10``, ``n - 1``, ``x.size(1)``),
  and each op that reads one, as
  - sizes (``view`` / ``reshape`` / ``expand``, tensor creation, ``arange(n)`` positions, slices, ``pad``,
    ``torch.Size`` tuples, shape checks, ringpass's own ops): left as they are: the graph's sizes are this
    rank's, and the other passes give whole values (a mask program's ``arange(n)``, ``ones(B, n)``) the
    global length;
  - values (the number enters a tensor: ``h / n``, ``h * (n / 10)``, a comparison with positions, a
    ``torch.full`` fill value, a returned length): the same arithmetic on the global length N = n x P is
    written in, and the op reads that instead;
  - anything else: refused (what reads it, where, and what to do), never guessed.

Writes the value reads' new arguments and one report line per rewritten read (under "positions").
Nodes the ring replaces (inside an attention, lifted masks) are left alone.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from lowering import compat
from lowering.errors import NotSupportedError
from ringpass.fx.context import PassContext
from ringpass.fx.nodes import copy_origin, describe, example_value, op_label, plain, refusal, source_line, user_name
from ringpass.fx.sizes import is_size_op, same
from ringpass.fx.spellings import CREATORS, op_name

SYM = (torch.SymInt, torch.SymFloat, torch.SymBool)
# the number becomes (part of) a tensor's values
VALUE_OPS = {
    "add",
    "sub",
    "mul",
    "div",
    "true_divide",
    "floor_divide",
    "remainder",
    "fmod",
    "mod",
    "pow",
    "rsub",
    "radd",
    "rmul",
    "rtruediv",
    "rdiv",
    "rfloordiv",
    "rpow",
    "rmod",
    "lt",
    "le",
    "gt",
    "ge",
    "eq",
    "ne",
    "maximum",
    "minimum",
    "clamp",
    "clip",
    "clamp_min",
    "clamp_max",
    "where",
    "masked_fill",
    "masked_fill_",
    "fill_",
    "tensor",
    "as_tensor",
    "scalar_tensor",
    "full_like",
    "lerp",
    "add_",
    "sub_",
    "mul_",
    "div_",
    "addcmul",
    "addcdiv",
}
# the number is a size, a count or an index along an axis: the graph's own (local) sizes are right
SIZE_OPS = {
    "view",
    "reshape",
    "expand",
    "repeat",
    "broadcast_to",
    "unflatten",
    "narrow",
    "split",
    "split_with_sizes",
    "tensor_split",
    "select",
    "getitem",
    "pad",
    "Size",
    "empty_strided",
    "as_strided",
    "new_empty_strided",
    "_check",
    "_check_is_size",
    "_assert",
    "_assert_scalar",
    "sym_constrain_range",
    "sym_constrain_range_for_size",
    "eye",
    "zeros",
    "ones",
    "empty",
    "randn",
    "rand",
    "randint",
    "new_zeros",
    "new_ones",
    "new_empty",
}
FILL = {torch.full: (1, "fill_value"), "new_full": (2, "fill_value")}  # (argument position, keyword) of the value


class StaticShardedLengths(NotSupportedError):
    """``inputs="sharded"`` under static shapes: every read of the length was folded into a local number.
    ``inputs``: [(placeholder, sequence dims)] of the inputs each rank passes its shard of."""

    def __init__(self, message: str, inputs: list):
        super().__init__(message)
        self.inputs = inputs


def globalize_sharded_lengths(ctx: PassContext) -> None:
    if ctx.options.inputs != "sharded":
        return
    inputs = [
        (node, tuple(axis.dim for axis in ctx.sequence.axes[node]))
        for node, kind in ctx.sequence.sources.items()
        if kind == "input"
    ]
    specialized = _specialized(ctx, inputs)
    if specialized is not None:
        raise specialized
    if not ctx.dynamic:
        if inputs:
            raise _static(ctx, inputs)
        return
    _Globalize(ctx).run()


def _static(ctx: PassContext, inputs: list) -> StaticShardedLengths:
    names = ", ".join(f"`{user_name(node)}` (dim {', '.join(map(str, dims))})" for node, dims in inputs)
    global_length = plain(ctx.sequence.global_seq_len)
    return StaticShardedLengths(
        f"With inputs='sharded' this graph was traced with static shapes: Dynamo saw the sharded input(s) {names} at "
        f"this rank's length {plain(ctx.sequence.seq_len)} and folded every read of that length in the model's code "
        f"(`x.shape[1]`) into a number, which the ring cannot correct to the whole sequence's {global_length}. "
        "Compile with dynamic=True, or mark the sequence dims dynamic before the first call "
        "(torch._dynamo.mark_dynamic(x, 1)), so that the reads stay symbolic; or pass full inputs (inputs='full').",
        inputs,
    )


def _specialized(ctx: PassContext, inputs: list) -> NotSupportedError | None:
    """A refusal when Dynamo made a symbolic sequence length a number while tracing (a guard ``n == 64``)."""
    lengths = [example_value(node).shape[d] for node, dims in inputs for d in dims] + [ctx.sequence.seq_len]
    for length in lengths:
        if not isinstance(length, torch.SymInt):
            continue
        shape_env, traced = (
            length.node.shape_env,
            compat.unreplaced_expr(length.node),
        )  # before replacements
        expr = shape_env.replace(traced) if shape_env is not None else length.node.expr
        if not expr.is_number:
            continue
        where = ""
        for symbol in traced.free_symbols:
            sloc = shape_env.replacements_slocs.get(symbol) if shape_env is not None else None
            if sloc is not None:
                where = f" at {sloc.maybe_user_loc or sloc}"
                break
        return NotSupportedError(
            f"With inputs='sharded' the model fixes the sequence length to this rank's {int(expr)} while it is traced"
            f"{where} (a Python branch on it, int() of it, a loop over it): from there on Dynamo folds every read of "
            "the length into that number, which the ring cannot correct to the whole sequence's. Pass full inputs "
            "(inputs='full'), or compute from the length without fixing it (torch ops on x.shape[1] keep it symbolic)."
        )
    return None


class _Globalize:
    """Finds the length-derived symbolic values and rewrites the ops that read them as values."""

    def __init__(self, ctx: PassContext):
        self.ctx = ctx
        self.graph = ctx.gm.graph
        self.n = ctx.sequence.seq_len
        self.symbols = ctx.sequence.seq_len.node.expr.free_symbols
        self.twins: dict[fx.Node, fx.Node] = {}
        self.replaced = {n for m in ctx.attention for n in m.internal if n is not m.output} | set(ctx.masks.lifted)

    def run(self) -> None:
        derived = [node for node in self.graph.nodes if self._reads_length(node)]
        for node in derived:
            for user in list(node.users):
                if user in self.replaced or self._reads_length(user) or _holds_sizes(user):
                    continue  # arithmetic on the length: its own users are looked at
                positions = self._value_positions(user, node)
                if positions:
                    self._read_global(user, node, positions)

    def _reads_length(self, node: fx.Node) -> bool:
        value = example_value(node)
        return isinstance(value, SYM) and bool(value.node.expr.free_symbols & self.symbols)

    def _value_positions(self, user: fx.Node, node: fx.Node):
        """Where ``user`` reads ``node`` as a value: "all" arguments, the fill value's (position, keyword),
        or None where it reads it as a size."""
        name = "output" if user.op == "output" else op_name(user)
        if user.target in FILL:
            position, keyword = FILL[user.target]
            args, kwargs = list(user.args), dict(user.kwargs)
            if (len(args) > position and args[position] is node) or kwargs.get(keyword) is node:
                return (position, keyword)
            return None
        if name in VALUE_OPS or user.op == "output":
            return "all"
        if name in SIZE_OPS or is_size_op(user) or user.target in CREATORS or name in CREATORS:
            return None
        if user.target is torch.arange and self.ctx.sequence.sources.get(user) == "positions":
            return None  # arange(n): positions, rewritten by rewrite_positions / localize_shapes
        if str(user.target).startswith("ringpass."):
            return None  # ringpass's own ops (a ShardedCache's prompt_slots): their passes give them their lengths
        raise refusal(
            f"{describe(user)} reads the sequence length (x.shape[1], or a number computed from it) and ringpass "
            f"cannot tell whether it means this rank's {plain(self.n)} tokens (inputs='sharded': the graph sees its "
            f"shard) or the whole sequence's {plain(self.n) * self.ctx.world_size}: it is neither a size of the "
            "sequence nor a number in a tensor's values. Pass full inputs (inputs='full'); if this op reads the length "
            "as either, please report it.",
            user,
        )

    def _read_global(self, user: fx.Node, node: fx.Node, positions) -> None:
        twin = self._twin(node, user)
        if positions == "all":
            user.replace_input_with(node, twin)
        else:
            position, keyword = positions
            if len(user.args) > position and user.args[position] is node:
                user.args = (*user.args[:position], twin, *user.args[position + 1 :])
            else:
                user.kwargs = {**user.kwargs, keyword: twin}
        self.ctx.report.positions.append(
            f"sequence length read by {'the output' if user.op == 'output' else f'`{op_label(user)}`'} -> the whole "
            f"sequence's ({source_line(user)})"
        )

    def _twin(self, node: fx.Node, user: fx.Node) -> fx.Node:
        """``node`` computed from the global length: the length itself, or the same arithmetic on it."""
        if node in self.twins:
            return self.twins[node]
        value = example_value(node)
        if isinstance(value, torch.SymInt) and same(value, self.n):
            twin = self.ctx.insert_length("global")
        elif node.op == "call_function":
            args = fx.node.map_arg(node.args, lambda a: self._twin(a, user) if self._reads_length(a) else a)
            kwargs = fx.node.map_arg(node.kwargs, lambda a: self._twin(a, user) if self._reads_length(a) else a)
            with self.graph.inserting_after(node):
                twin = copy_origin(self.graph.call_function(node.target, args, kwargs), node)
        else:
            raise refusal(
                f"{describe(user)} reads a number computed from the sequence length by {describe(node)}, "
                "which ringpass cannot recompute for the whole sequence. Pass full inputs (inputs='full'), "
                "or please report this model.",
                user,
            )
        self.twins[node] = twin
        return twin


def _holds_sizes(node: fx.Node) -> bool:
    """A ``torch.Size`` or tuple of sizes (``x.size()[:-1] + (n,)``): read as sizes by whoever takes it."""
    value = example_value(node)
    return isinstance(value, (tuple, list, torch.Size)) and any(isinstance(v, SYM) for v in value)
