"""A ``flex_attention`` call's ``mask_mod`` and ``score_mod`` as the ring's mask and score programs (a helper
of `lift_masks`).

``mask_mod(b, h, q_idx, kv_idx, *buffers) -> bool`` becomes a mask program evaluated, as flex evaluates it
(``vmap`` over batch, head, query and key index), on each tile's global positions. ``score_mod(score, b, h,
q_idx, kv_idx, *buffers)`` is read for what the kernels compute: the score scaled, optionally soft-capped
(``tanh(s / c) * c``), plus a term that does not depend on the score (a bias, e.g. ALiBi), which becomes
a bias program: ``score_mod`` evaluated at score 0. Anything else is refused, naming the op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ringpass.fx.nodes import ancestors, describe, refusal
from ringpass.fx.score_terms import peel_scale, peel_softcap, split_sum


class FlexProgram:
    """``program(q_pos, kv_pos, *buffers)``: ``mod`` at every (batch, head, query, key) of the tile, by
    broadcasting index tensors ``[B, 1, 1, 1]``, ``[1, H, 1, 1]``, ``[1, 1, n, 1]``, ``[1, 1, 1, m]`` (the
    elementwise reading of what flex evaluates with ``vmap``; vmap cannot run inside the ring's custom op);
    with ``score=True`` it is a ``score_mod`` at score 0 (its bias)."""

    def __init__(self, mod: fx.GraphModule, batch: int, heads: int, score: bool):
        self.mod, self.batch, self.heads, self.score = mod, batch, heads, score
        self.code = f"{mod.code}\n# batch={batch} heads={heads} score={score}"  # names the program by content

    def __call__(self, q_pos: torch.Tensor, kv_pos: torch.Tensor, *buffers: torch.Tensor) -> torch.Tensor:
        device = q_pos.device
        index = (
            torch.arange(self.batch, device=device).view(-1, 1, 1, 1),
            torch.arange(self.heads, device=device).view(1, -1, 1, 1),
            q_pos.view(1, 1, -1, 1),
            kv_pos.view(1, 1, 1, -1),
        )
        if self.score:
            return self.mod(torch.zeros((), dtype=torch.float64, device=device), *index, *buffers)
        return self.mod(*index, *buffers)


@dataclass(frozen=True)
class ScoreReading:
    """What a ``score_mod`` does: ``softcap(score · scale) + bias``."""

    scale: float = 1.0
    softcap: float | None = None
    bias: bool = False


def read_score_mod(score_mod: fx.GraphModule, call: fx.Node) -> ScoreReading:
    """What ``score_mod`` does to the score (its first input), as `ScoreReading`; anything the kernels do not
    compute is refused, naming the flex_attention ``call``."""
    score = next(n for n in score_mod.graph.nodes if n.op == "placeholder")
    result = next(n for n in score_mod.graph.nodes if n.op == "output").args[0]
    terms = split_sum(result, lambda node: score in ancestors(node))
    scores, bias = terms if terms is not None else (result, None)
    scores, softcap = peel_softcap(scores, [])
    scores, scale = peel_scale(scores, [])
    if scores is not score:
        raise refusal(
            f"The score_mod of {describe(call)} computes {describe(scores)} from the score: ring attention's "
            "kernels apply a scale, a soft-cap tanh(s / c) * c and a bias that does not depend on the score.",
            call,
        )
    return ScoreReading(scale, softcap, bias is not None)
