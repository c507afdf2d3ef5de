"""The custom ops a rewritten graph uses at its boundaries, all keyed by (layout, process group name).

Each takes the layout as plain values (kind, world size, sequence length) and, with the documents layout, each
token's document id on the host (``documents``, [B, N]: `documents_on_host` copies them once per call; the layout is
planned from their lengths, `lowering.documents.sequence_layout`).

- ``ringpass::documents_on_host``: the document ids as int64 ``[B, N]`` on the host.

- ``ringpass::local_positions``: this rank's global positions (padding clamped to the last real one,
  so position-indexed tables never read past their end). A rewritten ``arange(seq_len)`` becomes this.
- ``ringpass::local_token_mask``: True at this rank's real slots, False at padding.
- ``ringpass::shard_sequence``: this rank's slots of a full tensor along ``dim``, zero at padding (backward: the full
  gradient, gathered from every rank's slots, so a replicated value keeps a replicated gradient).
- ``ringpass::gather_sequence``: the full tensor from every rank's slots, padding dropped (backward:
  this rank's own rows of the gradient; no sum over ranks, since every rank consumes the same output).
- ``ringpass::take_positions``: the rows at a few global positions where this rank holds them, zero
  elsewhere; all-reduced, every rank has those tokens (a pooler's first token) for their bytes alone.
- ``ringpass::position_slots``: for a tensor of global positions (data: the last non-padding token of
  each row), this rank's local slot of each and whether it holds it: a pick at data-dependent positions
  indexes its own slots, zeroes what it does not hold, and is all-reduced like ``take_positions``.
- ``ringpass::all_reduce_sum``: a rank-local partial sum made global (backward: identity, since every
  rank consumes the same total).
- `reduce_grad` / `scale_grad`: identity forward; backward all-reduces, or scales, the gradient. Two
  spellings: Python functions (an ``autograd.Function``, which AOTAutograd traces through: the backend's
  graphs) and the ops ``ringpass::reduce_grad`` / ``ringpass::scale_grad`` (an alias with an autograd
  kernel, which ``torch.export`` keeps as one node: converted graphs, `EXPORTABLE`).

The rank is read at run time, so every rank compiles the same graph.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lowering import events
from lowering.documents import sequence_layout
from lowering.failures import wait_collective
from lowering.groups import group_by_name, rank_in
from lowering.layout import local_length

Documents = torch.Tensor | None  # each token's document id on the host, with the documents layout


@torch.library.custom_op("ringpass::documents_on_host", mutates_args=())
def documents_on_host(ids: torch.Tensor) -> torch.Tensor:
    return ids.reshape(-1, ids.size(-1)).to("cpu", torch.int64, copy=True)


@documents_on_host.register_fake
def _(ids):
    return torch.empty((ids.numel() // ids.size(-1), ids.size(-1)), dtype=torch.int64, device="cpu")


@torch.library.custom_op("ringpass::local_positions", mutates_args=())
def local_positions(
    kind: str, world_size: int, seq_len: int, group_name: str, device: torch.device, documents: Documents = None
) -> torch.Tensor:
    positions = sequence_layout(kind, world_size, seq_len, documents).positions(rank_in(group_name))
    return positions.clamp_(max=seq_len - 1).to(device)


@local_positions.register_fake
def _(kind, world_size, seq_len, group_name, device, documents=None):
    return torch.empty(local_length(kind, world_size, seq_len), dtype=torch.int64, device=device)


@torch.library.custom_op("ringpass::local_token_mask", mutates_args=())
def local_token_mask(
    kind: str, world_size: int, seq_len: int, group_name: str, device: torch.device, documents: Documents = None
) -> torch.Tensor:
    return (sequence_layout(kind, world_size, seq_len, documents).positions(rank_in(group_name)) < seq_len).to(device)


@local_token_mask.register_fake
def _(kind, world_size, seq_len, group_name, device, documents=None):
    return torch.empty(local_length(kind, world_size, seq_len), dtype=torch.bool, device=device)


@torch.library.custom_op("ringpass::shard_sequence", mutates_args=())
def shard_sequence(
    x: torch.Tensor, dim: int, kind: str, world_size: int, seq_len: int, group_name: str, documents: Documents = None
) -> torch.Tensor:
    layout, rank = sequence_layout(kind, world_size, seq_len, documents), rank_in(group_name)
    local = x.index_select(dim, local_positions(kind, world_size, seq_len, group_name, x.device, documents))
    valid = layout.valid_len(rank)  # real slots lead; padding slots are zero
    local.narrow(dim, valid, layout.local_len - valid).zero_()
    return local


@shard_sequence.register_fake
def _(x, dim, kind, world_size, seq_len, group_name, documents=None):
    shape = list(x.shape)
    shape[dim] = local_length(kind, world_size, seq_len)
    return x.new_empty(shape)


@torch.library.custom_op("ringpass::gather_sequence", mutates_args=())
def gather_sequence(
    x: torch.Tensor, dim: int, kind: str, world_size: int, seq_len: int, group_name: str, documents: Documents = None
) -> torch.Tensor:
    layout = sequence_layout(kind, world_size, seq_len, documents)
    x = x.contiguous()
    if not group_name:
        return layout.unshard([x], dim).contiguous()
    if events.recording():
        events.emit("all_gather", bytes=x.numel() * x.element_size() * world_size, shape=tuple(x.shape), dim=dim)
    shards = [torch.empty_like(x) for _ in range(world_size)]
    work = dist.all_gather(shards, x, group=group_by_name(group_name), async_op=True)
    wait_collective(work, x, group_name, f"all-gathering a {tuple(x.shape)} output along dim {dim}")
    return layout.unshard(shards, dim).contiguous()


@gather_sequence.register_fake
def _(x, dim, kind, world_size, seq_len, group_name, documents=None):
    shape = list(x.shape)
    shape[dim] = seq_len
    return x.new_empty(shape)


@torch.library.custom_op("ringpass::all_reduce_sum", mutates_args=())
def all_reduce_sum(x: torch.Tensor, group_name: str) -> torch.Tensor:
    total = x.clone()
    if group_name:
        if events.recording():
            events.emit("all_reduce", bytes=total.numel() * total.element_size(), shape=tuple(total.shape))
        work = dist.all_reduce(total, group=group_by_name(group_name), async_op=True)
        wait_collective(work, total, group_name, f"all-reducing a {tuple(total.shape)} partial sum")
    return total


@all_reduce_sum.register_fake
def _(x, group_name):
    return torch.empty_like(x)


def _owned_slots(
    positions: list[int], kind: str, world_size: int, seq_len: int, group_name: str, documents: Documents
) -> list[tuple[int, int]]:
    """(index into ``positions``, this rank's local slot) for each position this rank holds."""
    layout = sequence_layout(kind, world_size, seq_len, documents)
    rank = rank_in(group_name)
    slot_of = {int(p): slot for slot, p in enumerate(layout.positions(rank)[: layout.valid_len(rank)])}
    return [(i, slot_of[p % seq_len]) for i, p in enumerate(positions) if p % seq_len in slot_of]


@torch.library.custom_op("ringpass::take_positions", mutates_args=())
def take_positions(
    x: torch.Tensor,
    dim: int,
    positions: list[int],
    kind: str,
    world_size: int,
    seq_len: int,
    group_name: str,
    documents: Documents = None,
) -> torch.Tensor:
    """The rows of ``x`` (this rank's slots along ``dim``) at the given global positions (negative ones
    count from the end), zero where this rank does not hold them: summed over the ranks, every rank has
    those tokens' rows."""
    shape = list(x.shape)
    shape[dim] = len(positions)
    out = x.new_zeros(shape)
    for i, slot in _owned_slots(positions, kind, world_size, seq_len, group_name, documents):
        out.select(dim, i).copy_(x.select(dim, slot))
    return out


@take_positions.register_fake
def _(x, dim, positions, kind, world_size, seq_len, group_name, documents=None):
    shape = list(x.shape)
    shape[dim] = len(positions)
    return x.new_empty(shape)


@torch.library.custom_op("ringpass::put_positions", mutates_args=())
def put_positions(
    rows: torch.Tensor,
    length: int,
    dim: int,
    positions: list[int],
    kind: str,
    world_size: int,
    seq_len: int,
    group_name: str,
    documents: Documents = None,
) -> torch.Tensor:
    """The inverse of `take_positions`: ``length`` local slots along ``dim``, zero except the slots of the
    positions this rank holds, which get their rows (the backward of a pick)."""
    shape = list(rows.shape)
    shape[dim] = length
    out = rows.new_zeros(shape)
    for i, slot in _owned_slots(positions, kind, world_size, seq_len, group_name, documents):
        out.select(dim, slot).add_(rows.select(dim, i))
    return out


@put_positions.register_fake
def _(rows, length, dim, positions, kind, world_size, seq_len, group_name, documents=None):
    shape = list(rows.shape)
    shape[dim] = length
    return rows.new_empty(shape)


@torch.library.custom_op("ringpass::position_slots", mutates_args=())
def position_slots(
    positions: torch.Tensor, kind: str, world_size: int, seq_len: int, group_name: str, documents: Documents = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's slot of each global position, 0 where it holds none; whether it holds it), each shaped
    like ``positions`` (negative positions count from the end)."""
    layout = sequence_layout(kind, world_size, seq_len, documents)
    held = layout.positions(rank_in(group_name))[: layout.valid_len(rank_in(group_name))].to(positions.device)
    slot_of = torch.full((seq_len,), -1, dtype=torch.int64, device=positions.device)
    slot_of[held] = torch.arange(len(held), device=positions.device)
    slots = slot_of[positions.long() % seq_len]
    return slots.clamp_min(0), slots >= 0


@position_slots.register_fake
def _(positions, kind, world_size, seq_len, group_name, documents=None):
    return torch.empty_like(positions, dtype=torch.int64), torch.empty_like(positions, dtype=torch.bool)


def _take_setup(ctx, inputs, output):
    ctx.length, ctx.args = inputs[0].shape[inputs[1]], inputs[1:]


def _take_backward(ctx, grad):
    return (put_positions(grad, ctx.length, *ctx.args), *[None] * len(ctx.args))


take_positions.register_autograd(_take_backward, setup_context=_take_setup)


def _sequence_setup(ctx, inputs, output):
    ctx.args = inputs[1:]


def _shard_backward(ctx, grad):
    return (gather_sequence(grad, *ctx.args), *[None] * len(ctx.args))


def _gather_backward(ctx, grad):
    return (shard_sequence(grad, *ctx.args), *[None] * len(ctx.args))


shard_sequence.register_autograd(_shard_backward, setup_context=_sequence_setup)
gather_sequence.register_autograd(_gather_backward, setup_context=_sequence_setup)
all_reduce_sum.register_autograd(lambda ctx, grad: (grad, None), setup_context=lambda ctx, inputs, output: None)


class _GradientOnly(torch.autograd.Function):
    """Identity forward; the backward applies ``transform`` to the gradient."""

    @staticmethod
    def forward(ctx, x, transform):
        ctx.transform = transform
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.transform(grad), None


def reduce_grad(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """``x``, whose gradient is summed over the group in the backward (a partial gradient made whole)."""
    return _GradientOnly.apply(x, lambda grad: _on_local(grad, lambda local: all_reduce_sum(local, group_name)))


def _on_local(x: torch.Tensor, fn) -> torch.Tensor:
    """``fn`` applied to ``x``, or to a DTensor's local shard (tensor parallel's parameters: the ring's sum runs
    over other ranks than its mesh, so each shard is summed as it is)."""
    to_local = getattr(x, "to_local", None)
    if to_local is None:
        return fn(x)
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        fn(to_local()), x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride()
    )


def scale_grad(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x``, whose gradient is multiplied by ``factor`` in the backward."""
    return _GradientOnly.apply(x, lambda grad: grad * factor)


# The same two as dispatcher ops. torch.export drops an autograd.Function's backward (it traces its forward),
# so a converted graph calls these: an alias of ``x`` below autograd, the autograd kernel above it. They are not
# functional (the output aliases the input), so AOTAutograd cannot take them: the backend keeps the functions.
_library = torch.library.Library("ringpass", "FRAGMENT")
_library.define("reduce_grad(Tensor(a) x, str group_name) -> Tensor(a)")
_library.define("scale_grad(Tensor(a) x, float factor) -> Tensor(a)")
for _name in ("reduce_grad", "scale_grad"):
    _library.impl(_name, lambda x, _: torch.ops.aten.alias.default(x), "CompositeExplicitAutograd")
_library.impl("reduce_grad", reduce_grad, "Autograd")
_library.impl("scale_grad", scale_grad, "Autograd")

EXPORTABLE = {reduce_grad: torch.ops.ringpass.reduce_grad.default, scale_grad: torch.ops.ringpass.scale_grad.default}
