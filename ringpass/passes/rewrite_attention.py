"""Replace every attention with ring attention over this rank's tokens.

Matches ``ctx.attention`` (found by `find_attention`, masks planned by `lift_masks`). Writes a call of
``ringpass::ring_attention`` on the local q, k, v (GQA/MQA keys and values stay at their own head count:
only those heads travel; keys and values whose heads repeat in groups send one head of each) with the layout,
the mask plan (causal flag, window, mask program id and its whole inputs; a documents mask's ids also as their host
copy, made once per call for all attentions), the scale (1/sqrt(head_dim) when
the model gave none) and the process group by name, and removes the SDPA call or the hand-written attention's
nodes. Values with a smaller head dim than the keys (MLA) are padded with zero columns to the key head dim and
the output's extra columns cut off. 3-D single-head attention gains a head axis around the call; 3-D attention
over merged batch and heads (``[B·H, S, D]``, BLOOM) is unflattened to ``[B, H, S, D]`` around it. The score
modifiers (soft-cap, ALiBi slopes, bias program) go with the mask plan. With Ulysses x ring (``ctx.ulysses``,
or the attention's strategy from `choose_strategy`), q, k, v go through ``ringpass::ulysses_heads_to_tokens``
first, the ring runs over the ring group, and its output through ``ringpass::ulysses_tokens_to_heads``
(`lowering.ulysses`); an attention whose strategy is the all-gather calls the op with ``strategy="all-gather"``.
Each attention's `AttentionRecord` goes to the report (with a strategy: the choice, its alternatives and the bytes it
holds, `lowering.costmodel.strategy_memory`).
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from lowering.costmodel import strategy_memory
from lowering.errors import NotSupportedError
from lowering.masks import DOCUMENTS
from lowering.ring_args import RingArgs
from lowering.ulysses import check_heads
from ringpass.fx.context import FULL, LOCAL, PassContext, UlyssesGroups
from ringpass.fx.nodes import (
    copy_origin,
    describe,
    example_value,
    inputs_read,
    module_path,
    placeholders_of,
    plain,
    refusal,
    remove_dead_code,
    source_line,
    user_name,
)
from ringpass.fx.report import AttentionRecord
from ringpass.passes.choose_strategy import strategy_of, strategy_text


def rewrite_attention(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    for index, match in enumerate(ctx.attention):
        strategy = strategy_of(ctx, index)
        ulysses = _ulysses_of(ctx, strategy)
        q = example_value(match.query)
        for role, operand in zip(("query", "key", "value"), (match.query, match.key, match.value)):
            axes = ctx.sequence.axes.get(operand, ())
            if ctx.placement.get(operand) != LOCAL or [a.dim % q.dim() for a in axes] != [q.dim() - 2]:
                raise refusal(
                    f"Attention {describe(match.output)}: its {role} does not carry the sequence on the "
                    "second-to-last axis; ringpass expects q, k, v as [batch, heads, sequence, head_dim].",
                    match.output,
                )
        scale = match.scale if match.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        plan = ctx.masks.plans[match.output]
        with graph.inserting_before(match.output):
            operands = [match.query, match.key, match.value]
            back = ("squeeze", 1) if match.batch is None else ("flatten", 0, 1)
            if q.dim() == 3:
                operands = [graph.call_method(*_to_4d(match, t)) for t in operands]
            if match.kv_groups > 1:  # heads repeated in groups (Falcon): one head of each group travels
                heads = (slice(None), slice(None, None, match.kv_groups))
                operands[1:] = [graph.call_function(operator.getitem, (t, heads)) for t in operands[1:]]
            narrower = example_value(match.key).shape[-1] - example_value(match.value).shape[-1]
            if narrower:  # MLA: values narrower than keys travel padded with zeros to the key head dim
                operands[2] = graph.call_function(torch.nn.functional.pad, (operands[2], (0, narrower)))
            ring_group = ctx.group_name
            if ulysses:
                operands, ring_group = _ulysses_operands(ctx, ulysses, match, plan, operands)
            args = RingArgs(
                ctx.layout_kind,
                ctx.world_size,
                ctx.insert_length("global"),
                plan.is_causal,
                float(scale),
                ring_group,
                ulysses=ulysses.size if ulysses else 1,
                strategy="all-gather" if strategy is not None and strategy.kind == "all-gather" else "ring",
                **_op_args(ctx, plan),
            )
            ring = graph.call_function(torch.ops.ringpass.ring_attention.default, (*operands, *args.op_args()))
            copy_origin(ring, match.output)
            ctx.placement[ring] = LOCAL
            if "recompute" in match.output.meta:  # inside a checkpoint region: never recompute a ring
                ring.meta.update(recompute=CheckpointPolicy.MUST_SAVE, ac_graph_id=match.output.meta.get("ac_graph_id"))
            if match.flex is not None:  # flex returns (out, lse), as the ring op does
                if narrower:
                    raise refusal(
                        f"flex_attention {describe(match.output)} with values narrower than keys is not supported yet.",
                        match.output,
                    )
                match.output.replace_all_uses_with(ring)
            else:
                _replace_output(ctx, ulysses, match, ring, back if q.dim() == 3 else None, narrower)
        graph.erase_node(match.output)
        for node in reversed([n for n in graph.nodes if n in match.internal]):  # flex's block mask: writes too
            if not node.users:
                graph.erase_node(node)
        record = _record(match, plan, scale)
        if strategy is not None:
            record.strategy = strategy_text(strategy, ctx.strategy.alternatives[index])
            seq_len = plain(ctx.sequence.global_seq_len)
            record.working_bytes = strategy_memory(strategy, record.shape(), seq_len, ctx.world_size)
        ctx.report.attention.append(record)
        ctx.report.ulysses = ctx.ulysses.size if ctx.ulysses else 1
    remove_dead_code(graph)  # the rest of hand-written attentions


def _op_args(ctx: PassContext, plan) -> dict:
    """The mask plan's ring op arguments; a documents mask's ids with their host copy after them."""
    args = plan.op_args()
    if plan.program_id == DOCUMENTS:
        args["mask_inputs"] = [*args["mask_inputs"], _host_ids(ctx, plan.inputs[0])]
    return args


def _host_ids(ctx: PassContext, ids: fx.Node) -> fx.Node:
    """``ringpass::documents_on_host`` of a documents mask's ids: one copy per call for every attention that reads
    them (the layout's own where it is the same value, `read_document_ids`), so no ring call copies them itself (on
    a GPU, a sync per attention)."""
    copies = [user for user in ids.users if user.target is torch.ops.ringpass.documents_on_host.default]
    if not copies:  # before the first attention that reads them (after whatever gathers them, `insert_boundaries`)
        copies = [ctx.gm.graph.call_function(torch.ops.ringpass.documents_on_host.default, (ids,))]
        ctx.placement[copies[0]] = ctx.placement.get(ids, FULL)
    ctx.masks.whole_values.add(copies[0])  # read whole by the ring, as the ids are
    return copies[0]


def _ulysses_of(ctx: PassContext, strategy) -> UlyssesGroups | None:
    """The Ulysses groups the attention's all-to-alls run in: the ``ulysses`` option's, or its chosen strategy's."""
    if strategy is None:
        return ctx.ulysses
    return ctx.ulysses_for(strategy.ulysses) if strategy.kind == "ulysses" else None


def _replace_output(ctx: PassContext, ulysses: UlyssesGroups | None, match, ring, back, narrower: int) -> None:
    """The attention's output becomes the ring's (``back``: the method and arguments undoing a 3-D
    attention's reshape; ``narrower``: the zero columns padded onto the values, cut off again)."""
    graph = ctx.gm.graph
    out = copy_origin(graph.call_function(operator.getitem, (ring, 0)), match.output)
    out.meta.update({key: ring.meta[key] for key in ("recompute", "ac_graph_id") if key in ring.meta})
    if ulysses:  # the output goes back to the ranks that hold its tokens, with every head
        ctx.placement[out] = LOCAL
        out = copy_origin(
            graph.call_function(
                torch.ops.ringpass.ulysses_tokens_to_heads.default, (out, *_ulysses_args(ctx, ulysses))
            ),
            match.output,
        )
    if narrower:
        out = graph.call_function(operator.getitem, (out, (Ellipsis, slice(None, -narrower))))
    if back is not None:
        out = graph.call_method(back[0], (out, *back[1:]))
    out.meta["example_value"] = example_value(match.output)  # later passes (gathering outputs) read it
    ctx.placement[out] = LOCAL
    ctx.sequence.axes[out] = ctx.sequence.axes[match.output]
    match.output.replace_all_uses_with(out)


def _ulysses_args(ctx: PassContext, ulysses: UlyssesGroups) -> tuple:
    u, ulysses_group, ring_group = ulysses
    return (ctx.layout_kind, ctx.world_size, ctx.insert_length("global"), u, ulysses_group, ring_group)


def _ulysses_operands(ctx: PassContext, ulysses: UlyssesGroups, match, plan, operands: list) -> tuple[list, str]:
    """Ulysses x ring: q, k, v trade heads for the Ulysses group's tokens (KV heads repeated first when there are
    fewer than U); the ring runs across the groups. Returns the new operands and the ring's group name."""
    graph = ctx.gm.graph
    if match.flex is not None or plan.slopes is not None or plan.bias_id:
        what = "flex_attention" if match.flex is not None else "ALiBi slopes or a score bias"
        raise refusal(
            f"Attention {describe(match.output)}: {what} with Ulysses x ring is not supported yet (the heads "
            "are split across the Ulysses group); use a plain ring (ulysses=1).",
            match.output,
        )
    heads = [example_value(t).shape[1] if example_value(t).dim() == 4 else 1 for t in (match.query, match.key)]
    kv_heads = heads[1] // match.kv_groups
    try:
        repeat = check_heads(int(heads[0]), int(kv_heads), ulysses.size)
    except NotSupportedError as error:
        raise refusal(f"Attention {describe(match.output)}: {error}", match.output) from None
    if repeat > 1:
        operands[1:] = [graph.call_method("repeat_interleave", (t, repeat, 1)) for t in operands[1:]]
    exchanged = [
        graph.call_function(torch.ops.ringpass.ulysses_heads_to_tokens.default, (t, *_ulysses_args(ctx, ulysses)))
        for t in operands
    ]
    for node in exchanged + [t for t in operands if t.op == "call_method" and t.target == "repeat_interleave"]:
        copy_origin(node, match.output)
        ctx.placement[node] = LOCAL
    return exchanged, ulysses.ring_group


def _to_4d(match, t: fx.Node) -> tuple:
    """The method call making 3-D ``t`` ``[B, H, S, D]``: merged batch x heads unflattened by its head count (a
    number, also when the batch is symbolic), single-head attention given a head axis."""
    if match.batch is None:
        return "unsqueeze", (t, 1)
    return "unflatten", (t, 0, (-1, int(example_value(t).shape[0] // match.batch)))


def _mask_inputs(plan) -> list[str]:
    """The user inputs the mask and bias programs read, "positions" when they also read values of the
    length alone, and the trainable values they read (a learned bias table), which the ring trains."""
    programs_read = [*plan.inputs, *plan.bias_inputs]
    read = [inputs_read(node) for node in programs_read]
    trained = {
        user_name(p)
        for node in programs_read
        for p in placeholders_of(node)
        if getattr(example_value(p), "requires_grad", False)
    }
    return (
        sorted({name for names in read for name in names})
        + (["positions"] if any(not names for names in read) else [])
        + [f"{name} (trained: its gradient summed per tile)" for name in sorted(trained)]
    )


def _record(match, plan, scale: float) -> AttentionRecord:
    q = example_value(match.query)
    batch, *heads = match.sizes()
    return AttentionRecord(
        module=module_path(match.output),
        source=source_line(match.output),
        spelling=match.spelling,
        mask=plan.describe(),
        is_causal=plan.is_causal,
        window=plan.window,
        mask_inputs=_mask_inputs(plan),
        batch=batch,
        query_heads=heads[0],
        kv_heads=heads[1],
        head_dim=plain(q.shape[-1]),
        dtype=str(q.dtype).replace("torch.", ""),
        itemsize=q.element_size(),
        scale=float(scale),
        score_mods=plan.score_mods(),
        fully_masked=plan.fully_masked,
    )
