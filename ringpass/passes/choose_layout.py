"""Choose which global positions each rank owns: the layout every later pass and the runtime ask.

Matches the ``layout`` option and the mask plans of `lift_masks`. With ``layout="auto"``: ``zigzag`` (it
balances causal work over the ranks) when an attention is causal or evaluates a mask program (masks read
from data, packed documents or padding, are causal in practice), and always with ``inputs="sharded"`` (the
user shards inputs with `ringpass.shard` without knowing the model); else ``contiguous``. Another value is
taken as it is. Inputs that arrive sequence-sharded (``ctx.carried_inputs``) fix the layout to theirs; a
strategy chosen by `choose_strategy` brings its layout (the one its attentions are predicted fastest in).
``layout="documents"`` (`lowering.DocumentLayout`, planned per call from the documents' lengths) needs every
attention to mask packed documents read from one ids value, and a graph the runtime can run in it (refused
otherwise, saying why). Writes ``ctx.layout_kind`` (and, for documents, ``ctx.document_ids``: that ids value).
"""

from __future__ import annotations

from lowering.errors import NotSupportedError
from lowering.layout import DOCUMENTS_KIND
from lowering.masks import DOCUMENTS
from ringpass.fx.context import PassContext
from ringpass.fx.spellings import PROMPT_SLOTS


def choose_layout(ctx: PassContext) -> None:
    if ctx.carried_layout:  # the layout the inputs arrived in (the backend checked it against the option)
        ctx.layout_kind = ctx.carried_layout
        return
    if ctx.options.layout == DOCUMENTS_KIND:
        ctx.document_ids = _document_ids(ctx)
    if ctx.options.layout != "auto":
        ctx.layout_kind = ctx.options.layout
        return
    ctx.layout_kind = ctx.strategy.layout if ctx.strategy is not None else default_layout(ctx)


def default_layout(ctx: PassContext) -> str:
    """``layout="auto"``'s layout without a cost model: zigzag under any causal or masked attention, or sharded
    inputs; else contiguous."""
    masked = any(plan.is_causal or plan.program_id for plan in ctx.masks.plans.values())
    return "zigzag" if masked or ctx.options.inputs == "sharded" else "contiguous"


def _document_ids(ctx: PassContext):
    """The one ids value every attention's documents mask reads (the documents layout is planned from it)."""
    masks = {plan.inputs[0] if plan.program_id == DOCUMENTS else None for plan in ctx.masks.plans.values()}
    if None in masks or len(masks) != 1:
        read = sorted({plan.describe() for plan in ctx.masks.plans.values()})
        raise NotSupportedError(
            "layout='documents' balances packed documents: every attention must mask them, read from one ids value "
            "(position_ids that restart at each document, cu_seqlens, or document ids compared in the mask); this "
            f"graph's attentions mask {'; '.join(read)}. Use layout='zigzag' (or 'auto')."
        )
    unsupported = {  # (the options' other conflicts are refused with the options)
        "inputs='full' (each rank passes the whole batch)": ctx.per_rank,
        "no other sequence mixer (a convolution or scan needs equal chunks)": bool(ctx.mixers),
        "no ringpass.ShardedCache (its slots follow zigzag or contiguous)": any(
            node.target in PROMPT_SLOTS for node in ctx.gm.graph.nodes
        ),
    }
    missing = [need for need, failed in unsupported.items() if failed]
    if missing:
        raise NotSupportedError(
            f"layout='documents' is not built for this graph yet: it needs {', '.join(missing)}. Use "
            "layout='zigzag' (exact on packed rows, balanced as one triangle)."
        )
    return masks.pop()
