import pytest
import torch

from lowering import InvalidInputError, Layout


def test_zigzag_positions_are_chunk_r_then_chunk_2p_minus_1_minus_r():
    layout = Layout("zigzag", 2, 8)
    assert layout.positions(0).tolist() == [0, 1, 6, 7]
    assert layout.positions(1).tolist() == [2, 3, 4, 5]
    layout = Layout("zigzag", 3, 12)
    assert [layout.positions(r).tolist() for r in range(3)] == [[0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7]]


def test_contiguous_positions_are_slices():
    layout = Layout("contiguous", 3, 9)
    assert [layout.positions(r).tolist() for r in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_padding_positions_are_past_the_end_and_every_rank_has_the_same_length():
    # 10 tokens in 2P = 4 chunks of 3: two padding slots, at positions 10 and 11, on rank 0.
    layout = Layout("zigzag", 2, 10)
    assert layout.local_len == 6
    assert layout.positions(0).tolist() == [0, 1, 2, 9, 10, 11]
    assert layout.positions(1).tolist() == [3, 4, 5, 6, 7, 8]
    assert layout.valid_len(0) == 4 and layout.valid_len(1) == 6


@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world_size,seq_len", [(1, 5), (2, 8), (3, 1000), (4, 999), (4, 5), (4, 2), (3, 7)])
def test_every_real_position_is_owned_once_and_real_slots_lead(kind, world_size, seq_len):
    layout = Layout(kind, world_size, seq_len)
    owned = []
    for r in range(world_size):
        pos = layout.positions(r)
        assert pos.dtype == torch.int64 and pos.numel() == layout.local_len
        assert bool((pos[1:] > pos[:-1]).all()), "local order must increase with position"
        real = pos < seq_len
        assert real.sum().item() == layout.valid_len(r)
        assert bool(real[: layout.valid_len(r)].all()), "real slots must be a prefix"
        owned += pos[real].tolist()
    assert sorted(owned) == list(range(seq_len))


@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world_size,seq_len", [(1, 5), (2, 8), (3, 1000), (4, 999), (4, 2)])
@pytest.mark.parametrize("dim", [0, 2, -1])
def test_shard_then_unshard_is_the_identity(kind, world_size, seq_len, dim):
    layout = Layout(kind, world_size, seq_len)
    shape = [3, 2, 4]
    shape[dim] = seq_len
    x = torch.randn(shape)
    shards = [layout.shard(x, dim, r) for r in range(world_size)]
    for r, shard in enumerate(shards):
        pos = layout.positions(r)
        real = pos < seq_len
        expected = x.index_select(dim % 3, pos[real])
        assert torch.equal(shard.index_select(dim % 3, torch.nonzero(real).flatten()), expected)
        assert torch.all(shard.index_select(dim % 3, torch.nonzero(~real).flatten()) == 0)
    assert torch.equal(layout.unshard(shards, dim), x)


def test_bad_layouts_and_bad_shards_are_refused_with_a_reason():
    with pytest.raises(InvalidInputError, match="Unknown layout kind 'ring'"):
        Layout("ring", 2, 8)
    with pytest.raises(InvalidInputError, match="world_size must be a positive int"):
        Layout("zigzag", 0, 8)
    layout = Layout("zigzag", 2, 8)
    with pytest.raises(InvalidInputError, match="full sequence \\(8 tokens\\)"):
        layout.shard(torch.zeros(7), 0, 0)
    with pytest.raises(InvalidInputError, match="one shard per rank \\(2\\)"):
        layout.unshard([torch.zeros(4)], 0)
    with pytest.raises(InvalidInputError, match="dim 3 is out of range for a 1-D tensor"):
        layout.shard(torch.zeros(8), 3, 0)
    with pytest.raises(InvalidInputError, match="rank 2 is outside"):
        layout.positions(2)
