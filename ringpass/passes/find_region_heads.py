"""Find which function calls computed whole keep their heads apart, so that each rank can run one on every token of
H / P heads instead of every head (`split_region_heads` writes that; the rest stay computed whole).

Matches each `WholeRegion` of ``ctx.sequence.regions`` (a chunked scan: Mamba2's ``mamba2_chunk_scan``, Gated
DeltaNet's ``torch_chunk_gated_delta_rule``). A head probe runs the call's nodes on fake values whose heads are
H / P, for each candidate H (the sizes of an exit's dims other than its batch and sequence dims that divide by P);
of those that run, the one that reads the fewest bytes whole gives the call's `HeadSplit`:

- an entry with one dim of size H has it as its head dim (a per-token entry is exchanged for every token of this
  rank's heads, a whole one, such as a per-head parameter, narrowed to them); an entry with none is read whole
  (Mamba2's ``B`` and ``C``, with fewer groups than heads: all-gathered);
- an op that reads no head dim, or creates a tensor (``x.new_zeros(B, H, D)``), and returns a dim of size H (``B``
  repeated to every head, a state created with H heads) is narrowed to this rank's heads after it;
- an op that reads a head dim must act on each head apart (`token_ops.classify` over the head dims: no sum, pick,
  concatenation or scan along them); one that spells sizes (``view``, ``reshape``, ``expand``) gets its head sizes
  divided by P (`resize_size_args`);
- every exit comes out with one head dim, and no value in the call has another dim of size H (a size equal to the
  heads' that is not theirs would make the split ambiguous), and the call opens no vmap level.

Writes ``ctx.sequence.heads[region]``: the `HeadSplit`, or, where no candidate runs or the option ``scans="whole"``
asks so, why (the report's strategy for the call computed whole says it).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate

from lowering.errors import NotSupportedError
from ringpass.fx.context import PassContext
from ringpass.fx.findings import HeadSplit, SeqDim, WholeRegion
from ringpass.fx.nodes import example_value, is_vmap_bookkeeping, nbytes, op_label, probing, user_name
from ringpass.fx.sizes import is_size_op, resize_size_args, same, view_target_dim
from ringpass.fx.spellings import CREATORS, EXPANDS
from ringpass.fx.token_ops import classify


class _NoSplit(Exception):
    """Why the call cannot run on a share of these heads."""


def find_region_heads(ctx: PassContext) -> None:
    for region in ctx.sequence.regions:
        ctx.sequence.heads[region] = _plan(ctx, region)


def _plan(ctx: PassContext, region: WholeRegion) -> HeadSplit | str:
    if ctx.options.scan_strategy == "whole":
        return "scans='whole'"
    if any(is_vmap_bookkeeping(node) for node in region.internal):
        return "it runs under vmap"
    tried, found = [], []
    for heads in _candidates(ctx, region):
        if heads % ctx.world_size:
            tried.append(f"{heads} does not divide by {ctx.world_size} ranks")
            continue
        try:
            found.append(_HeadProbe(ctx, region, heads).run())
        except _NoSplit as why:
            tried.append(f"split into {heads} heads, {why}")
    if found:  # the split that reads the fewest per-token bytes whole
        return min(
            found,
            key=lambda split: sum(
                nbytes(example_value(e)) for e, d in split.entries.items() if d is None and ctx.sequence.axes.get(e)
            ),
        )
    return "; ".join(tried) or "its outputs have no dim besides the batch and the sequence"


def _candidates(ctx: PassContext, region: WholeRegion) -> list[int]:
    sizes = []
    for node, seq_dim in region.exits:
        shape = example_value(node).shape
        sizes += [int(s) for d, s in enumerate(shape) if d not in (0, seq_dim) and s > 1]
    return [s for s in dict.fromkeys(sizes) if not same(s, ctx.sequence.seq_len)]


class _HeadProbe:
    def __init__(self, ctx: PassContext, region: WholeRegion, heads: int):
        self.ctx, self.region, self.heads = ctx, region, heads
        self.share = heads // ctx.world_size
        self.values: dict[fx.Node, object] = {}
        self.axes: dict[fx.Node, tuple[SeqDim, ...]] = {}  # node -> its head dims
        self.entries: dict[fx.Node, int | None] = {}
        self.narrowed: dict[fx.Node, int] = {}
        self.respelled: dict[fx.Node, tuple] = {}

    def run(self) -> HeadSplit:
        with probing(self.ctx.gm.graph):
            for entry in self.region.entries:
                self._enter(entry)
            for node in self.region.internal:
                self._step(node)
        self._check_unambiguous()
        exits = {}
        for node, seq_dim in self.region.exits:
            dims = [axis.dim for axis in self.axes.get(node, ()) if axis.inner == 1]
            if len(dims) != 1 or node in self.narrowed:
                raise _NoSplit(f"its output {user_name(node)} does not keep one head dim read from its inputs")
            exits[node] = (seq_dim, dims[0])
        return HeadSplit(self.heads, self.entries, self.narrowed, self.respelled, exits)

    def _enter(self, entry: fx.Node) -> None:
        value = example_value(entry)
        dims = self._head_sized(entry, value)
        if len(dims) > 1:
            raise _NoSplit(f"{user_name(entry)} {tuple(value.shape)} has {len(dims)} dims of size {self.heads}")
        self.entries[entry] = dims[0] if dims else None
        self.values[entry] = self._split(value, dims[0]) if dims else value
        if dims:
            self.axes[entry] = (SeqDim(dims[0]),)

    def _head_sized(self, node: fx.Node, value) -> list[int]:
        if not isinstance(value, torch.Tensor):
            return []
        sequence = {axis.dim for axis in self.ctx.sequence.axes.get(node, ())}
        return [d for d, s in enumerate(value.shape) if same(s, self.heads) and d not in sequence]

    def _split(self, value: torch.Tensor, dim: int) -> torch.Tensor:
        shape = list(value.shape)
        shape[dim] = shape[dim] // self.heads * self.share
        return torch.empty(shape, dtype=value.dtype, device=value.device)

    def _step(self, node: fx.Node) -> None:
        original = example_value(node)
        if node.target in CREATORS or not any(
            self.axes.get(a) or self._tuple_has_heads(a) for a in node.all_input_nodes
        ):
            dims = self._head_sized(node, original)
            if len(dims) > 1:
                raise _NoSplit(f"`{op_label(node)}` makes {len(dims)} dims of size {self.heads}")
            if dims:  # the first value with a head dim: narrowed to this rank's heads after it
                self.narrowed[node] = dims[0]
                self.values[node], self.axes[node] = self._split(original, dims[0]), (SeqDim(dims[0]),)
            else:
                self.values[node] = original
            return
        role, why = classify(node, self._head_dims, output_has_seq=True)
        if role != "token":
            raise _NoSplit(f"`{op_label(node)}` does not keep the heads apart ({why or role})")
        args = map_aggregate(node.args, lambda a: self.values[a] if isinstance(a, fx.Node) else a)
        kwargs = map_aggregate(node.kwargs, lambda a: self.values[a] if isinstance(a, fx.Node) else a)
        if is_size_op(node) and self.axes.get(node.args[0]):
            try:
                spelled = resize_size_args(node, self.axes[node.args[0]], self.share, self.heads)
            except NotSupportedError:
                raise _NoSplit(f"`{op_label(node)}` splits a head dim or merges it with others") from None
            if spelled != node.args:
                self.respelled[node] = spelled
            args = map_aggregate(spelled, lambda a: self.values[a] if isinstance(a, fx.Node) else a)
        try:
            if node.op == "call_method":
                value = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                value = node.target(*args, **kwargs)
        except Exception as error:
            raise _NoSplit(f"`{op_label(node)}` fails on a share of them: {type(error).__name__}: {error}") from None
        self.values[node] = value
        self._record_axes(node, original, value)

    def _head_dims(self, node: fx.Node) -> set[int]:
        return {axis.dim for axis in self.axes.get(node, ())}

    def _tuple_has_heads(self, node: fx.Node) -> bool:
        value, original = self.values.get(node), example_value(node)
        if not isinstance(value, (tuple, list)) or not isinstance(original, (tuple, list)):
            return False
        return any(isinstance(v, torch.Tensor) and v.shape != o.shape for v, o in zip(value, original))

    def _record_axes(self, node: fx.Node, original, value) -> None:
        if not isinstance(original, torch.Tensor):
            return
        axes = []
        for d in range(original.dim()):
            if same(original.shape[d], value.shape[d]):
                continue
            if not same(original.shape[d] % self.heads, 0) or not same(
                value.shape[d] * self.ctx.world_size, original.shape[d]
            ):
                raise _NoSplit(f"`{op_label(node)}` changes dim {d} from {original.shape[d]} to {value.shape[d]}")
            axes.append(SeqDim(d, self._inner(node, d)))
        if axes:
            self.axes[node] = tuple(axes)

    def _inner(self, node: fx.Node, dim: int) -> int:
        """How many elements of each head dim ``dim`` of ``node``'s value holds (1 unless merged with a later dim)."""
        size = example_value(node).shape[dim]
        if not is_size_op(node) or node.target in EXPANDS:
            return int(size) // self.heads
        try:
            found = {view_target_dim(node, axis, self.heads) for axis in self.axes[node.args[0]]}
        except NotSupportedError:
            raise _NoSplit(f"`{op_label(node)}` splits a head dim or merges it with others") from None
        return next((inner for out_dim, inner in found if out_dim == dim), 1)

    def _check_unambiguous(self) -> None:
        for node in (*self.region.entries, *self.region.internal):
            value = example_value(node)
            other = [d for d in self._head_sized(node, value) if d not in self._head_dims(node)]
            if other:
                raise _NoSplit(
                    f"{user_name(node)} {tuple(value.shape)} has a dim of size {self.heads} that is not a head dim"
                )
