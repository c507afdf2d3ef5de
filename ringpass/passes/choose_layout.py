"""Choose which global positions each rank owns: the layout every later pass and the runtime ask.

Matches the ``layout`` option and the mask plans of `lift_masks`. With ``layout="auto"``: ``zigzag`` (it
balances causal work over the ranks) when an attention is causal or evaluates a mask program (masks read
from data, packed documents or padding, are causal in practice), and always with ``inputs="sharded"`` (the
user shards inputs with `ringpass.shard` without knowing the model); else ``contiguous``. Another value is
taken as it is. Inputs that arrive sequence-sharded (``ctx.carried_inputs``) fix the layout to theirs; a
strategy chosen by `choose_strategy` brings its layout (the one its attentions are predicted fastest in).
``layout="documents"`` (`lowering.DocumentLayout`, planned per call from the documents' lengths) needs every
attention to mask packed documents read from one ids value, and a graph the runtime can run in it (refused
otherwise, saying why); ``layout="auto"`` takes it for such a graph whose outputs leave as `SequenceSharded`
(`_documents_by_default`). A graph whose inputs arrive in it (their ids with them) must mask documents in every
attention too. Writes ``ctx.layout_kind`` (and, for documents, ``ctx.document_ids``: that ids value).
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
        if ctx.carried_layout == DOCUMENTS_KIND:  # (the ids arrive with them: ``ctx.document_ids``)
            _refuse_unless_documents(ctx, _masked_ids(ctx, attentions_needed=False), "its inputs arrive in it")
        return
    if ctx.options.layout == DOCUMENTS_KIND:
        ids = _masked_ids(ctx)
        _refuse_unless_documents(ctx, ids, "layout='documents'")
        ctx.document_ids = ids
    elif ctx.options.layout == "auto" and ctx.strategy is None and _documents_by_default(ctx):
        ctx.document_ids = _masked_ids(ctx)
        ctx.layout_kind = DOCUMENTS_KIND
        return
    if ctx.options.layout != "auto":
        ctx.layout_kind = ctx.options.layout
        return
    ctx.layout_kind = ctx.strategy.layout if ctx.strategy is not None else default_layout(ctx)


def default_layout(ctx: PassContext) -> str:
    """``layout="auto"``'s layout without a cost model and without packed documents: zigzag under any causal or
    masked attention, or sharded inputs; else contiguous."""
    masked = any(plan.is_causal or plan.program_id for plan in ctx.masks.plans.values())
    return "zigzag" if masked or ctx.options.inputs == "sharded" else "contiguous"


def _documents_by_default(ctx: PassContext) -> bool:
    """``layout="auto"`` balances packed documents where the documents layout runs and nobody sees it: every attention
    masks the documents of one ids value, the plain ring over full inputs, outputs that leave as `SequenceSharded`
    (they carry the packing: ``outputs="sharded"`` and ``"gathered"`` keep zigzag, whose shards a user or a converted
    model may reassemble without the ids), and nothing `_unsupported` names."""
    options = ctx.options
    plain_ring = options.inputs == "full" and options.outputs == "auto" and options.cache == "sharded"
    return plain_ring and ctx.ulysses is None and _masked_ids(ctx) is not None and not _unsupported(ctx)


def _masked_ids(ctx: PassContext, attentions_needed: bool = True):
    """The one ids value every attention's documents mask reads, or None (an attention masks something else, or
    two ids values; no attention at all unless ``attentions_needed`` is False: then `NO_ATTENTION`)."""
    masks = {plan.inputs[0] if plan.program_id == DOCUMENTS else None for plan in ctx.masks.plans.values()}
    if not masks:
        return None if attentions_needed else NO_ATTENTION
    return masks.pop() if len(masks) == 1 else None


NO_ATTENTION = object()  # `_masked_ids` of a graph without attention


def _refuse_unless_documents(ctx: PassContext, ids, why: str) -> None:
    """Refuses the documents layout (asked for by ``why``) for a graph that cannot run in it, saying what it lacks."""
    if ids is None:
        read = sorted({plan.describe() for plan in ctx.masks.plans.values()})
        raise NotSupportedError(
            f"The documents layout ({why}) balances packed documents: every attention must mask them, read from one "
            "ids value (position_ids that restart at each document, cu_seqlens, or document ids compared in the "
            f"mask); this graph's attentions mask {'; '.join(read)}. Use layout='zigzag' (or 'auto')."
        )
    missing = _unsupported(ctx)
    if missing:
        raise NotSupportedError(
            f"The documents layout ({why}) is not built for this graph yet: it needs {', '.join(missing)}. Use "
            "layout='zigzag' (exact on packed rows, balanced as one triangle)."
        )


def _unsupported(ctx: PassContext) -> list[str]:
    """What the graph needs for the documents layout and lacks (the options' other conflicts are refused with the
    options)."""
    unsupported = {
        "inputs='full' (each rank passes the whole batch)": ctx.per_rank,
        "no other sequence mixer (a convolution or scan needs equal chunks)": bool(ctx.mixers),
        "no ringpass.ShardedCache (its slots follow zigzag or contiguous)": any(
            node.target in PROMPT_SLOTS for node in ctx.gm.graph.nodes
        ),
    }
    return [need for need, failed in unsupported.items() if failed]
