"""`SequenceSharded`: a tensor that holds this rank's tokens of a sequence-sharded value, and says so.

A ring graph returns its sequence-sharded outputs as `SequenceSharded` (the backend's ``outputs="auto"``), and a
ring graph that receives one takes it as already sharded: nothing is gathered or sliced between graphs.

    h = block(x)           # SequenceSharded: h.shape is the whole [B, N, H]; this rank's tokens inside
    h.to_local()           # this rank's tokens, in the layout's order (zigzag: two chunks)
    h.full_tensor()        # the whole [B, N, H] in the original order: an all-gather, every rank must call it
    print(h)               # this rank's values and the layout; never communicates

It reports the global shape, so model code that reads a length reads the whole sequence's, and Dynamo traces it
as a plain tensor of that shape (under tracing every op sees a stand-in of the global shape). Why not a DTensor:
DTensor's placements cannot say "zigzag" (`Shard` is contiguous, `_StridedShard` another permutation; a custom
placement is refused), and a DTensor input makes Dynamo trace through DTensor's rules, which refuse the plain
weights a ring graph reads (docs/backend.md). `SequenceSharded.from_dtensor` / `to_dtensor` convert when the
layout is contiguous.

Eager ops act on it by the placement rules of DESIGN.md (the result is sharded the same way unless said):
- pointwise ops of sharded values of one layout, scalars, and plain tensors that broadcast against the sequence
  dimension (size 1 there, or the whole sequence: then each rank indexes its own tokens of it, for free);
- views that keep the sequence a dimension of its own or merge it with the dimensions before it
  (``x.view(B * N, H)``), transposes, permutes, slices and selects of other dimensions, `cat` along another;
- matrix products (`mm`, `addmm`, `bmm`: `linear`, `matmul`): sharded along a kept dimension, the product is
  sharded; contracted over the sequence (a weight's gradient), each rank's product is all-reduced;
- reductions, softmax and argmax over other dimensions; a sum, mean, max or min over the sequence is each rank's
  part all-reduced (padding slots left out), every rank gets the whole result;
- `nll_loss` (`cross_entropy`) over per-token rows: the loss sum and the count of counted tokens all-reduced;
- `embedding` of sharded token ids: this rank's rows (the table's gradient: each rank's rows all-reduced);
- a select or slice of sequence positions (``logits[:, -1]``): the rows of the ranks that hold them, all-reduced.
Any other op raises `NeedsWholeSequence`, which names the op and says what to call: never a silent gather.
The ops that communicate are collectives: every rank of the ring must run them, as it runs the model.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from lowering.errors import InvalidInputError, NotSupportedError
from lowering.failures import wait_collective
from lowering.groups import group_by_name, resolve_group
from lowering.layout import local_length
from lowering.sequence_ops import (
    all_reduce_sum,
    gather_sequence,
    local_positions,
    local_token_mask,
    position_slots,
    shard_sequence,
)

aten = torch.ops.aten


class NeedsWholeSequence(NotSupportedError):
    """An eager op on a `SequenceSharded` value that its rules cannot run on each rank's tokens."""


@dataclass(frozen=True)
class SequenceSpec:
    """How a value is sharded: along ``dim``, ``seq_len`` tokens laid out as ``kind`` over ``world_size`` ranks of
    the group named ``group_name``. ``rows``: how many sequences ``dim`` holds one after the other (1; more once a
    view merged the batch into it: ``[B, N, H] -> [B * N, H]`` has ``rows = B``)."""

    kind: str
    world_size: int
    seq_len: int
    dim: int
    group_name: str
    rows: int = 1

    @property
    def local_len(self):
        return local_length(self.kind, self.world_size, self.seq_len)

    def global_shape(self, local_shape) -> list:
        shape = list(local_shape)
        shape[self.dim] = self.rows * self.seq_len
        return shape

    def layout_args(self) -> tuple:
        """(kind, world_size, seq_len, group_name): what the runtime's sequence ops take."""
        return self.kind, self.world_size, self.seq_len, self.group_name

    def positions(self, device) -> torch.Tensor:
        """The global index along ``dim`` of each local slot (padding: the last real token, so it indexes)."""
        own = local_positions(*self.layout_args(), device)
        return (own + torch.arange(self.rows, device=device)[:, None] * self.seq_len).reshape(-1)

    def valid(self, like: torch.Tensor, dim: int | None = None) -> torch.Tensor:
        """True at this rank's real slots, shaped to broadcast against ``like`` along ``dim`` (default: its own)."""
        valid = local_token_mask(*self.layout_args(), like.device).repeat(self.rows)
        shape = [1] * like.dim()
        shape[self.dim if dim is None else dim] = -1
        return valid.view(shape)


class SequenceSharded(torch.Tensor):
    """A tensor of the global shape whose data is this rank's tokens along ``spec.dim``; see the module docstring."""

    _local: torch.Tensor
    spec: SequenceSpec

    @staticmethod
    def __new__(cls, local: torch.Tensor, spec: SequenceSpec):
        shape = spec.global_shape(local.shape)
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=local.dtype, device=local.device)

    def __init__(self, local: torch.Tensor, spec: SequenceSpec):
        self._local, self.spec = local, spec

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, *, tensor_contents=None) -> str:  # no collective: printing on one rank must not hang
        s = self.spec
        return (
            f"SequenceSharded(shape={tuple(self.shape)}, dim={s.dim}, layout={s.kind} over {s.world_size} ranks, "
            f"this rank's {s.local_len} of {s.seq_len} tokens{'' if s.rows == 1 else f' x {s.rows} rows'}: "
            f"{self._local!r})"
        )

    def __tensor_flatten__(self):
        s = self.spec
        return ["_local"], (s.kind, s.world_size, s.dim, s.group_name, s.rows)

    @staticmethod
    def __tensor_unflatten__(inner, context, outer_size, outer_stride):
        kind, world_size, dim, group_name, rows = context
        spec = SequenceSpec(kind, world_size, outer_size[dim] // rows, dim, group_name, rows)
        return SequenceSharded(inner["_local"], spec)

    @classmethod
    @torch._disable_dynamo  # eager code inside a compiled region runs these rules as they are, never traced
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        carriers = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, SequenceSharded)]
        if any(_is_fake(c._local) for c in carriers):  # traced (Dynamo): a plain tensor of the global shape
            args, kwargs = pytree.tree_map_only(SequenceSharded, _stand_in, (args, kwargs))
            return func(*args, **kwargs)
        rule = _RULES.get(func.overloadpacket)
        if rule is None and torch.Tag.pointwise in func.tags:
            rule = _pointwise
        if rule is None:
            raise _needs_whole(func, "it is not one of the ops that act on each rank's tokens")
        with torch.no_grad():  # autograd recorded the op on the carriers; their tokens need no graph of their own
            out = rule(func, args, kwargs, carriers)
        if any(_marked_dynamic(c) for c in carriers):  # a length compiled as any length stays so downstream
            for result in pytree.tree_leaves(out):
                if isinstance(result, SequenceSharded):
                    torch._dynamo.maybe_mark_dynamic(result, result.spec.dim)
        return out

    # what users call
    @torch._disable_dynamo
    def to_local(self) -> torch.Tensor:
        """This rank's tokens along ``spec.dim``, in the layout's order (differentiable)."""
        return _ToLocal.apply(self)

    @torch._disable_dynamo
    def full_tensor(self) -> torch.Tensor:
        """The whole value in the original token order: an all-gather (differentiable); every rank must call it."""
        s = self.spec
        local = self.to_local()
        if s.rows > 1:
            local = local.unflatten(s.dim, (s.rows, -1))
        whole = gather_sequence(local, s.dim + (s.rows > 1), *s.layout_args())
        return whole.flatten(s.dim, s.dim + 1) if s.rows > 1 else whole

    @staticmethod
    def from_local(local: torch.Tensor, dim: int, *, seq_len: int, layout: str = "zigzag", group=None):
        """Wrap this rank's tokens (``local``, in ``layout``'s order along ``dim``) of a ``seq_len``-token sequence."""
        group = resolve_group(group)
        world_size = dist.get_world_size(group) if group is not None else 1
        dim = dim % local.dim()
        spec = SequenceSpec(layout, world_size, seq_len, dim, group.group_name if group is not None else "")
        if local.size(dim) != spec.local_len:
            raise InvalidInputError(
                f"from_local: {local.size(dim)} tokens along dim {dim}, but the {layout} layout of {seq_len} tokens "
                f"over {world_size} ranks gives each rank {spec.local_len}."
            )
        return carry(local, spec)

    @staticmethod
    def distribute(whole: torch.Tensor, dim: int = 1, *, layout: str = "zigzag", group=None):
        """This rank's tokens of ``whole`` (the same on every rank), carried (differentiable; free forward)."""
        group = resolve_group(group)
        name, world_size = (group.group_name, dist.get_world_size(group)) if group is not None else ("", 1)
        dim, seq_len = dim % whole.dim(), whole.size(dim)
        local = shard_sequence(whole, dim, layout, world_size, seq_len, name)
        return carry(local, SequenceSpec(layout, world_size, seq_len, dim, name))

    def to_dtensor(self, mesh):
        """The same value as a DTensor on ``mesh`` (one dimension, the ring's ranks), ``Shard(dim)``: only for the
        contiguous layout without padding, the order DTensor knows."""
        from torch.distributed.tensor import DTensor, Shard

        s = self.spec
        if s.kind != "contiguous" or s.rows != 1 or s.seq_len % s.world_size:
            raise NotSupportedError(
                f"to_dtensor: DTensor's Shard({s.dim}) is the contiguous order of equal chunks; this value is "
                f"{s.kind} over {s.world_size} ranks ({s.seq_len} tokens). Compile with layout='contiguous' and a "
                "length that divides by the ranks, or call full_tensor()."
            )
        return DTensor.from_local(self.to_local(), mesh, [Shard(s.dim)], run_check=False)

    @staticmethod
    def from_dtensor(tensor):
        """A DTensor sharded (``Shard(dim)``, evenly) over a one-dimensional mesh, as a contiguous `SequenceSharded`."""
        from torch.distributed.tensor import Shard

        (placement,) = tensor.placements
        if not isinstance(placement, Shard) or tensor.size(placement.dim) % tensor.device_mesh.size():
            raise NotSupportedError(
                f"from_dtensor: needs one Shard(dim) placement over an even split; got {tensor.placements} of "
                f"{tuple(tensor.shape)}."
            )
        return SequenceSharded.from_local(
            tensor.to_local(),
            placement.dim,
            seq_len=tensor.size(placement.dim),
            layout="contiguous",
            group=tensor.device_mesh.get_group(),
        )


def carry(local: torch.Tensor, spec: SequenceSpec) -> SequenceSharded:
    """``local`` (this rank's tokens) as a `SequenceSharded` of ``spec``; gradients flow back to ``local``."""
    return _FromLocal.apply(local, spec)


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, carried):
        ctx.spec = carried.spec
        return carried._local.view_as(carried._local)

    @staticmethod
    def backward(ctx, grad):
        return SequenceSharded(grad, ctx.spec)


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, spec):
        ctx.spec = spec
        return SequenceSharded(local.detach(), spec)

    @staticmethod
    def backward(ctx, grad):  # padding slots get no gradient: the graph that made ``local`` sums over its slots
        local = _local_of(grad, ctx.spec, ctx.spec.dim)
        return torch.where(ctx.spec.valid(local), local, torch.zeros((), dtype=local.dtype)), None


def _is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(tensor)


def _marked_dynamic(carried: SequenceSharded) -> bool:
    marks = getattr(carried, "_dynamo_dynamic_indices", set()) | getattr(carried, "_dynamo_weak_dynamic_indices", set())
    return carried.spec.dim in marks


def _stand_in(carried: SequenceSharded) -> torch.Tensor:
    return carried._local.new_empty(carried.shape)


def _needs_whole(func, why: str) -> NeedsWholeSequence:
    return NeedsWholeSequence(
        f"{func} on a SequenceSharded value (a sequence-sharded output of a ring graph): {why}. Call "
        ".full_tensor() first for the whole value (an all-gather that every rank must call), or .to_local() for "
        "this rank's tokens; or compile the code that does this with the ring backend."
    )


def _local_of(value, spec: SequenceSpec, dim: int):
    """This rank's tokens of ``value`` along ``dim``: a carrier's own, or (a plain tensor, whole along ``dim``) its
    rows at this rank's positions (zero at padding slots); a plain tensor of size 1 there broadcasts as it is."""
    if isinstance(value, SequenceSharded):
        if _key(value.spec) != _key(spec) or value.spec.dim != dim:
            raise InvalidInputError(
                f"Two sequence-sharded values of different layouts or sequence dims meet: {value.spec} and {spec}."
            )
        return value._local
    if not isinstance(value, torch.Tensor) or dim < 0 or value.size(dim) == 1:
        return value
    if value.size(dim) != spec.rows * spec.seq_len:
        raise InvalidInputError(
            f"A plain tensor of shape {tuple(value.shape)} meets a sequence-sharded value of {spec.seq_len} tokens "
            f"along dim {dim}; it must have the whole sequence (or 1) there."
        )
    rows = value.index_select(dim, spec.positions(value.device))
    return rows.masked_fill(~replace(spec, dim=dim).valid(rows), 0)


def _key(spec: SequenceSpec) -> tuple:
    return spec.kind, spec.world_size, spec.seq_len, spec.group_name, spec.rows


def _carry(local, spec: SequenceSpec):
    if isinstance(local, torch.Tensor):
        return SequenceSharded(local, spec)
    return type(local)(_carry(x, spec) for x in local)


def _all_reduce(total: torch.Tensor, spec: SequenceSpec, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if op == dist.ReduceOp.SUM:
        return all_reduce_sum(total, spec.group_name)
    total = total.clone()
    work = dist.all_reduce(total, op=op, group=group_by_name(spec.group_name), async_op=True)
    wait_collective(work, total, spec.group_name, f"all-reducing a {tuple(total.shape)} max/min over the sequence")
    return total


# the rules: (func, args, kwargs, carriers) -> result


def _pointwise(func, args, kwargs, carriers):
    spec = carriers[0].spec
    ndim = max(a.dim() for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor))
    if any(c.dim() != ndim for c in carriers):
        raise _needs_whole(func, "its sequence-sharded operands have different ranks, so their sequence dims differ")

    def local(value):
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        return _local_of(value, spec, spec.dim - (ndim - value.dim()))

    out = func(*pytree.tree_map(local, args), **pytree.tree_map(local, kwargs))
    if func._schema.is_mutable:  # in place: the carrier's own tokens changed
        return args[0]
    if not isinstance(out, (torch.Tensor, tuple, list)):  # a number about this rank's tokens alone
        raise _needs_whole(func, f"it answers {type(out).__name__} about the whole value")
    return _carry(out, spec)


def _same(func, args, kwargs, carriers):
    """Ops that keep every dimension: copies, conversions, ``*_like`` factories."""
    out = func(carriers[0]._local, *args[1:], **kwargs)
    return _carry(out, carriers[0].spec)


def _global_of(shape_args, carried: SequenceSharded) -> list[int]:
    """The global shape a view/reshape asks for (``-1`` resolved)."""
    return list(torch.empty(carried.shape, device="meta").view(*shape_args).shape) if shape_args else []


def _view(func, args, kwargs, carriers):
    """A view keeps the sequence a dimension of its own, or merges it with the dimensions before it."""
    carried, spec = args[0], args[0].spec
    new = _global_of(args[1], carried)
    before = math.prod(carried.shape[: spec.dim]) * spec.rows  # whole sequences before the token dimension
    after = math.prod(carried.shape[spec.dim + 1 :])  # elements of one token
    for k, size in enumerate(new):
        prefix = math.prod(new[:k])
        if size % spec.seq_len == 0 and prefix * (size // spec.seq_len) == before and math.prod(new[k + 1 :]) == after:
            rows = size // spec.seq_len
            local_shape = list(new)
            local_shape[k] = rows * spec.local_len
            return SequenceSharded(func(carried._local, local_shape), replace(spec, dim=k, rows=rows))
    raise _needs_whole(
        func,
        f"the view {tuple(carried.shape)} -> {tuple(new)} splits the sequence (dim {spec.dim}) or merges it with "
        "the dimensions after it",
    )


def _unsqueeze(func, args, kwargs, carriers):
    carried, dim = args[0], args[1] % (args[0].dim() + 1)
    spec = carried.spec
    return SequenceSharded(func(carried._local, dim), replace(spec, dim=spec.dim + (dim <= spec.dim)))


def _squeeze(func, args, kwargs, carriers):
    carried, spec = args[0], args[0].spec
    dims = range(carried.dim()) if len(args) == 1 else [args[1]] if isinstance(args[1], int) else args[1]
    gone = {d % carried.dim() for d in dims if carried.size(d) == 1}
    return SequenceSharded(
        carried._local.squeeze(tuple(gone)) if gone else carried._local.view_as(carried._local),
        replace(spec, dim=spec.dim - sum(d < spec.dim for d in gone)),
    )


def _expand(func, args, kwargs, carriers):
    carried, sizes, spec = args[0], list(args[1]), args[0].spec
    dim = spec.dim + len(sizes) - carried.dim()
    sizes[dim] = carried._local.size(spec.dim)
    return SequenceSharded(func(carried._local, sizes, **kwargs), replace(spec, dim=dim))


def _permute(func, args, kwargs, carriers):
    carried, spec, ndim = args[0], args[0].spec, args[0].dim()
    if func.overloadpacket is aten.t:
        order = [1, 0] if ndim == 2 else [0]
    elif func.overloadpacket is aten.transpose:
        order = list(range(ndim))
        a, b = args[1] % ndim, args[2] % ndim
        order[a], order[b] = order[b], order[a]
    else:
        order = [d % ndim for d in args[1]]
    return SequenceSharded(carried._local.permute(order), replace(spec, dim=order.index(spec.dim)))


def _index_other_dim(func, args, kwargs, carriers):
    """slice / select / split of a dimension other than the sequence; of the sequence: `_pick`."""
    carried, spec = args[0], args[0].spec
    splits = func.overloadpacket in (aten.split, aten.split_with_sizes)
    at = 2 if splits else 1
    dim = (args[at] if len(args) > at else kwargs.get("dim", 0)) % carried.dim()
    if dim == spec.dim and splits:
        raise _needs_whole(func, "it splits the sequence")
    if dim == spec.dim and _whole_slice(func, args, spec):  # x[:, 0:] (Hugging Face's logits_to_keep=0)
        return SequenceSharded(carried._local.view_as(carried._local), spec)
    if dim == spec.dim:
        return _pick(func, args, kwargs, carried)
    out = func(carried._local, *args[1:], **kwargs)
    new_dim = spec.dim - (func.overloadpacket is aten.select and dim < spec.dim)
    return _carry(out, replace(spec, dim=new_dim))


def _whole_slice(func, args, spec: SequenceSpec) -> bool:
    if func.overloadpacket is not aten.slice:
        return False
    start, end, step = (list(args[2:]) + [None, None, 1])[:3]
    return (start or 0) == 0 and (end is None or end >= spec.rows * spec.seq_len) and step == 1


def _pick(func, args, kwargs, carried: SequenceSharded) -> torch.Tensor:
    """``x[:, -1]`` / ``x[:, a:b]`` along the sequence: every rank's rows of those positions, zero where it holds
    none, summed over the ranks (the bytes of the picked rows alone)."""
    spec = carried.spec
    if spec.rows != 1:
        raise _needs_whole(func, "it picks tokens along a dimension that holds several sequences")
    index = torch.arange(spec.seq_len, device=carried.device)
    picked = func(index, 0, *args[2:], **kwargs)  # the global positions picked
    slots, held = position_slots(picked.reshape(-1), *spec.layout_args())
    rows = carried._local.index_select(spec.dim, slots)
    held = held.view([-1 if d == spec.dim else 1 for d in range(rows.dim())])
    total = _all_reduce(torch.where(held, rows, torch.zeros((), dtype=rows.dtype)), spec)
    return total.squeeze(spec.dim) if picked.dim() == 0 else total


def _cat(func, args, kwargs, carriers):
    tensors, dim = args[0], (args[1] if len(args) > 1 else kwargs.get("dim", 0))
    spec = carriers[0].spec
    dim = dim % carriers[0].dim()
    if dim == spec.dim:
        raise _needs_whole(func, "it concatenates along the sequence")
    return SequenceSharded(func([_local_of(t, spec, spec.dim) for t in tensors], dim), spec)


# matrix products as labelled dimensions: (operand labels..., output labels)
_PRODUCTS = {aten.mm: ("mk", "kn", "mn"), aten.bmm: ("bmk", "bkn", "bmn")}


def _product(func, args, kwargs, carriers):
    """mm / bmm: sharded along a kept dimension the product is sharded; contracted over the sequence, each
    rank's product of its tokens (padding zeroed) is all-reduced."""
    a, b = args[0], args[1]
    labels_a, labels_b, labels_out = _PRODUCTS[func.overloadpacket]
    sharded = {labels[c.spec.dim] for c, labels in ((a, labels_a), (b, labels_b)) if isinstance(c, SequenceSharded)}
    if len(sharded) != 1:
        raise _needs_whole(func, "its two operands are sharded along different dimensions")
    (label,) = sharded
    spec = carriers[0].spec
    operands = []
    for value, labels in ((a, labels_a), (b, labels_b)):
        dim = labels.find(label)
        local = _local_of(value, spec, dim)
        if label not in labels_out and dim >= 0:  # contracted: padding slots must add nothing
            local = torch.where(replace(spec, dim=dim).valid(local), local, torch.zeros((), dtype=local.dtype))
        operands.append(local)
    out = func(*operands)
    if label in labels_out:
        return SequenceSharded(out, replace(spec, dim=labels_out.index(label)))
    return _all_reduce(out, spec)


def _addmm(func, args, kwargs, carriers):
    bias, a, b = args[:3]
    product = aten.mm.default(a, b)
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    return (bias if beta == 1 else bias * beta) + (product if alpha == 1 else product * alpha)


_REDUCTIONS = {
    aten.sum: dist.ReduceOp.SUM,
    aten.mean: dist.ReduceOp.SUM,
    aten.amax: dist.ReduceOp.MAX,
    aten.amin: dist.ReduceOp.MIN,
    aten.max: dist.ReduceOp.MAX,  # of everything; along a dimension (with indices) only another one than the sequence
    aten.min: dist.ReduceOp.MIN,
}
_LOCAL_REDUCE = {aten.sum: torch.sum, aten.mean: torch.sum, aten.amax: torch.amax, aten.amin: torch.amin}


def _reduce(func, args, kwargs, carriers):
    """A reduction over some dimensions: carried when the sequence is not one of them, else all-reduced."""
    carried, spec, ndim = args[0], args[0].spec, args[0].dim()
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    dims = range(ndim) if dims is None or (not isinstance(dims, int) and len(dims) == 0) else dims
    dims = {d % ndim for d in ([dims] if isinstance(dims, int) else dims)}
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    packet = func.overloadpacket
    if spec.dim not in dims:
        out = func(carried._local, *args[1:], **kwargs)
        return _carry(out, replace(spec, dim=spec.dim - (0 if keepdim else sum(d < spec.dim for d in dims))))
    whole = len(dims) == ndim and packet in (aten.max, aten.min)
    if packet not in _LOCAL_REDUCE and not whole:
        raise _needs_whole(func, "it runs along the sequence (only sum, mean, max and min are all-reduced)")
    op = _REDUCTIONS[packet]
    fill = {dist.ReduceOp.SUM: 0.0, dist.ReduceOp.MAX: float("-inf"), dist.ReduceOp.MIN: float("inf")}[op]
    local = torch.where(spec.valid(carried._local), carried._local, torch.tensor(fill, dtype=carried.dtype))
    if whole:
        return _all_reduce(func(local), spec, op)
    extra = {"dtype": kwargs["dtype"]} if kwargs.get("dtype") is not None else {}
    total = _all_reduce(_LOCAL_REDUCE[packet](local, dim=tuple(sorted(dims)), keepdim=keepdim, **extra), spec, op)
    if packet is aten.mean:
        total = total / math.prod(carried.size(d) for d in dims)
    return total


def _along_other_dim(func, args, kwargs, carriers):
    """softmax, log-softmax, argmax and their backward: along a dimension other than the sequence."""
    carried = next(a for a in args if isinstance(a, SequenceSharded))
    spec = carried.spec
    dim = next((a for a in args[1:] if isinstance(a, int) and not isinstance(a, bool)), kwargs.get("dim"))
    if dim is None or dim % carried.dim() == spec.dim:
        raise _needs_whole(func, "it runs along the sequence")
    picks = func.overloadpacket in (aten.argmax, aten.argmin)  # they drop the dimension unless keepdim
    dropped = (
        picks and not (args[2] if len(args) > 2 else kwargs.get("keepdim", False)) and dim % carried.dim() < spec.dim
    )
    out = func(*[_local_of(a, spec, spec.dim) if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
    return SequenceSharded(out, replace(spec, dim=spec.dim - dropped))


def _nll_loss(func, args, kwargs, carriers):
    """nll_loss over per-token rows (``[tokens, classes]`` / ``[tokens]``): per-token or summed over the ranks."""
    scores, target, weight, reduction, ignore_index = args[:5]
    spec = scores.spec
    if spec.dim != 0:
        raise _needs_whole(func, "its sequence is not the rows of the scores")
    target = _local_of(target, spec, 0)
    target = torch.where(spec.valid(target, 0), target, ignore_index)  # padding slots are not counted
    if reduction == 0:
        losses, total_weight = func(scores._local, target, weight, 0, ignore_index)
        return SequenceSharded(losses, spec), total_weight
    loss, total_weight = func(scores._local, target, weight, 2, ignore_index)  # sums, all-reduced
    loss, total_weight = _all_reduce(loss, spec), _all_reduce(total_weight, spec)
    return (loss / total_weight if reduction == 1 else loss), total_weight


def _nll_loss_backward(func, args, kwargs, carriers):
    grad, scores, target, weight, reduction, ignore_index, total_weight = args[:7]
    spec = scores.spec
    target = _local_of(target, spec, 0)
    target = torch.where(spec.valid(target, 0), target, ignore_index)
    grad = _local_of(grad, spec, 0) if reduction == 0 else grad
    return SequenceSharded(func(grad, scores._local, target, weight, reduction, ignore_index, total_weight), spec)


def _embedding(func, args, kwargs, carriers):
    """A table (every rank's own whole copy) read at this rank's token ids: this rank's rows."""
    weight, ids = args[:2]
    if isinstance(weight, SequenceSharded):
        raise _needs_whole(func, "its table is sharded along the sequence")
    return SequenceSharded(func(weight, ids._local, *args[2:], **kwargs), ids.spec)


def _embedding_backward(func, args, kwargs, carriers):
    """The table's gradient: each rank's rows (padding slots left out) summed over the ranks."""
    grad, ids = args[:2]
    spec = ids.spec
    local = _local_of(grad, spec, spec.dim)
    local = torch.where(spec.valid(local), local, torch.zeros((), dtype=local.dtype))
    return _all_reduce(func(local, ids._local, *args[2:], **kwargs), spec)


def _same_size(func, args, kwargs, carriers):
    return args[0].shape == args[1].shape


_RULES: dict[object, Callable] = {
    **dict.fromkeys(
        (
            aten.detach,
            aten.alias,
            aten.clone,
            aten._to_copy,
            aten.zeros_like,
            aten.ones_like,
            aten.empty_like,
            aten.full_like,
            aten.lift_fresh,
        ),
        _same,
    ),
    **dict.fromkeys((aten.view, aten._unsafe_view, aten.reshape), _view),
    aten.unsqueeze: _unsqueeze,
    aten.squeeze: _squeeze,
    aten.expand: _expand,
    **dict.fromkeys((aten.t, aten.transpose, aten.permute), _permute),
    **dict.fromkeys((aten.slice, aten.select, aten.split, aten.split_with_sizes), _index_other_dim),
    aten.cat: _cat,
    **dict.fromkeys(_PRODUCTS, _product),
    aten.addmm: _addmm,
    **dict.fromkeys(_REDUCTIONS, _reduce),
    **dict.fromkeys(
        (
            aten._softmax,
            aten._log_softmax,
            aten._softmax_backward_data,
            aten._log_softmax_backward_data,
            aten.argmax,
            aten.argmin,
        ),
        _along_other_dim,
    ),
    aten.nll_loss_forward: _nll_loss,
    aten.nll_loss_backward: _nll_loss_backward,
    aten.embedding: _embedding,
    aten.embedding_dense_backward: _embedding_backward,
    aten.is_same_size: _same_size,
}
