"""Find every attention in the graph, by what it computes.

Matches:
- ``F.scaled_dot_product_attention`` in any spelling (positional or keyword arguments, ``scale``,
  ``is_causal``, ``enable_gqa``, ``attn_mask``);
- hand-written attention: ``softmax([c ·] (cap(q @ kᵀ · s) [+ bias] [+ mask | masked_fill(mask, -inf) |
  where(mask, ·, -inf)])) @ v`` with any matmul spelling (``@``, ``torch.matmul``, ``bmm``, an ``einsum`` of
  two operands that is one (``"bhqd,bhkd->bhqk"``), and ``baddbmm(bias, q, kᵀ, alpha=s)``), ``kᵀ`` as
  ``transpose(-2, -1)`` / ``.mT`` / ``permute``, the scale as a multiplication or division (also outside the
  mask, CodeGen's ``(q kᵀ + mask) / s``: it scales everything the softmax sees), an optional logit soft-cap
  ``tanh(x / c) · c``, an optional additive bias (ALiBi, a position bias), further ``masked_fill`` / ``where``
  masks inside the first one (GPT-Neo's causal or banded buffer under its padding mask), fills given as
  numbers or as 0-d constant tensors (``torch.tensor(finfo.min)``), any softmax spelling, a ``nan_to_num(0)``
  of the probabilities (a query with no visible key gives 0, as in the ring), and casts, inert dropouts
  (``p=0`` or eval) and views that merge batch and heads (``[B, H, S, S]`` <-> ``[B·H, S, S]``, BLOOM)
  anywhere around the softmax (Hugging Face's eager attention). Of two additive terms the outer one is the
  mask, the inner one the bias; a single additive term that hides nothing (no booleans, no value at or below -1e4, no
  user input) is a bias; the scores are the side that leads back to ``q @ kᵀ``.
- ``flex_attention`` (the higher-order op Dynamo makes of ``torch.nn.attention.flex_attention``): its
  ``mask_mod`` and ``score_mod`` graphs and their buffers are kept for `lift_masks`; the block mask's
  construction (an ``S x S`` evaluation of ``mask_mod``) only feeds the call and goes with it.
K/V whose heads are repeated for GQA (expand + reshape, ``repeat_interleave``) are taken before the repeat;
K/V whose heads are proven to repeat in groups after further per-head-uniform ops (Falcon's
``broadcast_to`` before the rotary embedding, `head_groups`) keep ``kv_groups``: the rewrite sends one head
of each group.

Writes ``ctx.attention``: one `AttentionMatch` per attention, its mask and bias (if any) left to
`lift_masks` (or, with fewer queries than keys, to `rewrite_decode_attention`). Refuses dropout inside
attention, PyTorch's fused Transformer fast path, and a graph whose only attention is one it does not
recognise (a softmax whose probabilities multiply values, or whose scores are a product of two activations).
"""

from __future__ import annotations

import math
import operator
from dataclasses import replace

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from lowering import compat
from lowering.masks import MASKED_AT_OR_BELOW
from ringpass.fx.context import PassContext
from ringpass.fx.findings import AttentionMatch, FlexMods
from ringpass.fx.head_groups import repeated_groups
from ringpass.fx.nodes import (
    ancestors,
    describe,
    example_value,
    is_module_state,
    is_vmap_bookkeeping,
    numbers_in,
    refusal,
)
from ringpass.fx.score_terms import peel_scale, peel_softcap, split_sum
from ringpass.fx.spellings import ADD, DIV, FLEX, KEEP_FLOATS, MUL, SDPA, TANH, VIEWS, calls, is_pointwise

SOFTMAX = frozenset({torch.softmax, F.softmax, torch.Tensor.softmax, "softmax"})
MATMUL = frozenset({operator.matmul, torch.matmul, torch.bmm, "matmul", "bmm", "__matmul__"})
TRANSPOSE = frozenset({torch.transpose, "transpose", "mT", "permute"})
DROPOUTS = frozenset({"dropout", F.dropout})
FUSED_LAYERS = frozenset({compat.transformer_encoder_layer_fwd, compat.native_multi_head_attention})
BADDBMM = frozenset({torch.baddbmm, "baddbmm"})
NAN_TO_NUM = frozenset({torch.nan_to_num, "nan_to_num"})
AROUND_PROBABILITIES = KEEP_FLOATS | DROPOUTS  # softmax(scores.float()).to(q.dtype), dropout(p=0)
SCORE_STEPS = KEEP_FLOATS | MUL | DIV | ADD | TANH  # scaling, soft-capping and biases over q @ kᵀ


def find_attention(ctx: PassContext) -> None:
    for node in ctx.gm.graph.nodes:
        if calls(node, FUSED_LAYERS):
            raise refusal(
                f"{describe(node)} is PyTorch's fused Transformer fast path (nn.TransformerEncoderLayer or "
                "nn.MultiheadAttention in eval without gradients): one opaque op the ring cannot open. Turn the fast "
                "path off with torch.backends.mha.set_fastpath_enabled(False).",
                node,
            )
        if node.op == "call_function" and node.target is FLEX:
            ctx.attention.append(_match_flex(ctx.gm, node))
        elif calls(node, SDPA):
            ctx.attention.append(_match_sdpa(ctx.gm, node))
        elif _product(node) is not None:
            match = _match_hand_written(ctx.gm, node)
            if match is not None:
                ctx.attention.append(match)
    if not ctx.attention:
        _refuse_unrecognised_attention(ctx.gm)
    ctx.attention[:] = [_with_kv_groups(match) for match in ctx.attention]


def _with_kv_groups(match: AttentionMatch) -> AttentionMatch:
    """The match with ``kv_groups`` set when its 4-D keys and values repeat their heads in groups."""
    if example_value(match.key).dim() != 4 or match.batch is not None:
        return match
    groups = math.gcd(repeated_groups(match.key, 1), repeated_groups(match.value, 1))
    return replace(match, kv_groups=groups) if groups > 1 else match


def _refuse_unrecognised_attention(gm: fx.GraphModule) -> None:
    """A softmax over the last dim whose probabilities, through shape ops, pointwise ops, masks and dropout,
    multiply another activation (a matmul, ``bmm`` or ``einsum`` in any layout: Funnel's ``bnij,bjnd``), or
    whose scores come from a product of two batched activations (Longformer's banded chunks, copied into a
    new tensor first), is an attention this pass did not recognise: refused, rather than the model running
    unsharded on every rank. A router's softmax (over ``linear`` logits; its probabilities scale expert
    outputs, then meet weights) is not one."""
    activations = _activations(gm.graph)
    for node in gm.graph.nodes:
        value = example_value(node) if calls(node, SOFTMAX) else None
        if value is None or value.dim() < 2 or _softmax_dim(node) not in (-1, value.dim() - 1) or value.shape[-1] == 1:
            continue
        if _weighs_an_activation(node, activations) or (value.dim() >= 3 and _scored_by_two(node, activations)):
            raise refusal(
                f"{describe(node)} is a softmax whose probabilities multiply values: an attention the ring backend "
                "does not recognise, so nothing would be sharded (recognised: a scale, soft-cap tanh(x / c) * c, "
                "a bias and masks over q @ k^T, then softmax @ v); for Hugging Face models try "
                "attn_implementation='sdpa'.",
                node,
            )


PASS_THROUGH = (
    KEEP_FLOATS
    | DROPOUTS
    | VIEWS
    | TRANSPOSE
    | {
        "flatten",
        "unflatten",
        "expand",
        "unsqueeze",
        "squeeze",
        "masked_fill",
        torch.masked_fill,
        torch.where,
        F.pad,
        "__getitem__",
    }
)  # ops between probabilities and the values they weigh that keep the probabilities' meaning
PRODUCTS = MATMUL | BADDBMM | {torch.einsum, torch.functional.einsum}


def _activations(graph: fx.Graph) -> set[fx.Node]:
    """The nodes computed from the user's inputs (not from weights and constants alone)."""
    found: set[fx.Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and not is_module_state(node)) or any(a in found for a in node.all_input_nodes):
            found.add(node)
    return found


def _weighs_an_activation(probs: fx.Node, activations: set, steps: int = 16) -> bool:
    """``probs`` reaches, within ``steps`` ops that keep its values' meaning, a product with an activation."""
    frontier, seen = [probs], {probs}
    for _ in range(steps):
        reached = []
        for node in frontier:
            for user in node.users:
                if user in seen or user.op not in ("call_function", "call_method"):
                    continue
                seen.add(user)
                if calls(user, PRODUCTS):
                    if any(a in activations for a in user.all_input_nodes if a is not node):
                        return True
                elif calls(user, PASS_THROUGH) or user.target is operator.getitem or is_pointwise(user):
                    reached.append(user)
        frontier = reached
    return False


def _scored_by_two(softmax: fx.Node, activations: set) -> bool:
    """The softmax's input is computed from a product of two activations of 3 or more dims (``q @ kᵀ`` in
    some spelling); writes into a tensor (``setitem``) count as computing it."""
    writes: dict[fx.Node, list] = {}
    for node in softmax.graph.nodes:
        if node.target is operator.setitem and isinstance(node.args[0], fx.Node):
            writes.setdefault(node.args[0], []).append(node)
    seen, stack = set(), [softmax.args[0]]
    while stack:
        node = stack.pop()
        if not isinstance(node, fx.Node) or node in seen:
            continue
        seen.add(node)
        if calls(node, PRODUCTS):
            operands = [a for a in node.all_input_nodes if isinstance(example_value(a), torch.Tensor)]
            if len(operands) == 2 and all(example_value(a).dim() >= 3 and a in activations for a in operands):
                return True
        stack += node.all_input_nodes + writes.get(node, [])
    return False


def _match_sdpa(gm: fx.GraphModule, node: fx.Node) -> AttentionMatch:
    args = node.normalized_arguments(gm, normalize_to_only_use_kwargs=True).kwargs
    if isinstance(args.get("dropout_p"), fx.Node):
        raise refusal(
            f"Attention {describe(node)} takes dropout_p from a value computed in the graph or passed to forward; "
            "it must be the number 0 for ring attention: pass 0.0 (or set the model's attention dropout to 0).",
            node,
        )
    if args.get("dropout_p", 0.0):
        raise refusal(
            f"Attention {describe(node)} uses dropout_p={args['dropout_p']}; dropout inside ring attention is "
            "not supported. Set the attention dropout to 0 (e.g. attn_pdrop / attention_dropout in the config).",
            node,
        )
    scale = args.get("scale")
    if isinstance(scale, fx.Node):
        raise refusal(f"Attention {describe(node)} takes its scale from a tensor; pass a Python float.", node)
    q, k = example_value(args["query"]), example_value(args["key"])
    if q.shape[1] != k.shape[1] and not args.get("enable_gqa", False) and k.shape[1] != 1:  # one KV head broadcasts
        raise refusal(
            f"Attention {describe(node)} has {q.shape[1]} query heads and {k.shape[1]} key heads "
            "without enable_gqa=True.",
            node,
        )
    key, value = _unrepeated(args["key"]), _unrepeated(args["value"])
    mask = args.get("attn_mask")
    if mask is not None and not isinstance(mask, fx.Node):
        raise refusal(
            f"Attention {describe(node)} has a constant attn_mask; build it in the model from positions.", node
        )
    kind = "kept" if mask is None or example_value(mask).dtype == torch.bool else "additive"  # SDPA adds float masks
    return AttentionMatch(
        node,
        args["query"],
        key,
        value,
        bool(args.get("is_causal", False)),
        scale,
        "sdpa",
        mask=None if mask is None else (kind, mask),
    )


def _match_flex(gm: fx.GraphModule, node: fx.Node) -> AttentionMatch:
    """A ``flex_attention(q, k, v, score_mod, block_mask, scale, kernel_options, score_buffers, mask_buffers)``
    call; its block mask's construction joins ``internal``."""
    names = (
        "query",
        "key",
        "value",
        "score_mod",
        "block_mask",
        "scale",
        "kernel_options",
        "score_buffers",
        "mask_buffers",
    )
    args = dict(zip(names, node.args), **node.kwargs)
    unused = [u for u in node.users if not (u.target is operator.getitem and u.args[1] in (0, 1))]
    if unused:
        raise refusal(
            f"{describe(unused[0])} reads a result of flex_attention other than its output and LSE; the "
            "ring returns those two.",
            unused[0],
        )
    if not isinstance(args["scale"], (int, float)):
        raise refusal(f"Attention {describe(node)} takes its scale from a tensor; pass a Python float.", node)
    mods = FlexMods(
        getattr(gm, args["block_mask"][-1].target),
        getattr(gm, args["score_mod"].target),
        tuple(args.get("mask_buffers", ())),
        tuple(args.get("score_buffers", ())),
    )
    operands = {args["query"], args["key"], args["value"], *mods.mask_buffers, *mods.score_buffers}
    roots = [a for a in (args["score_mod"], *args["block_mask"]) if isinstance(a, fx.Node) and a.op != "placeholder"]
    return AttentionMatch(
        node,
        args["query"],
        args["key"],
        args["value"],
        False,
        float(args["scale"]),
        "flex_attention",
        tuple(_feeding_only(node, roots, operands)),
        flex=mods,
    )


def _feeding_only(call: fx.Node, roots: list, keep: set) -> set:
    """``roots`` and their ancestors whose every use is by ``call`` or by another of them (``keep`` aside):
    the block mask's construction. A ``setitem`` into one of them is part of it (it writes, nobody reads it),
    and so is vmap's bookkeeping (``torch._functorch.predispatch``) when every vmap of the graph builds it."""
    nodes = [n for n in reversed(list(call.graph.nodes)) if n not in keep and n.op not in ("placeholder", "output")]
    found = set(roots)
    grew = True
    while grew:
        grew = False
        for node in nodes:
            if node in found:
                continue
            writes_into_found = node.target is operator.setitem and node.args[0] in found
            readers = [u for u in node.users if not _only_writes_into(u, node)]
            if writes_into_found or (readers and all(u in found or u is call for u in readers)):
                found.add(node)
                grew = True
    vmaps = [n for n in nodes if is_vmap_bookkeeping(n)]
    if all(n in found for n in vmaps if n.users):
        found |= set(vmaps)
    return found


def _only_writes_into(user: fx.Node, node: fx.Node) -> bool:
    """``user`` is a ``setitem`` into ``node``, or a value used only by such writes (``node.new_ones(())``)."""
    if user.target is operator.setitem and user.args[0] is node:
        return True
    return bool(user.users) and all(u.target is operator.setitem and u.args[0] is node for u in user.users)


def _unrepeated(node: fx.Node) -> fx.Node:
    """K/V before a repeat of their heads (``k[:, :, None].expand(B, Hkv, g, S, D).reshape(B, Hkv*g, S, D)``,
    ``k.repeat_interleave(g, dim=1)``): the ring rotates the Hkv heads and repeats nothing."""
    if calls(node, ("repeat_interleave", torch.repeat_interleave)):
        dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else None)
        return node.args[0] if dim in (1, -3) and isinstance(node.args[0], fx.Node) else node
    if not calls(node, VIEWS) or not isinstance(node.args[0], fx.Node):
        return node
    expanded = node.args[0]
    if not calls(expanded, ("expand",)) or not isinstance(expanded.args[0], fx.Node):
        return node
    unsqueezed = expanded.args[0]
    if (
        calls(unsqueezed, ("unsqueeze", torch.unsqueeze))
        and unsqueezed.args[1] == 2
        or (
            unsqueezed.op == "call_function"
            and unsqueezed.target is operator.getitem
            and _new_axis_at_2(unsqueezed.args[1])
        )
    ):
        source = unsqueezed.args[0]
    else:
        return node
    kv, out = example_value(source), example_value(node)
    if kv.dim() != 4 or out.dim() != 4 or tuple(out.shape[2:]) != tuple(kv.shape[2:]) or out.shape[0] != kv.shape[0]:
        return node
    return source


def _new_axis_at_2(index) -> bool:
    """``[:, :, None]`` or ``[:, :, None, :, :]``: a new axis after the heads, every other dim whole."""
    if not isinstance(index, tuple) or len(index) < 3 or index[2] is not None:
        return False
    return all(isinstance(i, slice) and i == slice(None) for j, i in enumerate(index) if j != 2)


def _match_hand_written(gm: fx.GraphModule, out: fx.Node) -> AttentionMatch | None:
    """``out = probs @ v`` with ``probs = softmax(scores, -1)``; None when ``out`` is another matmul."""
    probs, value, transposed = _product(out)
    if not isinstance(probs, fx.Node) or transposed:
        return None
    internal = [out]
    probs = _peel_value_keeping(probs, internal)  # softmax(..., dtype=float32).to(q.dtype), dropout(p=0), views
    if calls(probs, NAN_TO_NUM) and _zeroes_nan(probs):  # a query with no visible key: NaN made 0, as the ring gives
        internal.append(probs)
        probs = _peel_value_keeping(probs.args[0], internal)
    if not calls(probs, SOFTMAX) or _softmax_dim(probs) not in (-1, example_value(probs).dim() - 1):
        return None
    active = next((n for n in internal if calls(n, DROPOUTS) and _drops(n)), None)
    if active is not None:
        raise refusal(
            f"Attention probabilities go through dropout at {describe(active)}; dropout inside ring "
            "attention is not supported. Set the attention dropout to 0.",
            active,
        )
    internal.append(probs)
    scores = _peel_value_keeping(probs.args[0], internal)  # softmax(scores.float(), -1)
    scores, outer = _peel_outer_scale(scores, internal)  # softmax((q kᵀ + mask) / s): CodeGen
    if outer <= 0:
        return None
    scores, mask, fill = _peel_mask(scores, internal)
    inner_masks = []
    while mask is not None:  # where(buffer, s, min) + padding_mask (GPT-Neo): a filled mask inside the first
        peeled, inner, inner_fill = _peel_mask(scores, internal, filled_only=True)
        if inner is None:
            break
        scores = peeled
        inner_masks.append((inner, inner_fill))
    scores, bias = _peel_bias(scores, internal)
    if bias is None and mask is not None and mask[0] == "additive" and _only_adds(mask[1]):
        bias, mask = mask[1], None  # softmax(q kᵀ s + distance): one additive term that hides nothing
    scores, softcap = peel_softcap(scores, internal)
    scores, scale = peel_scale(scores, internal)
    if calls(scores, BADDBMM):
        product = _baddbmm(scores, bias)
        if product is None:
            return None
        query, key_t, bias, alpha = product
        scale *= alpha
    elif _product(scores) is not None:
        query, key_t, transposed = _product(scores)
        if transposed:  # einsum("...qd,...kd->...qk", q, k): k itself
            key_t, key = None, key_t
    else:
        return None
    internal.append(scores)
    if key_t is not None:
        key = _transposed_last_two(key_t)
        if key is None:
            return None
        internal.append(key_t)
    if any(len(n.users) > 1 and n is not out for n in internal):
        return None  # an intermediate (the scores, the probabilities) is used elsewhere: not a plain attention
    q, p = example_value(query), example_value(probs)
    batch = p.shape[0] if q.dim() == 3 and p.dim() == 4 else None  # BLOOM: [B·H, S, D] against [B, H, S, S]
    softcap = None if softcap is None else softcap * outer  # c · C·tanh(x/C) = (cC)·tanh(c·x / (cC))
    return AttentionMatch(
        out,
        query,
        _unrepeated(key),
        _unrepeated(value),
        False,
        scale * outer,
        "hand-written",
        tuple(internal),
        mask,
        fill,
        softcap,
        bias,
        batch,
        outer_scale=outer,
        inner_masks=tuple(inner_masks),
    )


def _product(node: fx.Node):
    """(a, b, b_transposed) when ``node`` multiplies matrices over its last two dims: ``a @ b`` (False), or an
    ``einsum`` of two operands with shared leading dims that is ``a @ b`` or ``a @ bᵀ`` (True); else None."""
    if calls(node, MATMUL) and len(node.args) == 2:
        return node.args[0], node.args[1], False
    if not (calls(node, (torch.einsum, torch.functional.einsum)) and node.args and isinstance(node.args[0], str)):
        return None
    operands = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
    equation = node.args[0].replace(" ", "")
    if len(operands) != 2 or "->" not in equation or "." in equation or equation.count(",") != 1:
        return None
    (left, right), out = equation.split("->")[0].split(","), equation.split("->")[1]
    if len(left) < 2 or not len(left) == len(right) == len(out) or not left[:-2] == right[:-2] == out[:-2]:
        return None
    i, j = left[-2:]
    if right[-2:] == j + out[-1] and out[-2:] == i + right[-1] and len({i, j, out[-1]}) == 3:
        return operands[0], operands[1], False
    if right[-1] == j and out[-2:] == i + right[-2] and len({i, j, right[-2]}) == 3:
        return operands[0], operands[1], True
    return None


def _peel_value_keeping(node, internal: list):
    """The value under any casts, dropouts and batch-head views around it, which join ``internal`` (a
    dropout that acts is refused by the caller once the value is known to be attention probabilities)."""
    while (
        isinstance(node, fx.Node)
        and (calls(node, AROUND_PROBABILITIES) or _merges_heads(node))
        and isinstance(node.args[0], fx.Node)
    ):
        internal.append(node)
        node = node.args[0]
    return node


def _merges_heads(node: fx.Node) -> bool:
    """A view between ``[B, H, n, m]`` and ``[B·H, n, m]`` (either way): the last two dims kept."""
    if not calls(node, VIEWS) or not isinstance(node.args[0], fx.Node):
        return False
    before, after = example_value(node.args[0]), example_value(node)
    if {before.dim(), after.dim()} != {3, 4} or tuple(before.shape[-2:]) != tuple(after.shape[-2:]):
        return False
    merged, split = (before, after) if before.dim() == 3 else (after, before)
    return statically_known_true(merged.shape[0] == split.shape[0] * split.shape[1])


def _leads_to_product(node, steps: int = 12) -> bool:
    """``node`` is scores: scaling, soft-capping, biases, filled masks, casts and views over ``q @ kᵀ``."""
    if not isinstance(node, fx.Node) or steps == 0:
        return False
    if calls(node, BADDBMM) or _product(node) is not None:
        return True
    if calls(node, ("masked_fill", torch.masked_fill, torch.where)):  # the scores are the filled value
        return _leads_to_product(node.args[1 if calls(node, (torch.where,)) else 0], steps - 1)
    if not (calls(node, SCORE_STEPS) or _merges_heads(node)):
        return False
    return any(_leads_to_product(arg, steps - 1) for arg in node.args if isinstance(arg, fx.Node))


def _drops(dropout: fx.Node) -> bool:
    """A dropout that changes values: ``p > 0`` while training."""
    training = dropout.kwargs.get("training", dropout.args[2] if len(dropout.args) > 2 else True)
    return bool(training and dropout.kwargs.get("p", dropout.args[1] if len(dropout.args) > 1 else 0.5))


def _zeroes_nan(node: fx.Node) -> bool:
    """``nan_to_num`` that turns NaN into 0 (its infinities do not occur in probabilities)."""
    return node.kwargs.get("nan", node.args[1] if len(node.args) > 1 else 0.0) in (0, None)


def _softmax_dim(node: fx.Node):
    if len(node.args) > 1:
        return node.args[1]
    return node.kwargs.get("dim")


def _peel_mask(scores: fx.Node, internal: list, filled_only: bool = False):
    """(scores before masking, the mask as ("masked_out"|"kept"|"additive", node), the fill value of a
    masked_fill / where) or (scores, None, None); ``filled_only``: not an additive mask."""
    if calls(scores, ("masked_fill", torch.masked_fill)):
        fill = _constant_number(scores.args[2])
        if fill is not None and fill <= MASKED_AT_OR_BELOW:
            internal.append(scores)
            return scores.args[0], ("masked_out", scores.args[1]), fill
    if calls(scores, (torch.where,)) and len(scores.args) == 3:
        fill = _constant_number(scores.args[2])
        if fill is not None and fill <= MASKED_AT_OR_BELOW:
            internal.append(scores)
            return scores.args[1], ("kept", scores.args[0]), fill
    terms = None if filled_only else split_sum(scores, _leads_to_product)
    if terms is not None:
        internal.append(scores)
        return terms[0], ("additive", terms[1]), None
    return scores, None, None


def _constant_number(value) -> float | None:
    """A Python number, or the number of a 0-d tensor made from one (``torch.tensor(c, dtype=...)``), else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if (
        isinstance(value, fx.Node)
        and calls(value, (torch.tensor, torch.scalar_tensor))
        and value.args
        and isinstance(value.args[0], (int, float))
        and not isinstance(value.args[0], bool)
    ):
        return float(value.args[0])
    return None


def _peel_bias(scores: fx.Node, internal: list):
    """(scores, the bias) of ``scores + bias`` under the mask, or (scores, None)."""
    while _merges_heads(scores):  # BLOOM views [B·H, S, S] scores as [B, H, S, S] before the mask
        internal.append(scores)
        scores = scores.args[0]
    terms = split_sum(scores, _leads_to_product)
    if terms is None:
        return scores, None
    internal.append(scores)
    return terms


def _only_adds(term: fx.Node) -> bool:
    """An additive term built from positions and module state with no booleans, no hiding values (at or
    below -1e4) and no user input: a bias (an additive term that may hide keys is planned as a mask, whose
    other values the ring adds as a bias anyway)."""
    return not any(_hides_or_is_input(node) for node in ancestors(term))


def _hides_or_is_input(node: fx.Node) -> bool:
    value = example_value(node)
    if isinstance(value, torch.Tensor) and (
        value.dtype == torch.bool or (node.op == "placeholder" and not is_module_state(node))
    ):
        return True
    return any(c <= MASKED_AT_OR_BELOW for c in numbers_in(node))


def _peel_outer_scale(scores: fx.Node, internal: list):
    """(x, c) of ``c · x`` when x is masked scores (a scale outside the mask), else (scores, 1)."""
    peeled = []
    under, outer = peel_scale(scores, peeled)
    if outer == 1.0 or _peel_mask(under, [])[1] is None:
        return scores, 1.0
    internal += peeled
    return under, outer


def _baddbmm(node: fx.Node, bias):
    """(q, kᵀ, the bias, alpha) of ``baddbmm(input, q, kᵀ, beta=1, alpha=s)`` (input: the bias; beta=0
    ignores it), or None when its input would be a second bias or is scaled by another beta."""
    names = ("input", "batch1", "batch2")
    operands = dict(zip(names, node.args), **{n: node.kwargs[n] for n in names if n in node.kwargs})
    beta, alpha = node.kwargs.get("beta", 1.0), node.kwargs.get("alpha", 1.0)
    if not isinstance(alpha, (int, float)) or beta not in (0, 1) or (beta == 1 and bias is not None):
        return None
    return operands["batch1"], operands["batch2"], (operands["input"] if beta == 1 else bias), float(alpha)


def _transposed_last_two(node: fx.Node) -> fx.Node | None:
    if not isinstance(node, fx.Node):
        return None
    rank = example_value(node).dim()
    if node.op == "call_function" and node.target is getattr and node.args[1] == "mT":
        return node.args[0]
    if calls(node, (torch.transpose, "transpose")):
        dims = {d % rank for d in node.args[1:3]}
        return node.args[0] if dims == {rank - 2, rank - 1} else None
    if calls(node, ("permute",)):
        perm = node.args[1] if isinstance(node.args[1], (list, tuple)) else node.args[1:]
        expected = list(range(rank - 2)) + [rank - 1, rank - 2]
        return node.args[0] if [p % rank for p in perm] == expected else None
    return None
