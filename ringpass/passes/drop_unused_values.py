"""Drop values that nothing reads.

Matches ops whose result is a tensor that no other op reads and that change nothing: Dynamo keeps such
values when the model computes and discards them (Gemma 3 with bidirectional attention builds a mask
with ``vmap``, expands it to sequence x sequence and leaves it unused). The later passes would otherwise
probe and place them as if they mattered. What may change something stays (`remove_dead_code`: in-place
methods, ``setitem``, impure functions, calls that return no tensor such as ``vmap``'s nesting counters).

Writes: the graph without those ops.
"""

from __future__ import annotations

from ringpass.graph import remove_dead_code
from ringpass.passes.context import PassContext


def drop_unused_values(ctx: PassContext) -> None:
    remove_dead_code(ctx.gm.graph)
