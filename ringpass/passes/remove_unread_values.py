"""Remove the values nothing reads, before any other pass judges them.

Matches the captured graph's nodes whose value no output, no other node and no side effect reads: a score matrix a
model computes and then does not use (``q @ kᵀ`` beside an SDPA call), an unused projection. Dynamo drops most of
them itself, but not in every capture (a forward captured through a call of the module, as `ringpass.convert` and
`ringpass.inspect` capture it on other tensors, can keep them), and the passes after this one would judge them as
if they ran: an unread ``S x S`` matrix after an attention would be refused as mixing the tokens of a sharded
activation, in one front end and not another. Writes the graph without them (`ringpass.fx.nodes.remove_dead_code`:
in-place methods, ``setitem``, functions torch marks impure, calls that return no tensor and vmap's bookkeeping stay).
"""

from __future__ import annotations

from ringpass.fx.context import PassContext
from ringpass.fx.nodes import remove_dead_code


def remove_unread_values(ctx: PassContext) -> None:
    remove_dead_code(ctx.gm.graph)
    ctx.gm.recompile()
