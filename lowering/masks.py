"""Masks beyond plain causal: a sliding window and mask programs, evaluated one tile at a time.

A *mask program* is a function ``program(q_pos, kv_pos, *inputs) -> bool`` that says, for global query
positions ``q_pos [n]`` and key positions ``kv_pos [m]``, which pairs are visible; its result broadcasts
to ``[B, Hq, n, m]``. A program may instead return an additive float mask, as models add it to the
scores: values at or below `MASKED_AT_OR_BELOW` hide their key, and any other nonzero value is a bias
the kernels add to the score (a position bias combined with the mask in one tensor). The ``inputs`` are small
replicated tensors it reads (position ids, segment ids, a padding mask: ``[B, S]``-sized, never ``S x S``).
The compiler lifts such programs out of model graphs (see ``ringpass/passes/lift_masks.py``); they travel to
the ring op by id (`register_mask`), since a custom op cannot take a function.

The ring never evaluates a mask for a whole block. `tile_states` classifies a planned task's tiles of
``MASK_TILE x MASK_TILE`` pairs (empty, fully visible, exactly causal, partial): causality and the window in
closed form from the tiles' position ranges, a program on the device a strip of ``MASK_STRIP`` tiles at a
time, summarised there and read back once per task (no host sync per tile). `mask_tiles` then keeps the
task whole where the mask hides nothing causality does not, else merges each row's fully visible tiles
into large calls and evaluates the mask only on the partial tiles, which get their tile of it. Memory
for masking is bounded by one strip, whatever the sequence length.

Packed documents need no program: `BlockMask.documents` (each token's document id, the `DOCUMENTS` mask) decides
tiles in closed form from the ids' range per tile and row, as causality and the window do, and compares ids only on
tiles that hold a document boundary.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import torch

from lowering import events
from lowering.documents import shared_runs
from lowering.errors import InvalidInputError, NotSupportedError
from lowering.schedule import BlockTask

MASK_TILE = 256  # query rows and key columns per evaluated mask tile: bounds mask memory independently of S
MASK_STRIP = 16  # tiles of keys a program is evaluated on at once: MASK_TILE x MASK_STRIP * MASK_TILE pairs
# An additive mask value at or below this hides its key: exp(score - 1e4) underflows to exactly 0 next to
# any visible key, in every float dtype (-inf, -1e9 and finfo.min all qualify). What a row whose keys are
# all hidden gives: `lowering.fully_masked`.
MASKED_AT_OR_BELOW = -1e4

_programs: dict[str, Callable] = {}

# The mask id of "same document": its one input holds each token's document id, ``[N]`` or ``[B, N]`` (any
# integers; equal ids, one document). The ring decides its tiles from the ids' ranges per tile (`BlockMask.documents`)
# and compares ids only on tiles that hold more than one document: packed rows (`lowering.ring_attention`'s
# ``documents``, the documents lift_masks reads in a model's mask) cost no program evaluation.
DOCUMENTS = "ringpass-documents"


def register_mask(program: Callable, source: str | None = None, *, mask_id: str | None = None) -> str:
    """Make ``program`` callable from the ring op; returns its id. ``source`` (e.g. a GraphModule's code)
    names it by content, so every rank and every recompile gives the same program the same id; without
    it the function object itself is the key (two lambdas never share an id; the registry keeps it alive).
    ``mask_id`` registers it under an id given before (a loaded converted model's graph names its programs)."""
    if mask_id is None:
        name = f"{getattr(program, '__module__', '')}.{getattr(program, '__qualname__', type(program).__name__)}"
        key = source if source is not None else f"{name}@{id(program)}"
        mask_id = "mask-" + hashlib.sha1(key.encode()).hexdigest()[:16]
    _programs[mask_id] = program
    return mask_id


def mask_program(mask_id: str) -> Callable:
    try:
        return _programs[mask_id]
    except KeyError:
        raise InvalidInputError(
            f"Mask program {mask_id!r} is not registered in this process; a graph compiled elsewhere was loaded "
            "without its programs. Compile the model in this process, or load a converted model with ringpass.load."
        ) from None


def same_document(q_pos: torch.Tensor, kv_pos: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The `DOCUMENTS` mask as a program: bool ``[B or 1, 1, n, m]``, a key visible from the queries of its document."""
    ids = ids.reshape(-1, ids.size(-1))
    return (ids[:, q_pos, None] == ids[:, None, kv_pos])[:, None]


register_mask(same_document, mask_id=DOCUMENTS)


def document_ids(inputs: tuple, seq_len: int, batch: int) -> torch.Tensor:
    """The `DOCUMENTS` mask's input as ``[B or 1, N]``, checked: one integer tensor of ``[N]`` or ``[B or 1, N]``."""
    ids = inputs[0] if len(inputs) == 1 else None
    if (
        not isinstance(ids, torch.Tensor)
        or ids.is_floating_point()
        or ids.dtype == torch.bool
        or ids.dim() not in (1, 2)
        or ids.size(-1) != seq_len
        or (ids.dim() == 2 and ids.size(0) not in (1, batch))
    ):
        described = [f"{t.dtype}{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__ for t in inputs]
        raise InvalidInputError(
            f"documents must be one integer tensor of each token's document id, [{seq_len}] or [{batch}, {seq_len}] "
            f"(the whole sequence, on every rank); got {', '.join(described) or 'nothing'}."
        )
    return ids.reshape(-1, seq_len)


def documents_mask(is_causal: bool, window: int | None, inputs: Sequence, seq_len: int, batch: int) -> BlockMask:
    """The `DOCUMENTS` mask of a ring call's ``inputs``: the ids, and where the graph made one, their copy on the host
    after them (``ringpass::documents_on_host``, once per call for every attention that reads them), which the ring
    then plans from without a copy (and a device sync) of its own."""
    ids, *host = inputs
    documents = document_ids((ids,), seq_len, batch)
    if len(host) > 1 or (host and host[0].device.type != "cpu"):
        raise InvalidInputError(
            "The documents mask reads the ids and at most their host copy after them; got "
            f"{[f'{t.dtype}{list(t.shape)} on {t.device}' for t in inputs]}."
        )
    host = document_ids(tuple(host), seq_len, batch) if host else None
    return BlockMask(is_causal, window, documents=documents, documents_host=host)


@dataclass(frozen=True)
class BlockMask:
    """What decides visibility besides the layout: causal, a sliding window of ``window`` keys (a key is
    visible from query positions ``kv_pos <= q_pos < kv_pos + window``; needs causal), a program, and
    ``documents``: each token's document id ``[B or 1, N]`` (a key is visible only from queries of its document),
    ``documents_host``: the same on the host where the caller has it (else `documents_on_host` copies them)."""

    is_causal: bool = False
    window: int | None = None
    program: Callable | None = None
    inputs: tuple[torch.Tensor, ...] = ()
    documents: torch.Tensor | None = None
    documents_host: torch.Tensor | None = None

    def __post_init__(self):
        if self.window is not None and (not self.is_causal or self.window < 1):
            raise InvalidInputError(f"window={self.window}: a sliding window needs is_causal=True and a width >= 1.")

    @property
    def positional_only(self) -> bool:
        """Only causal (or nothing): the planned tasks are already exact, no tile needs evaluating."""
        return self.window is None and self.program is None and self.documents is None

    @cached_property
    def documents_on_host(self) -> torch.Tensor:
        """The document ids on the host, read once per call: tiles are classified from their ranges there. Copied
        here (a ``documents_to_host`` event: on a GPU, a sync) only where the caller did not pass them."""
        if self.documents_host is not None:
            return self.documents_host
        if events.recording():
            events.emit("documents_to_host", bytes=self.documents.numel() * self.documents.element_size())
        return self.documents.cpu()

    @cached_property
    def document_starts(self) -> tuple[int, ...] | None:
        """Where each document begins, when every row is packed alike and each id is one run of tokens (a document
        is then a range of positions: the ring plans its pairs exactly, `lowering.schedule.plan_documents`), else
        None (tiles are decided from the ids' ranges)."""
        rows = self.rows_document_starts
        return rows[0] if rows is not None and len(rows) == 1 else None

    @cached_property
    def rows_document_starts(self) -> tuple[tuple[int, ...], ...] | None:
        """Per distinct row packing, where each of its documents begins, when each id is one run of tokens in its
        row (which pairs a row's documents hold is then known exactly from the starts), else None."""
        rows = []
        for row in torch.unique(self.documents_on_host, dim=0):
            lengths = shared_runs(row)
            if len(lengths) != len(torch.unique(row)):  # an id in two runs
                return None
            rows.append(tuple(itertools.accumulate(lengths[:-1], initial=0)))
        return tuple(dict.fromkeys(rows))  # rows packed alike under other ids: one packing

    def evaluate(self, q_pos: torch.Tensor, kv_pos: torch.Tensor, batch: int, heads: int):
        """(bool ``[B or 1, Hq or 1, n, m]``: which (query, key) pairs of these positions are visible; the
        additive bias an additive program carries on them, or None)."""
        visible, bias = _positional(q_pos, kv_pos, self)[None, None], None
        if self.documents is not None:
            visible = visible & same_document(q_pos, kv_pos, self.documents)
        if self.program is not None:
            program_visible, bias = self.evaluate_program(q_pos, kv_pos, batch, heads)
            visible = visible & program_visible
        elif events.recording():
            events.emit("mask_tile", shape=tuple(visible.shape), numel=visible.numel())
        return visible, bias

    def evaluate_program(self, q_pos: torch.Tensor, kv_pos: torch.Tensor, batch: int, heads: int):
        """The program alone on these positions: (bool visible, expanded to ``[B or 1, Hq or 1, n, m]``;
        its additive bias or None), its shape checked."""
        visible, bias = split_additive(call_program(self.program, q_pos, kv_pos, *self.inputs))
        try:
            shape = torch.broadcast_shapes(visible.shape, (1, 1, len(q_pos), len(kv_pos)))
        except RuntimeError:
            shape = None
        if shape is None or len(shape) != 4 or shape[0] not in (1, batch) or shape[1] not in (1, heads):
            raise InvalidInputError(
                f"The mask program returned shape {tuple(visible.shape)}; it must broadcast to "
                f"[batch={batch} or 1, heads={heads} or 1, {len(q_pos)}, {len(kv_pos)}]."
            )
        if events.recording():
            events.emit("mask_tile", shape=tuple(shape), numel=math.prod(shape))
        return visible.expand(shape), None if bias is None else bias.expand(shape)


@dataclass(frozen=True)
class Tile:
    """A rectangle of a planned task for one kernel call: ``mask`` is None when the positions alone
    (``causal``: kv_pos <= q_pos, else everything) describe it; ``bias``: what an additive mask adds."""

    rows: slice
    cols: slice
    causal: bool
    mask: torch.Tensor | None = None
    bias: torch.Tensor | None = None


EMPTY, FULL, CAUSAL, PARTIAL = range(4)  # what a tile of a planned task is (`tile_states`)


def tile_states(
    task: BlockTask,
    q_host: torch.Tensor,
    kv_host: torch.Tensor,
    block_mask: BlockMask,
    q_pos,
    kv_pos,
    batch: int,
    heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(states ``[R, C]`` int8, has_bias ``[R, C]`` bool) of the task's ``MASK_TILE`` x ``MASK_TILE`` tiles:
    ``EMPTY`` (nothing visible), ``FULL`` (every pair the positions leave visible stays visible),
    ``CAUSAL`` (a diagonal tile of a causal task, exactly causal), ``PARTIAL`` (the mask must be evaluated
    on it). Causality and the window decide in closed form on the host positions ``q_host`` / ``kv_host``;
    a program is evaluated on the device positions ``q_pos`` / ``kv_pos`` a strip of ``MASK_STRIP`` tiles at
    a time and summarised there, so the whole task costs one host sync, not one per tile."""
    tile, n, m = MASK_TILE, task.q_stop - task.q_start, task.kv_stop - task.kv_start
    rows, cols = -(-n // tile), -(-m // tile)
    row, col = torch.arange(rows)[:, None], torch.arange(cols)[None, :]
    if task.causal:  # a rank's own block: aligned positions, tiles on the diagonal are exactly causal
        states = torch.where(row > col, FULL, torch.where(row == col, CAUSAL, EMPTY))
    else:
        states = torch.full((rows, cols), FULL)
    if block_mask.window is not None:
        q_min, q_max = _tile_ranges(q_host[task.q_start : task.q_stop], tile)
        kv_min, kv_max = _tile_ranges(kv_host[task.kv_start : task.kv_stop], tile)
        outside = q_min[:, None] - kv_max[None, :] >= block_mask.window
        inside = q_max[:, None] - kv_min[None, :] < block_mask.window
        states = torch.where(outside, EMPTY, torch.where(inside | (states == EMPTY), states, PARTIAL))
    if block_mask.documents is not None:
        states = _document_states(task, states, block_mask.documents_on_host, q_host, kv_host)
    states = states.to(torch.int8)
    has_bias = torch.zeros(rows, cols, dtype=torch.bool)
    if block_mask.program is not None:
        states, has_bias = _program_states(task, states, block_mask, q_pos, kv_pos, batch, heads)
    return states, has_bias


def _tile_ranges(values: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per tile of ``tile`` consecutive slots (the last dim): the lowest and highest value."""
    pad = -values.size(-1) % tile
    padded = torch.cat((values, values[..., -1:].expand(*values.shape[:-1], pad)), -1) if pad else values
    grouped = padded.unflatten(-1, (-1, tile))
    return grouped.amin(-1), grouped.amax(-1)


def _document_states(task: BlockTask, states, ids: torch.Tensor, q_host, kv_host) -> torch.Tensor:
    """The states with the documents ``ids [B or 1, N]`` (host) applied from each tile's range of ids per row:
    ``EMPTY`` where no row's query and key ranges meet, unchanged where every row's tile lies in one document on both
    sides, ``PARTIAL`` otherwise (its ids are compared there). Exact for any ids, sorted or not."""
    n, m = task.q_stop - task.q_start, task.kv_stop - task.kv_start
    q_min, q_max = _tile_ranges(ids[:, q_host[task.q_start : task.q_stop]], MASK_TILE)  # [B, R]
    kv_min, kv_max = _tile_ranges(ids[:, kv_host[task.kv_start : task.kv_stop]], MASK_TILE)  # [B, C]
    apart = ((q_max[:, :, None] < kv_min[:, None, :]) | (kv_max[:, None, :] < q_min[:, :, None])).all(0)
    one = (q_min == q_max)[:, :, None] & (kv_min == kv_max)[:, None, :] & (q_min[:, :, None] == kv_min[:, None, :])
    if events.recording():  # the pairs of the tiles the documents leave out (`lowering.ring.RingSpec.tiles`'s event)
        rows, cols = (torch.tensor([min(MASK_TILE, size - i) for i in range(0, size, MASK_TILE)]) for size in (n, m))
        area = rows[:, None] * cols[None, :]
        events.emit("document_skip", pairs=int(area[(states != EMPTY) & apart].sum()))
    return torch.where(apart, EMPTY, torch.where(one.all(0) | (states == EMPTY), states, PARTIAL))


def _program_states(task, states, block_mask: BlockMask, q_pos, kv_pos, batch, heads):
    """The program's verdict on every tile not already empty, evaluated a strip of tiles at a time on the
    device: none visible → EMPTY; all that causality and the window leave visible → unchanged; else
    PARTIAL. Only tiles causality or the window leave partly visible compare against them; for the rest
    (fully visible so far) the program's own any / all decide."""
    tile = MASK_TILE
    rows_count, cols_count = states.shape
    any_visible = torch.zeros(rows_count, cols_count, dtype=torch.bool, device=q_pos.device)
    all_visible = torch.zeros_like(any_visible)
    biased = torch.zeros_like(any_visible)
    for r, row_start in enumerate(range(task.q_start, task.q_stop, tile)):
        rows = slice(row_start, min(row_start + tile, task.q_stop))
        live = (states[r] != EMPTY).nonzero()
        if len(live) == 0:
            continue
        first, last = int(live[0]), int(live[-1]) + 1  # evaluate only the tiles not already empty
        for c0 in range(first, last, MASK_STRIP):
            c1 = min(c0 + MASK_STRIP, last)
            cols = slice(task.kv_start + c0 * tile, min(task.kv_start + c1 * tile, task.kv_stop))
            seen, bias = block_mask.evaluate_program(q_pos[rows], kv_pos[cols], batch, heads)
            if bias is not None:
                biased[r, c0:c1] = _per_tile(bias != 0, tile, torch.any)
            for c in range(c0, c1):  # tiles causality or the window cut: judged on the pairs they leave
                if int(states[r, c]) in (CAUSAL, PARTIAL):
                    part = slice((c - c0) * tile, (c - c0 + 1) * tile)
                    allowed = _positional(q_pos[rows], kv_pos[cols][part], block_mask)
                    any_visible[r, c] = (seen[..., part] & allowed).any()
                    all_visible[r, c] = (seen[..., part] | ~allowed).all()
            full = [c for c in range(c0, c1) if int(states[r, c]) == FULL]
            if full:
                any_strip, all_strip = _per_tile(seen, tile, torch.any), _per_tile(seen, tile, torch.all)
                index = torch.tensor(full) - c0
                any_visible[r, full] = any_strip[index]
                all_visible[r, full] = all_strip[index]
    any_visible, all_visible, biased = any_visible.cpu(), all_visible.cpu(), biased.cpu()  # the task's one sync
    states = torch.where((states == EMPTY) | ~any_visible, EMPTY, torch.where(all_visible, states, PARTIAL))
    return states.to(torch.int8), biased & (states != EMPTY)


def _per_tile(values: torch.Tensor, tile: int, reduce) -> torch.Tensor:
    """``reduce`` (torch.any / torch.all) of a strip's values ``[..., rows, cols]`` per tile of ``tile``
    columns: one value per tile."""
    flat = values.reshape(-1, values.size(-1)) if values.dim() > 1 else values[None]
    flat = reduce(flat, dim=0) if flat.size(0) > 1 else flat[0]  # over leading dims and rows at once
    whole = flat.size(0) // tile * tile
    parts = [reduce(flat[:whole].view(-1, tile), dim=1)] if whole else []
    if whole < flat.size(0):
        parts.append(reduce(flat[whole:])[None])
    return torch.cat(parts)


def _positional(q_pos, kv_pos, block_mask: BlockMask) -> torch.Tensor:
    """``[n, m]`` bool: the pairs causality and the window leave visible."""
    q, kv = q_pos.unsqueeze(-1), kv_pos.unsqueeze(0)
    if block_mask.is_causal:
        visible = kv <= q
    else:
        visible = torch.ones(len(q_pos), len(kv_pos), dtype=torch.bool, device=q_pos.device)
    if block_mask.window is not None:
        visible = visible & (q - kv < block_mask.window)
    return visible


def work_tiles(task: BlockTask, work: tuple[int, int]) -> list[Tile]:
    """A task cut into kernel calls of at most ``work = (rows, keys)`` (a causal task: each row of calls
    runs the keys before its rows in pieces and its own square as causal), so that no call's results and
    temporaries grow with the block: the ring's memory stays its accumulators' and its blocks'."""
    tiles, (height, width) = [], work
    for row_start in range(task.q_start, task.q_stop, height):
        rows = slice(row_start, min(row_start + height, task.q_stop))
        before = row_start - task.q_start + task.kv_start if task.causal else task.kv_stop  # keys fully visible
        for col_start in range(task.kv_start, before, width):
            tiles.append(Tile(rows, slice(col_start, min(col_start + width, before)), causal=False))
        if task.causal:
            tiles.append(Tile(rows, slice(before, before + rows.stop - rows.start), causal=True))
    return tiles


def mask_tiles(
    task: BlockTask,
    q_host,
    kv_host,
    block_mask: BlockMask,
    batch: int,
    heads: int,
    *,
    q_pos=None,
    kv_pos=None,
    split: bool = False,
    window_in_kernel: bool = False,
    work: tuple[int, int] | None = None,
) -> list[Tile]:
    """The kernel calls of one planned task, empty tiles left out. Where nothing beyond causality hides a
    pair of the task (no window or program, or ones that hide nothing here) the task is cut only into
    `work_tiles` of ``work`` (default: the whole task). Otherwise each row of ``MASK_TILE`` tiles runs its
    fully visible tiles as merged rectangles (of at most ``work[1]`` keys) and its diagonal tile as causal,
    and the mask is evaluated only on partial tiles. ``window_in_kernel``: the kernel applies the window
    itself (Triton), so a window alone never cuts the task. ``split``: every tile is its own call (a bias
    program is evaluated per tile). ``q_host`` / ``kv_host``: the positions on the host; ``q_pos`` /
    ``kv_pos``: on the device (default: the same tensors)."""
    q_pos = q_host if q_pos is None else q_pos
    kv_pos = kv_host if kv_pos is None else kv_pos
    work = work or (task.q_stop - task.q_start, task.kv_stop - task.kv_start)
    if window_in_kernel and block_mask.window is not None:
        block_mask = replace(block_mask, window=None)
    if block_mask.positional_only and not split:
        return work_tiles(task, work)
    states, has_bias = tile_states(task, q_host, kv_host, block_mask, q_pos, kv_pos, batch, heads)
    if not split and not bool(has_bias.any()):
        unmasked = tile_states(task, q_host, kv_host, BlockMask(block_mask.is_causal), q_pos, kv_pos, batch, heads)[0]
        if torch.equal(states, unmasked):  # the mask hides nothing causality does not
            return work_tiles(task, work)
    tiles, tile = [], MASK_TILE
    for r, row_start in enumerate(range(task.q_start, task.q_stop, tile)):
        rows = slice(row_start, min(row_start + tile, task.q_stop))
        run_start = None  # the first column of a run of fully visible tiles, merged into one call
        for c, col_start in enumerate(range(task.kv_start, task.kv_stop, tile)):
            cols = slice(col_start, min(col_start + tile, task.kv_stop))
            state, biased = int(states[r, c]), bool(has_bias[r, c])
            if state == FULL and not biased and not split and (run_start is None or col_start - run_start < work[1]):
                run_start = col_start if run_start is None else run_start
                continue
            if run_start is not None:
                tiles.append(Tile(rows, slice(run_start, col_start), causal=False))
                run_start = None
            if state == FULL and not biased and not split:  # a run that reached ``work`` keys starts anew
                run_start = col_start
            elif state in (FULL, CAUSAL) and not biased:
                tiles.append(Tile(rows, cols, causal=state == CAUSAL))
            elif state != EMPTY:
                tiles.extend(_evaluated_tile(rows, cols, q_pos, kv_pos, block_mask, batch, heads))
        if run_start is not None:
            tiles.append(Tile(rows, slice(run_start, task.kv_stop), causal=False))
    return tiles


def _evaluated_tile(rows, cols, q_pos, kv_pos, block_mask: BlockMask, batch, heads) -> list[Tile]:
    """A partial (or biased) tile: the mask evaluated on it, sent to the cheapest kernel path it allows."""
    visible, bias = block_mask.evaluate(q_pos[rows], kv_pos[cols], batch, heads)
    if not bool(visible.any()):
        return []
    if bool(visible.all()):
        return [Tile(rows, cols, causal=False, bias=bias)]
    if _is_causal_on_aligned(visible, q_pos[rows], kv_pos[cols]):
        return [Tile(rows, cols, causal=True, bias=bias)]
    return [Tile(rows, cols, causal=False, mask=visible, bias=bias)]


def aligned(q_pos: torch.Tensor, kv_pos: torch.Tensor) -> bool:
    """Identical, increasing query and key positions: the positional causal mask is the top-left one."""
    return q_pos.shape == kv_pos.shape and torch.equal(q_pos, kv_pos) and bool((q_pos[1:] > q_pos[:-1]).all())


def _is_causal_on_aligned(visible, q_pos, kv_pos) -> bool:
    """The tile's mask is the ordinary causal one on aligned positions (the fused path)."""
    if not aligned(q_pos, kv_pos):
        return False
    causal = torch.ones(len(q_pos), len(q_pos), dtype=torch.bool, device=visible.device).tril()
    return bool((visible == causal).all())


def call_program(program, *args):
    """A mask or bias program's values: a GraphModule's ``forward`` called directly, so that no module hook fires
    (a program runs inside the ring op; a hook that tracks modules, CommDebugMode's, would see a module it never
    saw entered); a plain function called as it is."""
    return getattr(program, "forward", program)(*args)


def split_additive(values: torch.Tensor):
    """A program's result as (visibility, bias or None): bool as is; an additive float mask hides the keys
    whose values are at or below `MASKED_AT_OR_BELOW` (-inf, -1e9, finfo.min) and adds the rest."""
    if values.dtype == torch.bool:
        return values, None
    if not values.is_floating_point():
        raise NotSupportedError(
            f"A mask program returned {values.dtype}; masks must be bool or additive float (0 / -inf)."
        )
    visible = values > MASKED_AT_OR_BELOW
    bias = values.masked_fill(~visible, 0.0)
    return visible, (bias if bool(bias.any()) else None)
