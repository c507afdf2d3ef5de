"""Write ``nn.MultiheadAttention`` out as the projections and the SDPA call it computes.

Matches ``F.multi_head_attention_forward`` (what ``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer`` and
``nn.TransformerDecoderLayer`` call; Dynamo keeps it as one opaque call) on sequence-first ``[L, B, E]``
inputs. Writes, in its place, what it computes: the query / key / value projections (packed ``in_proj_weight``
or separate ``q/k/v_proj_weight``), heads split to ``[B, H, L, E/H]``, its masks as SDPA takes them
(``attn_mask`` 2-D or ``[B·H, L, S]``, bool = hidden or float = added; ``key_padding_mask`` ``[B, S]``;
``is_causal`` is only a hint about ``attn_mask`` and the mask itself is kept), ``F.scaled_dot_product_attention``
with its dropout, the heads merged and the output projection. `find_attention` then finds the SDPA call.

Refused, naming the module's call: ``bias_k`` / ``bias_v``, ``add_zero_attn``, ``static_k`` / ``static_v``,
unbatched inputs, a bool mask combined with a float one, and the averaged attention weights when the model
reads them (``need_weights=True``: they are ``S x S``; pass ``need_weights=False``).
"""

from __future__ import annotations

import inspect
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ringpass.fx.context import PassContext
from ringpass.fx.nodes import copy_origin, describe, example_value, refresh_example_values, refusal

MHA = F.multi_head_attention_forward
SIGNATURE = inspect.signature(MHA)


def expand_multi_head_attention(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    for call in [n for n in graph.nodes if n.op == "call_function" and n.target is MHA]:
        args = SIGNATURE.bind(*call.args, **call.kwargs)
        args.apply_defaults()
        _check(call, args.arguments)
        with graph.inserting_before(call):
            created = _written_out(graph, call, args.arguments)
        out = created[-1]
        for user in list(call.users):
            user.replace_all_uses_with(out)
            graph.erase_node(user)
        graph.erase_node(call)
        refresh_example_values(graph, set(created))


def _check(call: fx.Node, a: dict) -> None:
    unsupported = [name for name in ("bias_k", "bias_v", "static_k", "static_v") if a[name] is not None]
    unsupported += ["add_zero_attn"] if a["add_zero_attn"] else []
    if unsupported:
        raise refusal(
            f"{describe(call)} (nn.MultiheadAttention) uses {', '.join(unsupported)}, which the ring backend "
            "does not write out; build the module without it.",
            call,
        )
    if example_value(a["query"]).dim() != 3:
        raise refusal(f"{describe(call)} (nn.MultiheadAttention) has unbatched inputs; pass a batch dimension.", call)
    masks = [example_value(m).dtype == torch.bool for m in (a["attn_mask"], a["key_padding_mask"]) if m is not None]
    if len(set(masks)) > 1:
        raise refusal(
            f"{describe(call)} (nn.MultiheadAttention) combines a bool mask with a float one; pass both as "
            "bool (True = hidden) or both as float (added to the scores).",
            call,
        )
    weights = [u for u in call.users if not (u.target is operator.getitem and u.args[1] == 0)]
    if weights:
        raise refusal(
            f"{describe(weights[0])} reads the attention weights of {describe(call)} "
            "(nn.MultiheadAttention with need_weights=True): a sequence x sequence tensor, which ring "
            "attention never holds. Call it with need_weights=False.",
            weights[0],
        )


def _written_out(graph: fx.Graph, call: fx.Node, a: dict) -> list[fx.Node]:
    """The new nodes, in order; the last is the attention output ``[L, B, E]``."""
    created: list[fx.Node] = []

    def op(target, *args, method=False, **kwargs):
        node = (graph.call_method if method else graph.call_function)(target, args, kwargs)
        created.append(copy_origin(node, call))
        return node

    _, batch, embed = example_value(a["query"]).shape
    heads = a["num_heads"]
    if a["use_separate_proj_weight"]:
        weights = [a["q_proj_weight"], a["k_proj_weight"], a["v_proj_weight"]]
    else:
        weights = [op(operator.getitem, a["in_proj_weight"], slice(i * embed, (i + 1) * embed)) for i in range(3)]
    biases = (
        [None] * 3
        if a["in_proj_bias"] is None
        else [op(operator.getitem, a["in_proj_bias"], slice(i * embed, (i + 1) * embed)) for i in range(3)]
    )
    q, k, v = (
        op("permute", op("unflatten", op(F.linear, x, w, b), -1, (heads, -1), method=True), 1, 2, 0, 3, method=True)
        for x, w, b in zip((a["query"], a["key"], a["value"]), weights, biases)
    )
    mask = _sdpa_mask(op, a, batch, heads)
    dropout = a["dropout_p"] if a["training"] else 0.0
    y = op(F.scaled_dot_product_attention, q, k, v, attn_mask=mask, dropout_p=dropout)
    merged = op("flatten", op("permute", y, 2, 0, 1, 3, method=True), -2, method=True)  # [L, B, E]
    op(F.linear, merged, a["out_proj_weight"], a["out_proj_bias"])
    return created


def _sdpa_mask(op, a: dict, batch: int, heads: int):
    """``attn_mask`` and ``key_padding_mask`` as one SDPA mask (bool: True = visible; float: added), or None."""
    masks = []
    attn_mask, padding = a["attn_mask"], a["key_padding_mask"]
    given = [m for m in (attn_mask, padding) if m is not None]
    if not given:
        return None
    if attn_mask is not None:
        if example_value(attn_mask).dim() == 3:  # [B·H, L, S]
            attn_mask = op("unflatten", attn_mask, 0, (batch, heads), method=True)
        masks.append(attn_mask)
    if padding is not None:
        masks.append(op(operator.getitem, padding, (slice(None), None, None, slice(None))))
    if example_value(given[0]).dtype == torch.bool:
        hidden = masks[0] if len(masks) == 1 else op(operator.or_, *masks)
        return op(operator.invert, hidden)
    return masks[0] if len(masks) == 1 else op(operator.add, *masks)
