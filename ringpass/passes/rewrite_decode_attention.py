"""Decode steps: a few new queries against a KV cache, attended where the cache lies instead of by the ring.

Matches a graph whose attentions have fewer queries than keys (`is_decode_step`). Keys and values read
from ``ringpass::whole_cache`` (a `ringpass.ShardedCache`: the cache gathered whole) become
`lowering.sharded_cache.decode_over_slots` on the cache's own slots, slot positions and the model's
boolean mask (read at the slots' positions): every rank attends with the same queries to its slots and
the ranks merge out and LSE in one all-gather; the whole cache is never gathered. The rest of the graph
(the new tokens only) runs replicated on every rank, so the logits are the same on every rank. The slot
tensors are this rank's own graph inputs (``ctx.rank_own_inputs``: the guard does not compare them).
With ``cache="gathered"`` an attention over a cache held whole on every rank stays as it is (replicated).

Refuses: such an attention with ``cache="sharded"`` (a DynamicCache), a graph that mixes decode steps with
attention of a query against its own keys, ``is_causal=True`` or score modifiers against the cache, float
(additive) masks, and keys and values that are not the same layer's slots.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from lowering.kernels import accumulation_dtype
from lowering.sharded_cache import decode_over_slots
from ringpass.fx.context import PassContext
from ringpass.fx.nodes import copy_origin, describe, example_value, plain, refusal, remove_dead_code, short_source
from ringpass.fx.report import CollectiveRecord
from ringpass.fx.spellings import KEEP_FLOATS

WHOLE_CACHE = (torch.ops.ringpass.whole_cache, torch.ops.ringpass.whole_cache.default)


def is_decode_step(match) -> bool:
    """Fewer queries than keys, or keys read from a sharded cache."""
    q, k = example_value(match.query), example_value(match.key)
    return _cache_read(match.key) is not None or q.shape[-2] != k.shape[-2]


def rewrite_decode_attention(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    for match in ctx.attention:
        if not is_decode_step(match):
            raise refusal(
                f"Attention {describe(match.output)} attends a query to its own keys in a graph whose other "
                "attentions are decode steps against a KV cache (a chunk of a prompt after a cache was "
                "filled?): ringpass shards either a whole prompt or decode steps, one per graph.",
                match.output,
            )
        keys, values = _cache_read(match.key), _cache_read(match.value)
        if keys is None or values is None:
            if ctx.options.cache == "gathered":
                ctx.report.cache = "decode steps against a cache held whole on every rank (cache='gathered'): unsharded"
                continue
            q, k = example_value(match.query), example_value(match.key)
            raise refusal(
                f"Attention {describe(match.output)} has {q.shape[-2]} queries but {k.shape[-2]} keys: a decode step "
                "against a KV cache held whole on every rank (a DynamicCache), or cross-attention. To keep the "
                "cache sharded, pass past_key_values=ringpass.ShardedCache(model.config, max_new_tokens=...) to "
                "generate (or call ringpass.generate); options={'cache': 'gathered'} runs such steps unsharded on "
                "every rank; for training compile with use_cache=False.",
                match.output,
            )
        _check(match, keys, values)
        visible = match.mask[1] if match.mask is not None else None
        with graph.inserting_before(match.output):
            if match.mask is not None and match.mask[0] == "masked_out":
                visible = graph.call_function(operator.invert, (visible,))
            out = graph.call_function(
                decode_over_slots,
                (match.query, keys.args[0], values.args[0], keys.args[1], visible, match.scale, ctx.group_name),
            )
        copy_origin(out, match.output)
        out.meta["example_value"] = example_value(match.output)
        match.output.replace_all_uses_with(out)
        graph.erase_node(match.output)
        ctx.rank_own_inputs.update(n for n in (*keys.args[:2], values.args[0]) if n.op == "placeholder")
        _record(ctx, match, keys)
    remove_dead_code(graph)  # the whole-cache reads and the rest of hand-written attentions


def _cache_read(node: fx.Node):
    """The ``whole_cache`` call ``node`` is (through casts), else None."""
    while node.op == "call_method" and node.target in KEEP_FLOATS:
        node = node.args[0]
    return node if node.op == "call_function" and node.target in WHOLE_CACHE else None


def _check(match, keys: fx.Node, values: fx.Node) -> None:
    where = f"Attention {describe(match.output)} against the sharded KV cache"
    if keys.args[1] is not values.args[1]:
        raise refusal(f"{where} reads keys and values of different cache layers.", match.output)
    if match.is_causal:
        raise refusal(
            f"{where} has is_causal=True, which for fewer queries than keys hides the latest keys "
            "(top-left alignment); build the mask from positions instead.",
            match.output,
        )
    if match.softcap is not None or match.bias is not None or match.outer_scale != 1.0 or match.inner_masks:
        raise refusal(
            f"{where} modifies its scores (soft-cap, bias, nested masks): decode steps against a sharded "
            "cache do not support that yet.",
            match.output,
        )
    if example_value(match.query).dim() != 4:
        raise refusal(f"{where} is not 4-D [batch, heads, tokens, head_dim].", match.output)
    if match.mask is not None and (match.mask[0] == "additive" or example_value(match.mask[1]).dtype != torch.bool):
        raise refusal(
            f"{where} adds a float mask; decode steps read boolean masks (Hugging Face's "
            "attn_implementation='sdpa' gives them).",
            match.output,
        )


def _record(ctx: PassContext, match, keys: fx.Node) -> None:
    q = example_value(match.query)
    numbers = plain(q.shape[0]) * plain(q.shape[1]) * plain(q.shape[2]) * (plain(q.shape[3]) + 1)
    itemsize = torch.empty((), dtype=accumulation_dtype(q.dtype)).element_size()
    ctx.report.decode += 1
    ctx.report.cache = f"sharded: {plain(example_value(keys.args[0]).shape[2])} slots per rank per layer"
    ctx.report.collectives.append(
        CollectiveRecord(
            "all-gather", "forward", "decode attention's out and LSE", short_source(match.output), numbers * itemsize
        )
    )
