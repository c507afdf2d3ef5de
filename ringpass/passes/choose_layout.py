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
(`documents_by_default`; under ``strategy="auto"`` it is a candidate of `choose_strategy`'s). A graph whose inputs
arrive in it (their ids with them) runs in it where it can, else it takes them whole (all-gathered at its entry:
`_take_documents_inputs_whole`) and chooses as for whole inputs. Writes ``ctx.layout_kind`` (and, for documents,
``ctx.document_ids``: that ids value).
"""

from __future__ import annotations

from lowering.errors import NotSupportedError
from lowering.layout import DOCUMENTS_KIND
from lowering.masks import DOCUMENTS
from ringpass.fx.context import PassContext
from ringpass.fx.nodes import user_name
from ringpass.fx.spellings import PROMPT_SLOTS


def choose_layout(ctx: PassContext) -> None:
    if ctx.carried_layout == DOCUMENTS_KIND and _documents_lack(ctx, attentions_needed=False):
        _take_documents_inputs_whole(ctx)  # then chosen as for whole inputs
    if ctx.carried_layout:  # the layout the inputs arrived in (the backend checked it against the option)
        ctx.layout_kind = ctx.carried_layout  # (in the documents layout, with their ids: ``ctx.document_ids``)
        return
    if ctx.options.layout == DOCUMENTS_KIND:
        lacks = _documents_lack(ctx)
        if lacks:
            raise NotSupportedError(
                f"layout='documents' is not built for this graph: it needs {', '.join(lacks)}. Use layout='zigzag' "
                "(exact on packed rows, balanced as one triangle)."
            )
        ctx.layout_kind = DOCUMENTS_KIND
    elif ctx.options.layout != "auto":
        ctx.layout_kind = ctx.options.layout
    elif ctx.strategy is not None:  # (the documents layout among its candidates where it runs)
        ctx.layout_kind = ctx.strategy.layout
    else:
        ctx.layout_kind = DOCUMENTS_KIND if documents_by_default(ctx) else default_layout(ctx)
    if ctx.layout_kind == DOCUMENTS_KIND:
        ctx.document_ids = _masked_ids(ctx)


def default_layout(ctx: PassContext) -> str:
    """``layout="auto"``'s layout without a cost model and without packed documents: zigzag under any causal or
    masked attention, or sharded inputs; else contiguous."""
    masked = any(plan.is_causal or plan.program_id for plan in ctx.masks.plans.values())
    return "zigzag" if masked or ctx.options.inputs == "sharded" else "contiguous"


def documents_by_default(ctx: PassContext) -> bool:
    """``layout="auto"`` balances packed documents where the documents layout runs and nobody sees it: every attention
    masks the documents of one ids value, the plain ring over full inputs, outputs that leave as `SequenceSharded`
    (they carry the packing: ``outputs="sharded"`` and ``"gathered"`` keep zigzag, whose shards a user or a converted
    model may reassemble without the ids), and nothing else `_documents_lack` names."""
    options = ctx.options
    plain_ring = options.inputs == "full" and options.outputs == "auto" and options.cache == "sharded"
    return plain_ring and ctx.ulysses is None and not _documents_lack(ctx)


def _masked_ids(ctx: PassContext):
    """The one ids value every attention's documents mask reads, or None (an attention masks something else, or
    two ids values, or there is no attention)."""
    masks = {plan.inputs[0] if plan.program_id == DOCUMENTS else None for plan in ctx.masks.plans.values()}
    return masks.pop() if len(masks) == 1 else None


def _documents_lack(ctx: PassContext, attentions_needed: bool = True) -> list[str]:
    """What the graph needs to run in the documents layout and lacks (nothing: it can; the options' other conflicts
    are refused with the options). A graph without attention needs none with ``attentions_needed=False`` (its
    inputs arrive in the layout, with their ids)."""
    needs = {
        "every attention masking packed documents, read from one ids value (position_ids that restart at each "
        "document, cu_seqlens, or document ids compared in the mask; this graph's attentions mask "
        f"{'; '.join(sorted({plan.describe() for plan in ctx.masks.plans.values()})) or 'nothing'})": (
            _masked_ids(ctx) is None and (attentions_needed or bool(ctx.masks.plans))
        ),
        "no activation from code before it under inputs='per_rank' (sent by tokens as zigzag or contiguous shards "
        "them)": bool(ctx.exchanged_inputs),
        "no other sequence mixer (a convolution or scan needs equal chunks)": bool(ctx.mixers),
        "no ringpass.ShardedCache (its slots follow zigzag or contiguous)": any(
            node.target in PROMPT_SLOTS for node in ctx.gm.graph.nodes
        ),
    }
    return [need for need, lacking in needs.items() if lacking]


def _take_documents_inputs_whole(ctx: PassContext) -> None:
    """Inputs sharded in the documents layout (another graph's outputs) for a graph that cannot run in it: each
    arrives whole instead (`CarriedGraph` all-gathers it: ``ctx.whole_carried``) and is sharded in this graph's own
    layout; the ids' input (`ringpass.frontend.carried`) is dropped. The report says so, with what the graph lacks."""
    names = ", ".join(user_name(node) for node in ctx.carried_inputs)
    ctx.report.notes.append(
        f"input(s) {names} arrive sharded in the documents layout, which this graph cannot run (it needs "
        f"{', '.join(_documents_lack(ctx, attentions_needed=False))}): each is all-gathered at the graph's entry "
        "(the whole sequence on every rank, once) and sharded in this graph's layout"
    )
    ctx.whole_carried = set(ctx.carried_inputs)
    ctx.carried_inputs.clear()
    ctx.carried_layout = ""
    placeholders = [n for n in ctx.gm.graph.nodes if n.op == "placeholder"]
    index = placeholders.index(ctx.document_ids)
    ctx.gm.graph.erase_node(ctx.document_ids)
    ctx.example_inputs = ctx.example_inputs[:index] + ctx.example_inputs[index + 1 :]
    ctx.document_ids = None
