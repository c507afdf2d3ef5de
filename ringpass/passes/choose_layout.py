"""Choose which global positions each rank owns: the layout every later pass and the runtime ask.

Matches the ``layout`` option and the mask plans of `lift_masks`. With ``layout="auto"``: ``zigzag`` (it
balances causal work over the ranks) when an attention is causal or evaluates a mask program (masks read
from data, packed documents or padding, are causal in practice), and always with ``inputs="sharded"`` (the
user shards inputs with `ringpass.shard` without knowing the model); else ``contiguous``. Another value is
taken as it is. Inputs that arrive sequence-sharded (``ctx.carried_inputs``) fix the layout to theirs; a
strategy chosen by `choose_strategy` brings its layout (the one its attentions are predicted fastest in).
Writes ``ctx.layout_kind``.
"""

from __future__ import annotations

from ringpass.fx.context import PassContext


def choose_layout(ctx: PassContext) -> None:
    if ctx.carried_layout:  # the layout the inputs arrived in (the backend checked it against the option)
        ctx.layout_kind = ctx.carried_layout
        return
    if ctx.options.layout != "auto":
        ctx.layout_kind = ctx.options.layout
        return
    ctx.layout_kind = ctx.strategy.layout if ctx.strategy is not None else default_layout(ctx)


def default_layout(ctx: PassContext) -> str:
    """``layout="auto"``'s layout without a cost model: zigzag under any causal or masked attention, or sharded
    inputs; else contiguous."""
    masked = any(plan.is_causal or plan.program_id for plan in ctx.masks.plans.values())
    return "zigzag" if masked or ctx.options.inputs == "sharded" else "contiguous"
