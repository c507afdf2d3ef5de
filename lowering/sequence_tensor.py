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
  (``x.view(B * N, H)``), transposes, permutes, slices and selects of other dimensions, `cat` / `stack` along
  another, ``unbind`` of another (iterating over the batch);
- matrix products (`mm`, `addmm`, `bmm`: `linear`, `matmul`): sharded along a kept dimension, the product is
  sharded; contracted over the sequence (a weight's gradient), each rank's product is all-reduced;
- any op along other dimensions than the sequence (`_along_dims`): reductions (sum, mean, max, var, std, norm,
  logsumexp, any, all, ...), softmax, sort, topk, argmax, cumsum, flip, roll, gather, median, mode;
- a reduction whose dimensions take the sequence in (every dimension: ``logits.norm()``, ``torch.allclose``,
  ``.isnan().any()``, ``F.mse_loss``): each rank's part combined across the ring (`lowering.sequence_reductions`),
  every rank gets the whole result;
- `nll_loss` (`cross_entropy`) over per-token rows, and `nll_loss2d` over ``[B, classes, N]`` (``cross_entropy(
  logits.transpose(1, 2), labels)``): the loss sum and the count of counted tokens all-reduced;
- `embedding` of sharded token ids: this rank's rows (the table's gradient: each rank's rows all-reduced);
- a select or slice of sequence positions (``logits[:, -1]``): the rows of the ranks that hold them, all-reduced.
Any other op, and ``numpy()``, ``tolist()`` and pickling (``torch.save``), needs the whole sequence: it is
all-gathered first, a collective checked by `lowering.implicit_gather` (every rank runs the line: it works and
warns once; one rank alone: that rank raises `NeedsWholeSequence` within seconds, the others go on), and the op
runs on the whole values, its results plain tensors. The ops that communicate are collectives: every rank of the
ring must run them, as it runs the model. docs/backend.md has the table.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from lowering import compat
from lowering.compat import pytree
from lowering.documents import sequence_layout
from lowering.errors import InvalidInputError, NotSupportedError
from lowering.groups import resolve_group
from lowering.implicit_gather import NeedsWholeSequence, gather_whole, whole_of
from lowering.layout import local_length
from lowering.sequence_ops import local_positions, local_token_mask, position_slots, shard_sequence
from lowering.sequence_reductions import ACROSS, all_reduce

aten = torch.ops.aten


@dataclass(frozen=True)
class SequenceSpec:
    """How a value is sharded: along ``dim``, ``seq_len`` tokens laid out as ``kind`` over ``world_size`` ranks of
    the group named ``group_name``. ``rows``: how many sequences ``dim`` holds one after the other (1; more once a
    view merged the batch into it: ``[B, N, H] -> [B * N, H]`` has ``rows = B``). ``documents``: with the documents
    layout, each token's document id on the host (``[B, N]``, the call's `ringpass::documents_on_host`), which the
    layout is planned from; values of one call share it."""

    kind: str
    world_size: int
    seq_len: int
    dim: int
    group_name: str
    rows: int = 1
    documents: torch.Tensor | None = field(default=None, compare=False)

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

    def layout_kwargs(self) -> dict:
        """What the sequence ops take besides `layout_args`: the document ids, with the documents layout."""
        return {} if self.documents is None else {"documents": self.documents}

    def layout(self):
        """The layout itself (`lowering.documents.sequence_layout`: with the documents layout, this packing's)."""
        return sequence_layout(self.kind, self.world_size, self.seq_len, self.documents)

    def positions(self, device) -> torch.Tensor:
        """The global index along ``dim`` of each local slot (padding: the last real token, so it indexes)."""
        own = local_positions(*self.layout_args(), device, **self.layout_kwargs())
        return (own + torch.arange(self.rows, device=device)[:, None] * self.seq_len).reshape(-1)

    def valid(self, like: torch.Tensor, dim: int | None = None) -> torch.Tensor:
        """True at this rank's real slots, shaped to broadcast against ``like`` along ``dim`` (default: its own)."""
        valid = local_token_mask(*self.layout_args(), like.device, **self.layout_kwargs()).repeat(self.rows)
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
        return compat.make_wrapper_subclass(cls, shape, dtype=local.dtype, device=local.device)

    def __init__(self, local: torch.Tensor, spec: SequenceSpec):
        self._local, self.spec = local, spec

    __torch_function__ = compat.disabled_torch_function_impl

    def __repr__(self, *, tensor_contents=None) -> str:  # no collective: printing on one rank must not hang
        s = self.spec
        return (
            f"SequenceSharded(shape={tuple(self.shape)}, dim={s.dim}, layout={s.kind} over {s.world_size} ranks, "
            f"this rank's {s.local_len} of {s.seq_len} tokens{'' if s.rows == 1 else f' x {s.rows} rows'}: "
            f"{self._local!r})"
        )

    def __tensor_flatten__(self):
        s = self.spec
        return ["_local"], (s.kind, s.world_size, s.dim, s.group_name, s.rows, _Packing(s.documents))

    @staticmethod
    def __tensor_unflatten__(inner, context, outer_size, outer_stride):
        kind, world_size, dim, group_name, rows, documents = context
        spec = SequenceSpec(kind, world_size, outer_size[dim] // rows, dim, group_name, rows, documents.ids)
        return SequenceSharded(inner["_local"], spec)

    @classmethod
    @compat.disable_dynamo  # eager code inside a compiled region runs these rules as they are, never traced
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        carriers = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, SequenceSharded)]
        if any(compat.is_fake(c._local) for c in carriers):  # traced (Dynamo): a plain tensor of the global shape
            args, kwargs = pytree.tree_map_only(SequenceSharded, _stand_in, (args, kwargs))
            return func(*args, **kwargs)
        rule = _RULES.get(func) or (_pointwise if torch.Tag.pointwise in func.tags else _RULES.get(func.overloadpacket))
        with torch.no_grad():  # autograd recorded the op on the carriers; their tokens need no graph of their own
            try:
                if rule is None:
                    raise _needs_whole(func, "it is not one of the ops that act on each rank's tokens")
                if any(not isinstance(w, SequenceSharded) for w in _written(func, args, kwargs)):
                    raise _needs_whole(func, "it writes into a plain tensor")
                out = rule(func, args, kwargs, carriers)
            except NeedsWholeSequence:
                out = _on_whole_values(func, args, kwargs, carriers)
        if any(_marked_dynamic(c) for c in carriers):  # a length compiled as any length stays so downstream
            for result in pytree.tree_leaves(out):
                if isinstance(result, SequenceSharded):
                    compat.maybe_mark_dynamic(result, result.spec.dim)
        return out

    # what users call
    @compat.disable_dynamo
    def to_local(self) -> torch.Tensor:
        """This rank's tokens along ``spec.dim``, in the layout's order (differentiable)."""
        return _ToLocal.apply(self)

    @compat.disable_dynamo
    def full_tensor(self) -> torch.Tensor:
        """The whole value in the original token order: an all-gather (differentiable); every rank must call it."""
        return whole_of(self.to_local(), self.spec)

    # what needs the whole value outside torch's ops: the implicit gather, checked (`lowering.implicit_gather`)
    def numpy(self, *, force: bool = False):
        if self.requires_grad and not force:  # as torch says it, before any rank gathers
            raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead.")
        return self._whole("numpy()").numpy(force=force)

    def tolist(self):
        return self._whole("tolist()").tolist()

    def __reduce_ex__(self, protocol):
        """Pickling (``torch.save``, ``pickle``) writes the whole tensor; loading it gives a plain tensor."""
        return self._whole("pickling (torch.save)").requires_grad_(self.requires_grad).__reduce_ex__(protocol)

    def _whole(self, what: str) -> torch.Tensor:
        with torch.no_grad():
            return gather_whole([self], what)[0]

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


def _marked_dynamic(carried: SequenceSharded) -> bool:
    return carried.spec.dim in compat.dynamic_dims(carried)


def _stand_in(carried: SequenceSharded) -> torch.Tensor:
    return carried._local.new_empty(carried.shape)


def _needs_whole(func, why: str) -> NeedsWholeSequence:
    """What a rule raises for an op it cannot run on each rank's tokens: the op then runs on the whole values."""
    return NeedsWholeSequence(f"{func} on a SequenceSharded value: {why}.")


def _written(func, args, kwargs) -> list:
    """The tensors an op writes into (in place, ``out=``)."""
    schema = compat.schema_of(func)
    if not schema.is_mutable:
        return []
    given = _bound(func, args, kwargs)
    return [
        given[a.name]
        for a in schema.arguments
        if a.alias_info is not None and a.alias_info.is_write and isinstance(given.get(a.name), torch.Tensor)
    ]


def _on_whole_values(func, args, kwargs, carriers):
    """The op on the whole values (each carrier gathered, checked: `gather_whole`); plain results. A carrier the op
    writes into gets its own tokens of what was written, and is what the op returns in its place."""
    unique = list({id(c): c for c in carriers}.values())
    wholes = dict(zip(map(id, unique), gather_whole(unique, str(func))))
    whole_args, whole_kwargs = pytree.tree_map_only(SequenceSharded, lambda c: wholes[id(c)], (args, kwargs))
    out = func(*whole_args, **whole_kwargs)
    written = {id(wholes[id(w)]): w for w in _written(func, args, kwargs) if isinstance(w, SequenceSharded)}
    for carrier in written.values():
        carrier._local.copy_(_local_of(wholes[id(carrier)], carrier.spec, carrier.spec.dim))
    return pytree.tree_map(lambda r: written.get(id(r), r), out)


def _local_of(value, spec: SequenceSpec, dim: int):
    """This rank's tokens of ``value`` along ``dim``: a carrier's own, or (a plain tensor, whole along ``dim``) its
    rows at this rank's positions (zero at padding slots); a plain tensor of size 1 there broadcasts as it is
    (unless the whole sequence is one token: then it is that token's, taken to this rank's slots)."""
    if isinstance(value, SequenceSharded):
        if _key(value.spec) != _key(spec) or value.spec.dim != dim:
            raise InvalidInputError(
                f"Two sequence-sharded values of different layouts or sequence dims meet: {value.spec} and {spec}."
            )
        return value._local
    if not isinstance(value, torch.Tensor) or dim < 0 or (value.size(dim) == 1 and spec.rows * spec.seq_len > 1):
        return value
    if value.size(dim) != spec.rows * spec.seq_len:
        raise InvalidInputError(
            f"A plain tensor of shape {tuple(value.shape)} meets a sequence-sharded value of {spec.seq_len} tokens "
            f"along dim {dim}; it must have the whole sequence (or 1) there."
        )
    rows = value.index_select(dim, spec.positions(value.device))
    return rows.masked_fill(~replace(spec, dim=dim).valid(rows), 0)


class _Packing:
    """The document ids in a `SequenceSharded`'s flatten context. Dynamo guards a compiled graph's input on that
    context being equal; a graph taking values in the documents layout runs any packing (the layout is planned per
    call from the ids it is given), so any two are equal here, and a value with ids never equals one without."""

    def __init__(self, ids: torch.Tensor | None):
        self.ids = ids

    def __eq__(self, other) -> bool:
        return isinstance(other, _Packing) and (self.ids is None) == (other.ids is None)

    def __hash__(self) -> int:
        return hash(self.ids is None)


def _key(spec: SequenceSpec) -> tuple:
    return spec.kind, spec.world_size, spec.seq_len, spec.group_name, spec.rows, id(spec.documents)


def _carry(local, spec: SequenceSpec):
    if isinstance(local, torch.Tensor):
        return SequenceSharded(local, spec)
    return type(local)(_carry(x, spec) for x in local)


# the rules: (func, args, kwargs, carriers) -> result


def _pointwise(func, args, kwargs, carriers):
    spec = carriers[0].spec
    ndim = max(a.dim() for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor))
    if any(c.dim() != ndim for c in carriers):
        raise _needs_whole(func, "its sequence-sharded operands have different ranks, so their sequence dims differ")

    local = functools.partial(_aligned_local, spec=spec, ndim=ndim)

    out = func(*pytree.tree_map(local, args), **pytree.tree_map(local, kwargs))
    if compat.schema_of(func).is_mutable:  # in place: the carrier's own tokens changed
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
    slots, held = position_slots(picked.reshape(-1), *spec.layout_args(), **spec.layout_kwargs())
    rows = carried._local.index_select(spec.dim, slots)
    held = held.view([-1 if d == spec.dim else 1 for d in range(rows.dim())])
    total = all_reduce(torch.where(held, rows, torch.zeros((), dtype=rows.dtype)), spec)
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
    return all_reduce(out, spec)


def _addmm(func, args, kwargs, carriers):
    bias, a, b = args[:3]
    product = aten.mm.default(a, b)
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    return (bias if beta == 1 else bias * beta) + (product if alpha == 1 else product * alpha)


def _along_dims(func, args, kwargs, carriers):
    """An op along some dimensions (its ``dim`` / ``dims``; every one when it names none): when they leave the
    sequence out it runs on each rank's tokens and its results are sharded as the operand was; when they take the
    sequence in, a reduction that `ACROSS` combines over the ranks gives every rank the whole result, any other op
    needs the whole sequence."""
    spec, ndim = carriers[0].spec, carriers[0].dim()
    bound = _bound(func, args, kwargs)
    dims = bound["dim"] if "dim" in bound else bound.get("dims")
    dims = [dims] if isinstance(dims, int) else dims
    dims = set(range(ndim)) if dims is None or len(dims) == 0 else {d % ndim for d in dims}
    if bound.get("reduction") == 0:  # a loss per element: nothing is reduced
        dims = set()

    local = functools.partial(_aligned_local, spec=spec, ndim=ndim)

    if spec.dim in dims:
        combine = ACROSS.get(func, ACROSS.get(func.overloadpacket))
        if combine is None:
            raise _needs_whole(func, "it runs along the sequence")
        locals_ = {name: pytree.tree_map(local, value) for name, value in bound.items()}
        return combine(func, locals_, spec, dims, bool(bound.get("keepdim", False)))
    out = func(*pytree.tree_map(local, args), **pytree.tree_map(local, kwargs))
    if compat.schema_of(func).is_mutable:  # in place: the carrier's own tokens changed
        return args[0]

    def carried(result):
        if not isinstance(result, torch.Tensor):
            return result
        dropped = result.dim() < ndim  # a reduction without keepdim, or unbind: the dims it ran along are gone
        return SequenceSharded(result, replace(spec, dim=spec.dim - dropped * sum(d < spec.dim for d in dims)))

    return pytree.tree_map(carried, out)


def _bound(func, args, kwargs) -> dict:
    """The op's arguments by name, defaults filled in."""
    schema = compat.schema_of(func).arguments
    defaults = {a.name: a.default_value for a in schema if a.has_default_value()}
    return {**defaults, **dict(zip((a.name for a in schema), args)), **kwargs}


def _loss_backward(func, args, kwargs, carriers):
    """The gradient of a pointwise loss (`POINTWISE_LOSSES`): each rank's tokens; a mean's gradient is the sum's
    over the whole value's count of elements (the kernel would divide by this rank's count)."""
    spec, ndim = carriers[0].spec, carriers[0].dim()
    bound = _bound(func, args, kwargs)
    locals_ = {k: _aligned_local(v, spec, ndim) for k, v in bound.items()}
    if bound["reduction"] == 1:
        locals_["grad_output"] = locals_["grad_output"] / math.prod(carriers[0].shape)
        locals_["reduction"] = 2
    return SequenceSharded(func(**locals_), spec)


def _aligned_local(value, spec: SequenceSpec, ndim: int):
    """This rank's tokens of an operand of an op on ``ndim``-dim sharded values, its dims aligned from the right as
    broadcasting aligns them; numbers and 0-dim tensors as they are."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    return _local_of(value, spec, spec.dim - (ndim - value.dim()))


def _stack(func, args, kwargs, carriers):
    tensors, dim = args[0], (args[1] if len(args) > 1 else kwargs.get("dim", 0))
    spec = carriers[0].spec
    dim = dim % (carriers[0].dim() + 1)
    stacked = func([_local_of(t, spec, spec.dim) for t in tensors], dim)
    return SequenceSharded(stacked, replace(spec, dim=spec.dim + (dim <= spec.dim)))


def _new_plain(func, args, kwargs, carriers):
    """``new_zeros`` / ``new_ones`` / ``new_empty`` / ``new_full``: a plain tensor of the size asked for."""
    return func(args[0]._local, *args[1:], **kwargs)


def _nll_loss(func, args, kwargs, carriers):
    """nll_loss over per-token rows (``[tokens, classes]``: the sequence is the rows) or nll_loss2d over
    ``[B, classes, ...]`` (the sequence one of the trailing dims, the layout ``cross_entropy(logits.transpose(1, 2),
    labels)`` makes): per token, or the sum and the count of counted tokens summed over the ranks."""
    scores, target, weight, reduction, ignore_index = args[:5]
    spec, target = scores.spec, _counted_target(func, scores, target, ignore_index)
    if reduction == 0:
        losses, total_weight = func(scores._local, target, weight, 0, ignore_index)
        return SequenceSharded(losses, replace(spec, dim=_target_dim(func, spec))), total_weight
    loss, total_weight = func(scores._local, target, weight, 2, ignore_index)  # sums, all-reduced
    loss, total_weight = all_reduce(loss, spec), all_reduce(total_weight, spec)
    return (loss / total_weight if reduction == 1 else loss), total_weight


def _nll_loss_backward(func, args, kwargs, carriers):
    grad, scores, target, weight, reduction, ignore_index, total_weight = args[:7]
    spec, target = scores.spec, _counted_target(func, scores, target, ignore_index)
    grad = _local_of(grad, spec, _target_dim(func, spec)) if reduction == 0 else grad
    return SequenceSharded(func(grad, scores._local, target, weight, reduction, ignore_index, total_weight), spec)


def _target_dim(func, spec: SequenceSpec) -> int:
    """The sequence dimension of an nll loss's target (the scores' without the classes)."""
    two_d = func.overloadpacket in (aten.nll_loss2d_forward, aten.nll_loss2d_backward)
    if spec.dim != 0 and not (two_d and spec.dim >= 2):
        raise _needs_whole(func, "its sequence is not a dimension of the target")
    return spec.dim - two_d


def _counted_target(func, scores: SequenceSharded, target, ignore_index: int) -> torch.Tensor:
    """This rank's targets, its padding slots ``ignore_index`` (not counted)."""
    spec, dim = scores.spec, _target_dim(func, scores.spec)
    target = _local_of(target, spec, dim)
    return torch.where(spec.valid(target, dim), target, ignore_index)


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
    return all_reduce(func(local, ids._local, *args[2:], **kwargs), spec)


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
    aten.stack: _stack,
    **dict.fromkeys((aten.new_zeros, aten.new_ones, aten.new_empty, aten.new_full), _new_plain),
    **dict.fromkeys(ACROSS, _along_dims),
    **dict.fromkeys(
        (
            aten._softmax,
            aten._log_softmax,
            aten._softmax_backward_data,
            aten._log_softmax_backward_data,
            aten.argmax,
            aten.argmin,
            aten.max,
            aten.min,
            aten.sort,
            aten.topk,
            aten.kthvalue,
            aten.median,
            aten.nanmedian,
            aten.mode,
            aten.cumsum,
            aten.cumprod,
            aten.cummax,
            aten.cummin,
            aten.logcumsumexp,
            aten.flip,
            aten.roll,
            aten.gather,
            aten.unbind,
        ),
        _along_dims,
    ),
    **dict.fromkeys(
        (
            aten.mse_loss_backward,
            aten.smooth_l1_loss_backward,
            aten.huber_loss_backward,
            aten.soft_margin_loss_backward,
            aten.binary_cross_entropy_backward,
        ),
        _loss_backward,
    ),
    **dict.fromkeys((aten.nll_loss_forward, aten.nll_loss2d_forward), _nll_loss),
    **dict.fromkeys((aten.nll_loss_backward, aten.nll_loss2d_backward), _nll_loss_backward),
    aten.embedding: _embedding,
    aten.embedding_dense_backward: _embedding_backward,
    aten.is_same_size: _same_size,
}
