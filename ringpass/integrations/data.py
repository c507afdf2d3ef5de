"""Loaders for ``inputs="full"`` and ``inputs="sharded"``: the ranks of one ring read the same batch.

    loader = ringpass.integrations.data.ring_dataloader(dataset, mesh, batch_size=8)     # mesh: ("dp", "cp")
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for batch in loader: ...

`RingSampler` is `DistributedSampler` over the data-parallel groups instead of over the ranks: every rank of
one ring (one coordinate along the mesh's ``dp`` dimension) gets the same indices, different groups get
disjoint shards, with DistributedSampler's own shuffle, epochs and ``drop_last``. `shard_collator` wraps a
collate function so that each rank keeps its layout shard of the batch's sequences (`ringpass.shard`), for
``inputs="sharded"``. `ring_dataloader` is a `DataLoader` with both.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, MutableMapping

import torch
from torch.utils.data import DataLoader, default_collate
from torch.utils.data.distributed import DistributedSampler

from lowering.errors import InvalidInputError
from lowering.layout import Layout
from ringpass.integrations.sharding import _world


class RingSampler(DistributedSampler):
    """`DistributedSampler` with ``num_replicas`` the number of data-parallel groups and ``rank`` this rank's.

    ``mesh``: a DeviceMesh with a dimension named ``dp_dim`` (the data-parallel groups; the other dimensions
    are the ring's), a 1-D mesh (one ring: every rank gets the same indices) or None (the default group is
    one ring). Without a mesh pass ``dp_rank=`` and ``dp_size=`` instead. Call ``set_epoch`` every epoch.
    """

    def __init__(
        self,
        dataset,
        mesh=None,
        *,
        dp_dim: str = "dp",
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        dp_rank: int | None = None,
        dp_size: int | None = None,
    ):
        dp_rank, dp_size = _data_parallel(mesh, dp_dim, dp_rank, dp_size)
        super().__init__(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=shuffle, seed=seed, drop_last=drop_last)


def shard_collator(collate_fn: Callable | None = None, *, dims: dict | None = None, group=None, layout="zigzag"):
    """A collate function: ``collate_fn`` (default `default_collate`), then every tensor of the batch (a tensor,
    or nested dicts, tuples and lists of them) replaced by this rank's ``layout`` shard (`ringpass.shard`).

    ``dims`` maps a dict key to the sequence dim of its tensors (None: keep them whole); a tensor whose key is
    not there is sharded along dim 1 when it has two dims or more, else kept whole. ``group`` is the ring's
    (`ringpass.shard`'s): its size and this rank are read here, once, so the function also runs in loader
    workers that have no process group; it pickles when ``collate_fn`` does.
    """
    world_size, rank = _world(group)
    return _ShardCollate(collate_fn or default_collate, dict(dims or {}), layout, world_size, rank)


def ring_dataloader(
    dataset,
    mesh=None,
    *,
    batch_size: int,
    dp_dim: str = "dp",
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    sharded: bool = False,
    collate_fn: Callable | None = None,
    **dataloader_kwargs,
) -> DataLoader:
    """A `DataLoader` over a `RingSampler` (``mesh``, ``dp_dim``, ``shuffle``, ``seed``, ``drop_last``: its
    arguments); ``drop_last`` also drops an incomplete last batch. ``sharded=True`` wraps ``collate_fn`` in a
    `shard_collator` over the ring: ``mesh`` without its ``dp_dim``, or the default group when ``mesh`` is None.
    """
    sampler = RingSampler(dataset, mesh, dp_dim=dp_dim, shuffle=shuffle, seed=seed, drop_last=drop_last)
    if sharded:
        collate_fn = shard_collator(collate_fn, group=_ring(mesh, dp_dim))
    return DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, collate_fn=collate_fn, **dataloader_kwargs
    )


class _ShardCollate:
    """What `shard_collator` returns (a class, so that it pickles for loader workers)."""

    def __init__(self, collate_fn: Callable, dims: dict, layout: str, world_size: int, rank: int):
        self.collate_fn, self.dims, self.layout, self.world_size, self.rank = collate_fn, dims, layout, world_size, rank

    def __call__(self, samples):
        return self._shard(self.collate_fn(samples), None)

    def _shard(self, value, key):
        if isinstance(value, torch.Tensor):
            dim = self.dims.get(key, 1 if value.dim() >= 2 else None)
            if dim is None:
                return value
            return Layout(self.layout, self.world_size, value.size(dim)).shard(value, dim, self.rank)
        if isinstance(value, Mapping):
            shards = {k: self._shard(v, k) for k, v in value.items()}
            if not isinstance(value, MutableMapping):
                return shards
            clone = copy.copy(value)  # keeps the mapping's type (a BatchEncoding stays one), as default_collate does
            clone.update(shards)
            return clone
        if isinstance(value, (list, tuple)):
            shards = [self._shard(v, key) for v in value]
            return type(value)(*shards) if hasattr(value, "_fields") else type(value)(shards)
        return value


def _data_parallel(mesh, dp_dim: str, dp_rank: int | None, dp_size: int | None) -> tuple[int, int]:
    """(this rank's data-parallel group, the number of groups)."""
    if dp_rank is not None or dp_size is not None:
        if mesh is not None:
            raise InvalidInputError(
                "RingSampler: pass either a mesh or dp_rank= and dp_size=, not both; the mesh gives both."
            )
        if dp_rank is None or dp_size is None:
            raise InvalidInputError(
                f"RingSampler: dp_rank={dp_rank}, dp_size={dp_size}: pass both (this rank's data-parallel "
                "group and the number of groups), or a DeviceMesh instead."
            )
        if not 0 <= dp_rank < dp_size:
            raise InvalidInputError(
                f"RingSampler: dp_rank={dp_rank} is not one of the dp_size={dp_size} data-parallel groups; "
                f"pass 0 <= dp_rank < dp_size (the same dp_rank on every rank of one ring)."
            )
        return dp_rank, dp_size
    if mesh is None:
        return 0, 1
    if not hasattr(mesh, "get_coordinate"):
        raise InvalidInputError(
            f"RingSampler: mesh is a {type(mesh).__name__}, not a DeviceMesh; pass init_device_mesh(..., "
            "mesh_dim_names=('dp', 'cp')), or dp_rank= and dp_size=."
        )
    names = mesh.mesh_dim_names or ()
    if mesh.ndim == 1:
        if dp_dim in names:
            raise InvalidInputError(
                f"RingSampler: a 1-D mesh is one ring, but this one is the data-parallel dimension {dp_dim!r}; "
                f"pass the whole mesh (its {dp_dim!r} and ring dimensions), or dp_rank= and dp_size=."
            )
        return 0, 1
    if dp_dim not in names:
        raise InvalidInputError(
            f"RingSampler: the mesh's dimensions are {names}, none is dp_dim={dp_dim!r}; pass dp_dim= naming "
            "its data-parallel dimension, or mesh=None when every rank reads the same batches."
        )
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise InvalidInputError("RingSampler: this rank is not in the mesh; pass a mesh that holds every rank.")
    dim = names.index(dp_dim)
    return coordinate[dim], mesh.size(dim)


def _ring(mesh, dp_dim: str):
    """The ring's group in ``mesh`` (`ringpass.shard`'s ``group``): the mesh less its data-parallel dimension."""
    if mesh is None or mesh.ndim == 1:
        return mesh
    if mesh.ndim > 2:
        raise InvalidInputError(
            f"ring_dataloader(sharded=True): the {mesh.ndim}-D mesh {mesh.mesh_dim_names} leaves no single ring "
            "dimension; pass collate_fn=ringpass.integrations.data.shard_collator(group=mesh['cp']) with sharded=False."
        )
    (ring,) = (name for name in mesh.mesh_dim_names if name != dp_dim)
    return mesh[ring]
