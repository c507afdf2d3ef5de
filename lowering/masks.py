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


def mask_tiles(task: BlockTask, q_pos, kv_pos, block_mask: BlockMask, batch: int, heads: int,
               split: bool = False) -> Iterator[Tile]:
    """The kernel calls of one planned task, empty tiles left out. Without a window or a program the
    task itself is the only tile, unless ``split`` asks for tiles anyway (a bias program evaluated per tile)."""
    if block_mask.positional_only and not split:
        yield Tile(slice(task.q_start, task.q_stop), slice(task.kv_start, task.kv_stop), task.causal)
        return
    for r in range(task.q_start, task.q_stop, MASK_TILE):
        rows = slice(r, min(r + MASK_TILE, task.q_stop))
        for c in range(task.kv_start, task.kv_stop, MASK_TILE):
            cols = slice(c, min(c + MASK_TILE, task.kv_stop))
            if _outside_window(q_pos[rows], kv_pos[cols], block_mask):
                continue
            visible, bias = block_mask.evaluate(q_pos[rows], kv_pos[cols], batch, heads)
            if not bool(visible.any()):
                continue
            if bool(visible.all()):
                yield Tile(rows, cols, causal=False, bias=bias)
            elif _is_causal_on_aligned(visible, q_pos[rows], kv_pos[cols]):
                yield Tile(rows, cols, causal=True, bias=bias)
            else:
                yield Tile(rows, cols, causal=False, mask=visible, bias=bias)


def _outside_window(q_pos, kv_pos, block_mask: BlockMask) -> bool:
    """Whole tiles the causal window leaves out, decided from the positions' ranges without evaluating."""
    if not block_mask.is_causal:
        return False
    lowest_q, highest_q, lowest_kv, highest_kv = (int(x) for x in (q_pos.min(), q_pos.max(), kv_pos.min(), kv_pos.max()))
    if lowest_kv > highest_q:
        return True
    return block_mask.window is not None and lowest_q - highest_kv >= block_mask.window


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
