"""`ringpass.integrations.data`: the ranks of one ring read the same batches, data-parallel groups disjoint ones.

`RingSampler`'s indices are `DistributedSampler`'s over the data-parallel groups (the reference), on plain
dp_rank / dp_size and on real DeviceMeshes; `shard_collator`'s batch is `ringpass.shard` of the collated batch.
Ranks are played one after another in this process by torch's "fake" process group (world size > 1, no
communication, no spawn): what these functions read of a group is its size and this rank.
"""

import itertools
import pickle
from collections import namedtuple
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend
from torch.utils.data import default_collate
from torch.utils.data.distributed import DistributedSampler

import ringpass
from ringpass.integrations.data import RingSampler, ring_dataloader, shard_collator


@contextmanager
def rank_of(world_size: int, rank: int):
    """This process as ``rank`` of ``world_size`` (the fake backend: sizes and ranks, no communication)."""
    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def reference(dataset, dp_size, dp_rank, epoch=0, **options) -> list[int]:
    sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, **options)
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.parametrize("dp_size", [1, 2, 3, 4])
def test_indices_are_distributed_samplers_over_the_data_parallel_groups(dp_size):
    for length, dp_rank, shuffle, drop_last, epoch, seed in itertools.product(
        (10, 11), range(dp_size), (True, False), (True, False), (0, 3), (0, 7)
    ):
        dataset = range(length)
        options = dict(shuffle=shuffle, drop_last=drop_last, seed=seed)
        sampler = RingSampler(dataset, dp_rank=dp_rank, dp_size=dp_size, **options)
        sampler.set_epoch(epoch)
        expected = reference(dataset, dp_size, dp_rank, epoch, **options)
        assert list(sampler) == expected and len(sampler) == len(expected), (length, dp_rank, options, epoch)


@pytest.mark.parametrize("names", [("dp", "cp"), ("cp", "dp")])
def test_the_ranks_of_one_ring_read_the_same_indices_on_a_mesh(names):
    dataset = range(13)
    indices, dp_ranks = [], []
    for rank in range(4):
        with rank_of(4, rank):
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
            indices.append(list(RingSampler(dataset, mesh, seed=5)))
            dp_ranks.append(mesh.get_local_rank("dp"))
    rings = [[r for r in range(4) if dp_ranks[r] == dp] for dp in (0, 1)]
    assert rings == ([[0, 1], [2, 3]] if names[0] == "dp" else [[0, 2], [1, 3]])
    for dp, ring in enumerate(rings):
        for rank in ring:
            assert indices[rank] == reference(dataset, 2, dp, seed=5), (rank, dp)
    assert set(indices[rings[0][0]]) | set(indices[rings[1][0]]) == set(dataset)


def test_one_ring_reads_every_index_on_every_rank():
    """A 1-D mesh is one ring, and so is the default group (mesh=None): data-parallel size 1."""
    dataset = range(9)
    expected = reference(dataset, 1, 0, epoch=2)
    for rank in range(3):
        with rank_of(3, rank):
            for mesh in (init_device_mesh("cpu", (3,), mesh_dim_names=("cp",)), None):
                sampler = RingSampler(dataset, mesh)
                sampler.set_epoch(2)
                assert list(sampler) == expected, (rank, mesh)
    assert list(RingSampler(dataset)) == reference(dataset, 1, 0)  # no process group at all


def test_set_epoch_changes_the_order():
    samplers = [RingSampler(range(32), dp_rank=dp, dp_size=2) for dp in range(2)]
    epochs = []
    for epoch in (0, 1, 0):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        epochs.append([list(sampler) for sampler in samplers])
        assert sorted(epochs[-1][0] + epochs[-1][1]) == list(range(32))  # the groups share out the dataset
    assert epochs[1] != epochs[0] and epochs[2] == epochs[0]


@pytest.mark.parametrize(
    "mesh, options, message",
    [
        ((2, 2), dict(dp_rank=0, dp_size=2), "not both"),
        (None, dict(dp_rank=0), "pass both"),
        (None, dict(dp_rank=2, dp_size=2), "0 <= dp_rank < dp_size"),
        ((2, 2), dict(dp_dim="data"), "none is dp_dim='data'"),
        ("group", {}, "not a DeviceMesh"),
    ],
)
def test_a_mesh_or_ranks_that_do_not_say_the_data_parallel_group_are_refused(mesh, options, message):
    with rank_of(4, 0):
        if mesh == "group":
            mesh = dist.group.WORLD
        elif mesh is not None:
            mesh = init_device_mesh("cpu", mesh, mesh_dim_names=("dp", "cp"))
        with pytest.raises(ringpass.InvalidInputError, match="RingSampler") as caught:
            RingSampler(range(8), mesh, **options)
    assert message in str(caught.value), caught.value


def test_a_1d_data_parallel_mesh_is_refused():
    with rank_of(4, 0):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))["dp"]
        with pytest.raises(ringpass.InvalidInputError, match="a 1-D mesh is one ring.*pass the whole mesh"):
            RingSampler(range(8), mesh)


def test_sharded_loading_over_a_mesh_of_three_dims_asks_for_the_ring():
    with rank_of(8, 0):
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
        assert list(RingSampler(range(8), mesh)) == reference(range(8), 2, 0)  # the sampler needs only dp
        with pytest.raises(ringpass.InvalidInputError, match=r"shard_collator\(group=mesh\['cp'\]\)"):
            ring_dataloader(range(8), mesh, batch_size=2, sharded=True)


def samples(count=3, length=13) -> list[dict]:
    return [
        {
            "input_ids": torch.arange(length) + 100 * i,
            "labels": torch.arange(length) - 100 * i,
            "pixels": torch.randn(3, 2, length),
            "mask": torch.ones(length, dtype=torch.long),
            "length": torch.tensor(length),
            "name": f"sample{i}",
        }
        for i in range(count)
    ]


def test_shard_collator_gives_ringpass_shard_of_the_collated_batch():
    data = samples()
    whole = default_collate(data)
    shards = []
    for rank in range(2):
        with rank_of(2, rank):
            batch = shard_collator(dims={"pixels": 3, "mask": None})(data)
            assert set(batch) == set(whole)
            for key in ("input_ids", "labels"):
                torch.testing.assert_close(batch[key], ringpass.shard(whole[key], 1), rtol=0, atol=0)
            torch.testing.assert_close(batch["pixels"], ringpass.shard(whole["pixels"], 3), rtol=0, atol=0)
            for key in ("mask", "length"):  # dims says None; a 1-D tensor: kept whole
                torch.testing.assert_close(batch[key], whole[key], rtol=0, atol=0)
            assert batch["name"] == whole["name"]
            shards.append(batch["input_ids"])
    assert shards[0].shape == (3, 8) and not torch.equal(shards[0], shards[1])  # 13 tokens padded to 16


def test_shard_collator_keeps_tuples_lists_and_the_mapping_type():
    Pair = namedtuple("Pair", "ids labels")
    data = [(torch.arange(8) + i, torch.arange(8) * i) for i in range(2)]
    whole = default_collate(data)

    def as_types(batch):
        return {"pair": Pair(*batch), "list": list(batch), "tuple": tuple(batch)}

    transformers = pytest.importorskip("transformers")
    with rank_of(2, 1):
        batch = shard_collator(lambda s: transformers.BatchEncoding(as_types(default_collate(s))))(data)
        assert type(batch) is transformers.BatchEncoding
        for key, kind in (("pair", Pair), ("list", list), ("tuple", tuple)):
            assert type(batch[key]) is kind
            for got, full in zip(batch[key], whole):
                torch.testing.assert_close(got, ringpass.shard(full, 1), rtol=0, atol=0)


def test_shard_collator_reads_the_ring_once_and_pickles_for_loader_workers():
    """Workers started without the process group (spawn, forkserver) shard as this rank does."""
    data = samples()
    with rank_of(4, 3):
        ring = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))["cp"]
        collator = shard_collator(group=ring)
        expected = ringpass.shard(default_collate(data)["input_ids"], 1, group=ring)
        assert not torch.equal(expected, ringpass.shard(default_collate(data)["input_ids"], 1))  # a ring of 2, not 4
    batch = pickle.loads(pickle.dumps(collator))(data)
    torch.testing.assert_close(batch["input_ids"], expected, rtol=0, atol=0)


@pytest.mark.parametrize("sharded", [False, True])
def test_ring_dataloader_batches_the_samplers_indices(sharded):
    dataset = samples(count=11, length=8)
    for rank in range(4):
        with rank_of(4, rank):
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
            loader = ring_dataloader(dataset, mesh, batch_size=2, seed=1, drop_last=True, sharded=sharded)
            loader.sampler.set_epoch(4)
            indices = reference(dataset, 2, mesh.get_local_rank("dp"), epoch=4, seed=1, drop_last=True)
            assert len(indices) == 5 and len(loader) == 2  # 11 samples: 1 dropped, then an incomplete batch
            for batch, start in zip(loader, (0, 2), strict=True):
                whole = default_collate([dataset[i] for i in indices[start : start + 2]])
                ids = ringpass.shard(whole["input_ids"], 1, group=mesh["cp"]) if sharded else whole["input_ids"]
                torch.testing.assert_close(batch["input_ids"], ids, rtol=0, atol=0)
