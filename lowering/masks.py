"""Masks beyond plain causal: a sliding window and mask programs, evaluated one tile at a time.

A *mask program* is a function ``program(q_pos, kv_pos, *inputs) -> bool`` that says, for global query
positions ``q_pos [n]`` and key positions ``kv_pos [m]``, which pairs are visible; its result broadcasts
to ``[B, Hq, n, m]``. A program may instead return an additive float mask, as models add it to the
scores: values at or below `MASKED_AT_OR_BELOW` hide their key, and any other nonzero value is a bias
the kernels add to the score (a position bias combined with the mask in one tensor). The ``inputs`` are small replicated tensors it reads (position ids, segment ids, a
padding mask: ``[B, S]``-sized, never ``S x S``). The compiler lifts such programs out of model graphs
(see ``ringpass/passes/lift_masks.py``); they travel to the ring op by id (`register_mask`), since a
custom op cannot take a function.

The ring never evaluates a mask for a whole block: `mask_tiles` walks a planned block in tiles of at
most ``MASK_TILE x MASK_TILE`` pairs, evaluates window and program there, skips tiles nothing is visible
in, sends fully visible tiles (and exactly causal ones) to the kernels' position-based paths, and hands
the rest their tile of the mask. Memory for masking is therefore bounded by the tile, whatever the
sequence length.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from lowering import events
from lowering.errors import InvalidInputError, NotSupportedError
from lowering.schedule import BlockTask

MASK_TILE = 256  # query rows and key columns per evaluated mask tile: bounds mask memory independently of S
MASK_STRIP = 16  # tiles of keys a program is evaluated on at once: MASK_TILE x MASK_STRIP * MASK_TILE pairs
# An additive mask value at or below this hides its key: exp(score - 1e4) underflows to exactly 0 next to
# any visible key, in every float dtype (-inf, -1e9 and finfo.min all qualify). What a row whose keys are
# all hidden gives: `lowering.fully_masked`.
MASKED_AT_OR_BELOW = -1e4

_programs: dict[str, Callable] = {}


def register_mask(program: Callable, source: Optional[str] = None, *, mask_id: Optional[str] = None) -> str:
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


@dataclass(frozen=True)
class BlockMask:
    """What decides visibility besides the layout: causal, a sliding window of ``window`` keys (a key is
    visible from query positions ``kv_pos <= q_pos < kv_pos + window``; needs causal), and a program."""

    is_causal: bool = False
    window: Optional[int] = None
    program: Optional[Callable] = None
    inputs: tuple[torch.Tensor, ...] = ()

    def __post_init__(self):
        if self.window is not None and (not self.is_causal or self.window < 1):
            raise InvalidInputError(f"window={self.window}: a sliding window needs is_causal=True and a width >= 1.")

    @property
    def positional_only(self) -> bool:
        """Only causal (or nothing): the planned tasks are already exact, no tile needs evaluating."""
        return self.window is None and self.program is None

    def evaluate(self, q_pos: torch.Tensor, kv_pos: torch.Tensor, batch: int, heads: int):
        """(bool ``[B or 1, Hq or 1, n, m]``: which (query, key) pairs of these positions are visible; the
        additive bias an additive program carries on them, or None)."""
        q, kv = q_pos.unsqueeze(-1), kv_pos.unsqueeze(0)
        visible = torch.ones(len(q_pos), len(kv_pos), dtype=torch.bool, device=q_pos.device)
        if self.is_causal:
            visible &= kv <= q
        if self.window is not None:
            visible &= q - kv < self.window
        visible, bias = visible[None, None], None
        if self.program is not None:
            program_visible, bias = split_additive(self.program(q_pos, kv_pos, *self.inputs))
            visible = visible & program_visible
        if visible.dim() != 4 or visible.size(0) not in (1, batch) or visible.size(1) not in (1, heads):
            raise InvalidInputError(
                f"The mask program returned shape {tuple(visible.shape)}; it must broadcast to "
                f"[batch={batch} or 1, heads={heads} or 1, {len(q_pos)}, {len(kv_pos)}]."
            )
        if events.recording():
            events.emit("mask_tile", shape=tuple(visible.shape), numel=visible.numel())
        return visible, bias


@dataclass(frozen=True)
class Tile:
    """A rectangle of a planned task for one kernel call: ``mask`` is None when the positions alone
    (``causal``: kv_pos <= q_pos, else everything) describe it; ``bias``: what an additive mask adds."""

    rows: slice
    cols: slice
    causal: bool
    mask: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None


EMPTY, FULL, CAUSAL, PARTIAL = range(4)  # what a tile of a planned task is (`tile_states`)


def tile_states(task: BlockTask, q_host: torch.Tensor, kv_host: torch.Tensor, block_mask: BlockMask, q_pos, kv_pos,
                batch: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
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
        q_min, q_max = _tile_ranges(q_host[task.q_start:task.q_stop], tile)
        kv_min, kv_max = _tile_ranges(kv_host[task.kv_start:task.kv_stop], tile)
        outside = q_min[:, None] - kv_max[None, :] >= block_mask.window
        inside = q_max[:, None] - kv_min[None, :] < block_mask.window
        states = torch.where(outside, EMPTY, torch.where(inside | (states == EMPTY), states, PARTIAL))
    states = states.to(torch.int8)
    has_bias = torch.zeros(rows, cols, dtype=torch.bool)
    if block_mask.program is not None:
        states, has_bias = _program_states(task, states, block_mask, q_pos, kv_pos, batch, heads)
    return states, has_bias


def _tile_ranges(positions: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per tile of ``tile`` consecutive slots: the lowest and highest position."""
    pad = -len(positions) % tile
    padded = torch.cat((positions, positions[-1:].expand(pad))) if pad else positions
    grouped = padded.view(-1, tile)
    return grouped.min(1).values, grouped.max(1).values


def _program_states(task, states, block_mask: BlockMask, q_pos, kv_pos, batch, heads):
    """The program's verdict on every tile, evaluated strip by strip on the device: 0 nothing visible, 1
    everything causality and the window leave visible stays visible, 2 some of it."""
    tile, strip = MASK_TILE, MASK_TILE * MASK_STRIP
    verdicts, biased = [], []
    for row_start in range(task.q_start, task.q_stop, tile):
        rows = slice(row_start, min(row_start + tile, task.q_stop))
        for strip_start in range(task.kv_start, task.kv_stop, strip):
            strip_cols = slice(strip_start, min(strip_start + strip, task.kv_stop))
            visible, bias = block_mask.evaluate(q_pos[rows], kv_pos[strip_cols], batch, heads)
            positional = _positional(q_pos[rows], kv_pos[strip_cols], block_mask)
            for c in range(0, strip_cols.stop - strip_cols.start, tile):
                seen, allowed = visible[..., c:c + tile], positional[..., c:c + tile]
                verdicts.append(torch.where(~seen.any(), 0, torch.where((seen | ~allowed).all(), 1, 2)))
                biased.append((bias[..., c:c + tile] != 0).any() if bias is not None else seen.new_zeros(()))
    shape = states.shape
    verdict = torch.stack(verdicts).view(shape).cpu()  # the task's one host sync
    has_bias = torch.stack(biased).view(shape).cpu()
    states = torch.where((states == EMPTY) | (verdict == 0), EMPTY, torch.where(verdict == 2, PARTIAL, states))
    return states.to(torch.int8), has_bias & (states != EMPTY)


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


def mask_tiles(task: BlockTask, q_host, kv_host, block_mask: BlockMask, batch: int, heads: int, *, q_pos=None,
               kv_pos=None, split: bool = False, window_in_kernel: bool = False,
               work: Optional[tuple[int, int]] = None) -> list[Tile]:
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
        block_mask = BlockMask(block_mask.is_causal, None, block_mask.program, block_mask.inputs)
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


def split_additive(values: torch.Tensor):
    """A program's result as (visibility, bias or None): bool as is; an additive float mask hides the keys
    whose values are at or below `MASKED_AT_OR_BELOW` (-inf, -1e9, finfo.min) and adds the rest."""
    if values.dtype == torch.bool:
        return values, None
    if not values.is_floating_point():
        raise NotSupportedError(f"A mask program returned {values.dtype}; masks must be bool or additive float (0 / -inf).")
    visible = values > MASKED_AT_OR_BELOW
    bias = values.masked_fill(~visible, 0.0)
    return visible, (bias if bool(bias.any()) else None)
