"""The ring's plan: which (query rows, key rows) rectangles each step computes.

At step ``s`` of a P-rank ring, rank ``r`` holds its own queries and the KV block that started on rank
``(r - s) mod P``. `plan_block` turns the two ranks' segments (runs of consecutive real positions, from
the `Layout`) into `BlockTask`s:

- without a causal mask: one task over all real queries x all real keys;
- a rank's own block under a causal mask: one task with the causal mask on. Local order increases with
  position and query and key positions are the same, so the mask is the ordinary top-left causal one;
- another rank's block under a causal mask: chunks are disjoint, so every (query segment, key segment)
  tile is either fully visible (keys before the queries) or fully masked. Because local order increases
  with position, the visible keys of a query segment are a prefix of the block; query segments with the
  same prefix are merged into one rectangle. Fully masked tiles are never planned, padding never is.

`plan_documents` plans a row packed from documents the same way, per document (pairs of two documents never).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from lowering.layout import Layout, Segment


@dataclass(frozen=True)
class BlockTask:
    """One call of the block kernel: local query rows x local key rows of the arriving block."""

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int
    causal: bool

    @property
    def area(self) -> int:
        """Number of (query, key) pairs the kernel scores in this task (visible ones only)."""
        rows, cols = self.q_stop - self.q_start, self.kv_stop - self.kv_start
        if self.causal:  # aligned causal on a square: the lower triangle with its diagonal
            return rows * (rows + 1) // 2
        return rows * cols


def kv_source(rank: int, step: int, world_size: int) -> int:
    """The rank whose KV block rank ``rank`` holds at ring step ``step``."""
    return (rank - step) % world_size


def plan_block(layout: Layout, q_rank: int, kv_rank: int, is_causal: bool) -> tuple[BlockTask, ...]:
    """The tasks rank ``q_rank`` runs against the KV block of rank ``kv_rank``."""
    q_len, kv_len = layout.valid_len(q_rank), layout.valid_len(kv_rank)
    if q_len == 0 or kv_len == 0:
        return ()
    if not is_causal:
        return (BlockTask(0, q_len, 0, kv_len, causal=False),)
    if q_rank == kv_rank:
        return (BlockTask(0, q_len, 0, kv_len, causal=True),)
    tasks: list[BlockTask] = []
    kv_segments = layout.segments(kv_rank)
    for q_seg in layout.segments(q_rank):
        visible = [s for s in kv_segments if s.global_stop <= q_seg.global_start]
        if not visible:
            continue
        kv_stop = visible[-1].local_start + visible[-1].length
        q_stop = q_seg.local_start + q_seg.length
        last = tasks[-1] if tasks else None
        if last is not None and last.kv_stop == kv_stop and last.q_stop == q_seg.local_start:
            tasks[-1] = BlockTask(last.q_start, q_stop, 0, kv_stop, causal=False)
        else:
            tasks.append(BlockTask(q_seg.local_start, q_stop, 0, kv_stop, causal=False))
    return tuple(tasks)


def plan_documents(
    layout: Layout, q_rank: int, kv_rank: int, is_causal: bool, starts: tuple[int, ...]
) -> tuple[BlockTask, ...]:
    """`plan_block` for a row packed from documents that begin at ``starts`` (sorted global positions, the first 0):
    only pairs inside one document. The layout's segments are cut at the documents' starts; a query piece and a key
    piece of one document are fully visible, or (causal) fully hidden unless the keys come first, or on a rank's own
    block the same slots (an aligned causal square). Every planned pair is visible: nothing is masked or wasted."""
    kv_pieces: dict[int, list[Segment]] = {}
    for document, piece in _document_pieces(layout.segments(kv_rank), starts):
        kv_pieces.setdefault(document, []).append(piece)
    tasks = []
    for document, q in _document_pieces(layout.segments(q_rank), starts):
        for kv in kv_pieces.get(document, ()):
            if is_causal and q_rank == kv_rank and kv == q:
                tasks.append(BlockTask(q.local_start, q.local_stop, kv.local_start, kv.local_stop, causal=True))
            elif not is_causal or kv.global_stop <= q.global_start:
                tasks.append(BlockTask(q.local_start, q.local_stop, kv.local_start, kv.local_stop, causal=False))
    return tuple(tasks)


def _document_pieces(segments, starts: tuple[int, ...]):
    """(document index, the part of a segment inside it) for every segment, cut at the documents' starts."""
    for segment in segments:
        first = bisect.bisect_right(starts, segment.global_start) - 1
        position = segment.global_start
        for document in range(first, len(starts)):
            stop = min(segment.global_stop, starts[document + 1] if document + 1 < len(starts) else segment.global_stop)
            if stop <= position:
                break
            yield document, Segment(segment.local_start + position - segment.global_start, position, stop - position)
            position = stop


def describe_block(layout: Layout, q_rank: int, kv_rank: int, is_causal: bool) -> str:
    """One word for a planned block: ``diagonal``, ``full``, ``partial`` (a visible sub-rectangle;
    the rest is skipped) or ``skipped``."""
    tasks = plan_block(layout, q_rank, kv_rank, is_causal)
    if not tasks:
        return "skipped"
    if any(t.causal for t in tasks):
        return "diagonal"
    everything = (0, layout.valid_len(q_rank), 0, layout.valid_len(kv_rank))
    if len(tasks) == 1 and (tasks[0].q_start, tasks[0].q_stop, tasks[0].kv_start, tasks[0].kv_stop) == everything:
        return "full"
    return "partial"


def schedule_table(layout: Layout, is_causal: bool) -> list[list[str]]:
    """``table[rank][step]``: what rank ``rank`` does at ring step ``step`` (see `describe_block`)."""
    p = layout.world_size
    return [[describe_block(layout, r, kv_source(r, s, p), is_causal) for s in range(p)] for r in range(p)]


def visible_pairs(layout: Layout, rank: int, is_causal: bool) -> int:
    """How many (query, key) pairs rank ``rank`` scores over a whole lap: its share of the work."""
    p = layout.world_size
    return sum(t.area for s in range(p) for t in plan_block(layout, rank, kv_source(rank, s, p), is_causal))
