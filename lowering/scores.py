"""Score modifiers: what the ring does to the scores ``scale · q kᵀ`` before masking and the softmax.

    scores = softcap · tanh(scale · q kᵀ / softcap)      logit soft-capping (Gemma 2), fused in the kernels
           + slope[h] · (kv_pos − q_pos)                  ALiBi: per-query-head slopes, computed in-kernel
           + bias(q_pos, kv_pos, *bias_inputs)            a *bias program*: any additive bias computed from
                                                          global positions and small replicated inputs

Each part is optional and they apply in this order (a bias under the soft-cap is not expressible). ALiBi
adds ``slope · (kv_pos − q_pos)``: a model that adds ``slope · kv_pos`` (BLOOM, MPT) differs by a constant
per query row, which leaves the softmax, the output and every gradient unchanged (only the LSE moves by
``slope · q_pos``) and keeps the added values small near the diagonal at any sequence length.

A bias program is registered like a mask program (`lowering.masks.register_mask`) and evaluated by the
ring one tile of at most ``MASK_TILE x MASK_TILE`` pairs at a time, so no rank holds ``S x S`` values; its
result must broadcast to ``[B, Hq, n, m]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lowering import events
from lowering.errors import InvalidInputError
from lowering.masks import call_program


@dataclass(frozen=True)
class ScoreMod:
    softcap: float | None = None
    slopes: tuple[float, ...] | None = None
    bias: Callable | None = None
    bias_inputs: tuple[torch.Tensor, ...] = ()
    _slopes_on: dict = field(default_factory=dict, compare=False, repr=False)  # device -> slopes tensor

    def __post_init__(self):
        check_score_options(self.softcap, self.slopes)

    @property
    def per_tile(self) -> bool:
        """A bias program is evaluated tile by tile: the ring cuts every block into tiles."""
        return self.bias is not None

    def kernel_options(self, q_pos: torch.Tensor, kv_pos: torch.Tensor, batch: int, heads: int, device) -> dict:
        """The block kernels' score options for one tile of these global positions."""
        slopes = None
        if self.slopes is not None:
            slopes = self._slopes_on.get(device)
            if slopes is None:
                slopes = self._slopes_on[device] = torch.tensor(self.slopes, dtype=torch.float64, device=device)
        bias = None if self.bias is None else self.bias_tile(q_pos, kv_pos, batch, heads)
        return dict(softcap=self.softcap, alibi_slopes=slopes, bias=bias)

    def bias_tile(self, q_pos, kv_pos, batch: int, heads: int) -> torch.Tensor:
        """The bias program's values for one tile, checked to broadcast to ``[batch, heads, n, m]``."""
        bias = call_program(self.bias, q_pos, kv_pos, *self.bias_inputs)
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
            raise InvalidInputError(
                f"The bias program returned {type(bias).__name__} "
                f"{getattr(bias, 'dtype', '')}; a score bias is a float tensor."
            )
        bias = bias[(None,) * (4 - bias.dim())] if bias.dim() < 4 else bias
        if (
            bias.dim() != 4
            or bias.size(0) not in (1, batch)
            or bias.size(1) not in (1, heads)
            or bias.size(2) not in (1, len(q_pos))
            or bias.size(3) not in (1, len(kv_pos))
        ):
            raise InvalidInputError(
                f"The bias program returned shape {tuple(bias.shape)}; it must broadcast to "
                f"[batch={batch} or 1, heads={heads} or 1, {len(q_pos)}, {len(kv_pos)}]."
            )
        if events.recording():
            events.emit("bias_tile", shape=tuple(bias.shape), numel=bias.numel())
        return bias


def check_score_options(softcap, slopes) -> None:
    if softcap is not None and not (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap > 0):
        raise InvalidInputError(f"softcap={softcap!r}: logit soft-capping needs a positive finite number.")
    if slopes is not None and not all(isinstance(s, (int, float)) and math.isfinite(s) for s in slopes):
        raise InvalidInputError("alibi_slopes must be finite numbers, one per query head.")
