"""Trade a sequence shard for a share of the heads, and back: a computation that mixes tokens but keeps heads apart
(a chunked scan) runs on every token of ``H / P`` heads on each rank.

- ``ringpass::sequence_to_heads``: ``x`` holds this rank's slots along ``seq_dim`` (the layout's order, padding
  last) and all ``H`` heads along ``head_dim``; returns every token (position order, padding dropped) of this
  rank's heads ``[r·H/P, (r+1)·H/P)``. One all-to-all: rank ``r`` sends rank ``j`` its slots of ``j``'s heads.
- ``ringpass::heads_to_sequence``: its inverse (and its backward): every token of this rank's heads back to this
  rank's slots of all heads, zero at padding slots.
- ``ringpass::own_heads``: a value every rank holds whole (a per-head parameter: Mamba2's ``A``, ``D``,
  ``dt_bias``), narrowed to this rank's heads along ``dim`` (backward: the gradient at this rank's heads, zero
  elsewhere: summed over the ranks, every head's); ``ringpass::place_own_heads`` is that backward.

The rank is read at run time (``group_name``), so every rank compiles the same graph; ``H`` must divide by ``P``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lowering import events
from lowering.documents import sequence_layout
from lowering.errors import InvalidInputError
from lowering.failures import wait_collective
from lowering.groups import group_by_name, rank_in
from lowering.layout import local_length


def _share(heads: int, world_size: int) -> int:
    if heads % world_size:
        raise InvalidInputError(f"{heads} heads do not split over {world_size} ranks: the head count must divide by P.")
    return heads // world_size


def _exchange(parts: torch.Tensor, group_name: str, direction: str) -> torch.Tensor:
    """``parts[j]`` goes to rank j; returns what every rank j sent this one, stacked the same way."""
    parts = parts.contiguous()
    received = torch.empty(parts.shape, dtype=parts.dtype, device=parts.device)
    if events.recording():
        events.emit("heads_exchange", direction=direction, bytes=parts.numel() * parts.element_size())
    work = dist.all_to_all_single(received, parts, group=group_by_name(group_name), async_op=True)
    wait_collective(work, received, group_name, f"the all-to-all of {direction}")
    return received


@torch.library.custom_op("ringpass::sequence_to_heads", mutates_args=())
def sequence_to_heads(
    x: torch.Tensor,
    seq_dim: int,
    head_dim: int,
    kind: str,
    world_size: int,
    seq_len: int,
    group_name: str,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    share = _share(x.size(head_dim), world_size)
    parts = x.unflatten(head_dim, (world_size, share)).movedim(head_dim, 0)  # [P (owner of the heads), ...]
    received = _exchange(parts, group_name, "tokens to heads")  # [P (sender: its slots), ...]
    return sequence_layout(kind, world_size, seq_len, documents).unshard(list(received.unbind(0)), seq_dim).contiguous()


@sequence_to_heads.register_fake
def _(x, seq_dim, head_dim, kind, world_size, seq_len, group_name, documents=None):
    shape = list(x.shape)
    shape[seq_dim], shape[head_dim] = seq_len, _share(shape[head_dim], world_size)
    return x.new_empty(shape)


@torch.library.custom_op("ringpass::heads_to_sequence", mutates_args=())
def heads_to_sequence(
    x: torch.Tensor,
    seq_dim: int,
    head_dim: int,
    kind: str,
    world_size: int,
    seq_len: int,
    group_name: str,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    layout = sequence_layout(kind, world_size, seq_len, documents)
    parts = torch.stack([layout.shard(x, seq_dim, rank) for rank in range(world_size)])  # [P (owner of the slots)]
    received = _exchange(parts, group_name, "heads to tokens")  # [P (sender: its heads), ...]
    return received.movedim(0, head_dim).flatten(head_dim, head_dim + 1).contiguous()


@heads_to_sequence.register_fake
def _(x, seq_dim, head_dim, kind, world_size, seq_len, group_name, documents=None):
    shape = list(x.shape)
    shape[seq_dim], shape[head_dim] = local_length(kind, world_size, seq_len), shape[head_dim] * world_size
    return x.new_empty(shape)


@torch.library.custom_op("ringpass::own_heads", mutates_args=())
def own_heads(x: torch.Tensor, dim: int, world_size: int, group_name: str) -> torch.Tensor:
    share = _share(x.size(dim), world_size)
    return x.narrow(dim, rank_in(group_name) * share, share).clone(memory_format=torch.contiguous_format)


@own_heads.register_fake
def _(x, dim, world_size, group_name):
    shape = list(x.shape)
    shape[dim] = _share(shape[dim], world_size)
    return x.new_empty(shape)


@torch.library.custom_op("ringpass::place_own_heads", mutates_args=())
def place_own_heads(x: torch.Tensor, dim: int, world_size: int, group_name: str) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] *= world_size
    whole = x.new_zeros(shape)
    whole.narrow(dim, rank_in(group_name) * x.size(dim), x.size(dim)).copy_(x)
    return whole


@place_own_heads.register_fake
def _(x, dim, world_size, group_name):
    shape = list(x.shape)
    shape[dim] *= world_size
    return x.new_empty(shape)


def _setup(ctx, inputs, output):
    ctx.config = inputs[1:]


def _inverse(op):
    return lambda ctx, grad: (op(grad, *ctx.config), *[None] * len(ctx.config))


for _op, _backward in (
    (sequence_to_heads, heads_to_sequence),
    (heads_to_sequence, sequence_to_heads),
    (own_heads, place_own_heads),
    (place_own_heads, own_heads),
):
    _op.register_autograd(_inverse(_backward), setup_context=_setup)
