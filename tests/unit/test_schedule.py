"""The ring's plan against a brute-force oracle built from positions, and its balance."""

import pytest
import torch

from lowering import Layout, plan_block, schedule_table
from lowering.schedule import kv_source, visible_pairs


def test_schedule_table_zigzag_causal():
    # Own block: causal diagonal. Any other block: half of it is visible (a sub-rectangle), half skipped.
    table = schedule_table(Layout("zigzag", 4, 64), is_causal=True)
    assert table == [["diagonal", "partial", "partial", "partial"]] * 4


def test_schedule_table_contiguous_causal():
    table = schedule_table(Layout("contiguous", 4, 64), is_causal=True)
    assert table == [
        ["diagonal", "skipped", "skipped", "skipped"],
        ["diagonal", "full", "skipped", "skipped"],
        ["diagonal", "full", "full", "skipped"],
        ["diagonal", "full", "full", "full"],
    ]


@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
def test_schedule_table_bidirectional_is_all_full(kind):
    assert schedule_table(Layout(kind, 3, 60), is_causal=False) == [["full"] * 3] * 3


def test_zigzag_halves_are_the_right_ones():
    layout = Layout("zigzag", 4, 64)  # chunks of 8; rank 2 holds chunks 2 and 5
    # KV from rank 1 (chunks 1, 6): both query chunks see chunk 1 only.
    (task,) = plan_block(layout, 2, 1, True)
    assert (task.q_start, task.q_stop, task.kv_start, task.kv_stop, task.causal) == (0, 16, 0, 8, False)
    # KV from rank 3 (chunks 3, 4): only query chunk 5 sees them, all of them.
    (task,) = plan_block(layout, 2, 3, True)
    assert (task.q_start, task.q_stop, task.kv_start, task.kv_stop, task.causal) == (8, 16, 0, 16, False)


def _visible(layout, q_rank, kv_rank, is_causal):
    q_pos, kv_pos = layout.positions(q_rank), layout.positions(kv_rank)
    visible = (q_pos[:, None] < layout.seq_len) & (kv_pos[None, :] < layout.seq_len)
    if is_causal:
        visible &= kv_pos[None, :] <= q_pos[:, None]
    return visible


@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("world_size,seq_len", [(1, 7), (2, 16), (2, 13), (3, 100), (4, 999), (4, 5), (4, 2), (5, 37)])
def test_tasks_cover_exactly_the_visible_pairs_once(kind, is_causal, world_size, seq_len):
    layout = Layout(kind, world_size, seq_len)
    for r in range(world_size):
        for step in range(world_size):
            src = kv_source(r, step, world_size)
            covered = torch.zeros(layout.local_len, layout.local_len, dtype=torch.int64)
            for t in plan_block(layout, r, src, is_causal):
                rect = torch.ones(t.q_stop - t.q_start, t.kv_stop - t.kv_start, dtype=torch.int64)
                if t.causal:
                    q_pos = layout.positions(r)[t.q_start : t.q_stop]
                    kv_pos = layout.positions(src)[t.kv_start : t.kv_stop]
                    rect = (kv_pos[None, :] <= q_pos[:, None]).long()
                assert rect.any(), "a planned task must see at least one key"
                covered[t.q_start : t.q_stop, t.kv_start : t.kv_stop] += rect
            assert covered.max() <= 1, "no pair may be computed twice"
            assert torch.equal(covered.bool(), _visible(layout, r, src, is_causal)), (r, step)


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_zigzag_gives_every_rank_the_same_causal_work(world_size):
    layout = Layout("zigzag", world_size, 2 * world_size * 16)
    work = [visible_pairs(layout, r, is_causal=True) for r in range(world_size)]
    assert len(set(work)) == 1
    # in chunk tiles: chunk r sees r + 1 chunks, chunk 2P-1-r sees 2P - r: 2P + 1 visible tiles per rank
    chunk = layout.chunk_len
    tiles = 2 * world_size + 1
    assert work[0] == (tiles - 2) * chunk * chunk + 2 * chunk * (chunk + 1) // 2


def test_contiguous_causal_work_ramps_with_rank():
    layout = Layout("contiguous", 4, 64)
    work = [visible_pairs(layout, r, is_causal=True) for r in range(4)]
    assert work == sorted(work) and work[3] > 3 * work[0]
