"""The prefill's KV cache stays on the ranks that hold its tokens.

Matches ``ringpass::prompt_slots`` calls (the prefill of a `ringpass.ShardedCache`) whose keys and values
are this rank's tokens. Writes the call's ``sharded=True`` and the ring's layout, so every rank keeps the
slots of its own tokens and nothing is gathered; records the slots per rank in the report. Keys and values
kept whole on every rank stay as they are (the call takes this rank's shard of them). Refuses
``cache="gathered"`` (a ShardedCache is the sharded cache: gather with a DynamicCache) and
``inputs="sharded"`` (the cache counts the positions of the whole prompt it was given).
"""

from __future__ import annotations

from ringpass.fx.context import LOCAL, PassContext
from ringpass.fx.nodes import describe, example_value, nbytes, plain, refusal
from ringpass.fx.spellings import PROMPT_SLOTS


def keep_cache_sharded(ctx: PassContext) -> None:
    layers = slot_bytes = 0
    for node in ctx.gm.graph.nodes:
        if node.target not in PROMPT_SLOTS:
            continue
        k, v, capacity, prompt_len, _, _, group_name = node.args
        if ctx.options.cache == "gathered":
            raise refusal(
                f"{describe(node)}: the model's cache is a ringpass.ShardedCache, which keeps the cache "
                "sharded, but the backend has cache='gathered'; drop the option or pass a DynamicCache.",
                node,
            )
        if ctx.options.inputs == "sharded":
            raise refusal(
                f"{describe(node)}: a ringpass.ShardedCache takes the whole prompt (inputs='full'); with "
                "inputs='sharded' it would count only this rank's tokens.",
                node,
            )
        if ctx.placement.get(k) == LOCAL and ctx.placement.get(v) == LOCAL:
            node.args = (k, v, capacity, prompt_len, ctx.layout_kind, True, group_name)
        k_slots, v_slots, _ = example_value(node)
        layers, slots = layers + 1, plain(k_slots.shape[2])
        slot_bytes += nbytes(k_slots) + nbytes(v_slots)
    if layers:
        ctx.report.cache = (
            f"kept sharded: {layers} layer(s) of {slots} slots per rank "
            f"({slot_bytes} bytes of keys and values per rank)"
        )
