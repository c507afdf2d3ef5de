"""Shard inputs for ``inputs="sharded"`` and reassemble ``outputs="sharded"``, in the ring's own layout.

    model = torch.compile(model, backend=ringpass.backend(inputs="sharded", outputs="sharded"))
    logits = model(ringpass.shard(input_ids, dim=1))             # this rank's tokens, in layout order
    full = ringpass.unshard(logits, dim=1, seq_len=input_ids.shape[1])

With ``inputs="sharded"`` the backend's ``layout="auto"`` is zigzag, the default here; pass the same
``layout`` to both when the backend is given another. A plain ``x.chunk(P, dim)[rank]`` is a different
order (contiguous) and gives wrong numbers under a zigzag ring. With ``layout="documents"`` the layout is planned
from the documents: pass each token's document id (``documents=``, ``[B, N]`` or ``[N]``, the ids the model's mask
reads) to both.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lowering.documents import sequence_layout
from lowering.errors import InvalidInputError
from lowering.groups import resolve_group
from lowering.sequence_ops import documents_on_host


def shard(
    x: torch.Tensor, dim: int = 1, *, layout: str = "zigzag", group=None, documents: torch.Tensor | None = None
) -> torch.Tensor:
    """This rank's shard of the whole ``x`` along ``dim`` (zero-padded when the length does not divide)."""
    world_size, rank = _world(group)
    return _layout(layout, world_size, x.size(dim), documents).shard(x, dim, rank)


def unshard(
    x: torch.Tensor,
    dim: int = 1,
    *,
    seq_len: int,
    layout: str = "zigzag",
    group=None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """The whole tensor of ``seq_len`` positions along ``dim`` from every rank's shard ``x`` (an all-gather)."""
    world_size, _ = _world(group)
    ring = _layout(layout, world_size, seq_len, documents)
    if x.size(dim) != ring.local_len:
        raise InvalidInputError(
            f"unshard: x has {x.size(dim)} positions along dim {dim}, but {ring} gives each rank "
            f"{ring.local_len}; pass the seq_len of the whole sequence."
        )
    if world_size == 1:
        return ring.unshard([x], dim)
    shards = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(shards, x.contiguous(), group=resolve_group(group))
    return ring.unshard(shards, dim)


def _layout(kind: str, world_size: int, seq_len: int, documents: torch.Tensor | None):
    return sequence_layout(kind, world_size, seq_len, None if documents is None else documents_on_host(documents))


def _world(group) -> tuple[int, int]:
    resolved = resolve_group(group)
    if resolved is None:
        return 1, 0
    return dist.get_world_size(resolved), dist.get_rank(resolved)
