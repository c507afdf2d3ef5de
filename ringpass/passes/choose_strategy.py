"""Choose how each attention runs over the ranks: the strategy the cost model predicts fastest (``strategy="auto"``).

Matches every attention (``ctx.attention``, with its mask plan from `lift_masks`) when ``strategy`` is ``auto`` or
``all-gather``. ``all-gather``: every attention gathers K/V at once. ``auto``: for each attention, among the ring,
Ulysses x ring (each group size U > 1 that divides the ranks and splits the heads; only where the backend can make the
groups: the default process group, no ``ulysses`` option, no sequence-sharded input, not ``inputs="per_rank"``; and
for 4-D attention without flex_attention, ALiBi slopes or a score bias) and the all-gather, in the layout the graph
shards in (zigzag or contiguous, and first the documents layout where ``layout="auto"`` would take it, priced as one
document over the row, its upper bound: `lowering.costmodel.priced_layout`; chosen for the sum over the attentions,
unless the ``layout`` option or the inputs fix it), the one `lowering.costmodel.choose_strategies` predicts fastest on
``ctx.hardware``, forward plus backward when the graph trains (a query needs a gradient). No sequence parallelism
(``none``: the graph runs as captured on every rank) is chosen when running every attention whole is predicted faster
than the best sharded total, and only where that keeps the graph's contract (with dynamic shapes the choice is made at
the traced length and serves every length the graph runs at): ``inputs="full"``, outputs not asked sharded, gradients
not ``local``, nothing crossing the graph's boundaries sharded (inputs, masks).

Writes ``ctx.strategy`` (a `StrategyChoice`, its layout for `choose_layout`; None with ``strategy="ring"``) and
``ctx.ulysses_used`` (the Ulysses group sizes the chosen strategies run in). A ``none`` choice sets
``report.unchanged`` and stops the pipeline (`RunsWhole`): the backend compiles the graph as captured.
"""

from __future__ import annotations

from lowering.costmodel import AttentionShape, Strategy, StrategyChoice, choose_strategies
from lowering.layout import DOCUMENTS_KIND
from ringpass.fx.context import PassContext
from ringpass.fx.nodes import example_value, plain
from ringpass.passes.choose_layout import default_layout, documents_by_default

LAYOUTS = ("zigzag", "contiguous")


class RunsWhole(Exception):
    """``strategy="auto"`` chose no sequence parallelism for this graph: it runs as captured on every rank."""


def choose_strategy(ctx: PassContext) -> None:
    strategy = ctx.options.strategy
    if strategy == "ring":
        return
    seq_len = plain(ctx.sequence.global_seq_len)
    shapes = [_shape(ctx, match) for match in ctx.attention]
    if strategy == "all-gather":
        layout = _layouts(ctx)[0]
        chosen = [Strategy("all-gather", layout)] * len(shapes)
        ctx.strategy = StrategyChoice(layout, chosen, [{} for _ in shapes])
        return
    layouts = _layouts(ctx)
    ulysses = ctx.ulysses_for is not None and not (ctx.ulysses or ctx.carried_inputs or ctx.per_rank)
    if ulysses:  # every rank makes every candidate's groups, in the same order, before any is chosen
        for size in range(2, ctx.world_size + 1):
            if ctx.world_size % size == 0:
                ctx.ulysses_for(size)
    ctx.strategy = choose_strategies(
        shapes,
        seq_len,
        ctx.world_size,
        ctx.hardware,
        layouts=layouts,
        ulysses=[ulysses and _heads_only(ctx, match) for match in ctx.attention],
        none=_may_run_whole(ctx),
        backward=any(getattr(example_value(m.query), "requires_grad", False) for m in ctx.attention),
    )
    if ctx.strategy.unsharded:
        whole = sum(a["none"] for a in ctx.strategy.alternatives)
        sharded = sum(min(t for name, t in a.items() if name != "none") for a in ctx.strategy.alternatives)
        ctx.report.runs_whole = True
        ctx.report.unchanged = (
            f"strategy='auto' chose no sequence parallelism: its {len(shapes)} attention(s) predicted "
            f"{whole * 1e3:.3g} ms whole on each rank against {sharded * 1e3:.3g} ms sharded over {ctx.world_size} "
            f"ranks at {seq_len} tokens"
        )
        raise RunsWhole(ctx.report.unchanged)
    ctx.ulysses_used = sorted({s.ulysses for s in ctx.strategy.chosen if s.kind == "ulysses"})


def strategy_text(strategy: Strategy, alternatives: dict[str, float]) -> str:
    """``"all-gather (zigzag), predicted 1.2 ms; ring (zigzag) 1.3 ms, none 4 ms"``: the choice and the others."""
    if not alternatives:
        return str(strategy)
    others = ", ".join(f"{name} {t * 1e3:.3g} ms" for name, t in sorted(alternatives.items(), key=lambda kv: kv[1]))
    return f"{strategy}, predicted {alternatives[str(strategy)] * 1e3:.3g} ms; {others}"


def strategy_of(ctx: PassContext, index: int) -> Strategy | None:
    """The strategy the ``index``-th attention runs by (None: the ring as the options configure it)."""
    return ctx.strategy.chosen[index] if ctx.strategy is not None else None


def _shape(ctx: PassContext, match) -> AttentionShape:
    q, plan = example_value(match.query), ctx.masks.plans[match.output]
    return AttentionShape(*match.sizes(), plain(q.shape[-1]), q.element_size(), plan.is_causal, plan.window)


def _layouts(ctx: PassContext) -> tuple[str, ...]:
    """The layouts the graph may shard in, the one ``layout="auto"`` prefers first (it wins ties)."""
    if ctx.carried_layout:
        return (ctx.carried_layout,)
    if ctx.options.layout != "auto":
        return (ctx.options.layout,)
    preferred = default_layout(ctx)
    ordered = (preferred, *(name for name in LAYOUTS if name != preferred))
    return (DOCUMENTS_KIND, *ordered) if documents_by_default(ctx) else ordered


def _heads_only(ctx: PassContext, match) -> bool:
    """Ulysses can split the attention's heads: no flex_attention, ALiBi slopes or score bias (what
    `rewrite_attention` refuses under Ulysses), no heads merged with the batch or a single head."""
    plan = ctx.masks.plans[match.output]
    q = example_value(match.query)
    return match.flex is None and plan.slopes is None and not plan.bias_id and q.dim() == 4


def _may_run_whole(ctx: PassContext) -> bool:
    o = ctx.options
    return (
        o.inputs == "full"
        and not ctx.per_rank
        and o.outputs != "sharded"
        and o.grads != "local"
        and not (ctx.carried_inputs or ctx.mask_inputs or ctx.mask_outputs)  # values crossing sharded
    )
