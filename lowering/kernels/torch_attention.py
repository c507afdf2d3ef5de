"""Block attention in plain torch: aten's fused CPU flash attention where it applies, math elsewhere.

The fused CPU kernel returns the log-sum-exp the ring needs and handles GQA without repeating K/V; it
applies when the block is fully visible, or causal with identical, increasing query and key positions
(then the positional mask is the ordinary top-left causal mask; a causal square of a few hundred rows runs as its
halves and the rectangle between them, which the kernel computes faster: `CAUSAL_LEAF`). Everything else (other
devices, any other positional mask, a window, a dense mask, score modifiers (`lowering.scores`), a gradient flowing
into the LSE) takes the math path,
which materialises the block's score matrix. Both compute in the accumulation dtype (fp32; fp64 for fp64
inputs; half-precision inputs are widened first) and return their results in it, so the ring merges unrounded
partial results.
"""

from __future__ import annotations

import torch

from lowering.masks import aligned

_fused = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_fused_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
# The fused CPU kernel scores a causal square of a few hundred rows faster as its two halves and the full rectangle
# between them (12-26 % for 256-1024 rows, forward and backward; docs/performance.md, "Causal squares on the CPU"):
# squares of at least twice CAUSAL_LEAF rows and fewer than CAUSAL_SPLIT_BELOW are split so, recursively (from 2048
# rows, where the ring's diagonal calls start, splitting gains nothing).
CAUSAL_LEAF = 128
CAUSAL_SPLIT_BELOW = 2048


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 for fp64 inputs, fp32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def forward(
    q,
    k,
    v,
    q_pos,
    kv_pos,
    *,
    scale: float,
    is_causal: bool,
    window=None,
    mask=None,
    softcap=None,
    alibi_slopes=None,
    bias=None,
):
    acc = accumulation_dtype(q.dtype)
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    if _fused_applies(q, q_pos, kv_pos, is_causal, window, mask, softcap, alibi_slopes, bias):
        return _fused_forward(q, k, v, is_causal, scale)
    scores, _ = _scores(q, k, q_pos, kv_pos, scale, softcap, alibi_slopes, bias)
    probs, lse = _probabilities(scores, visible_pairs(q_pos, kv_pos, is_causal, window, mask, q.device))
    return probs @ _repeat_heads(v, q.size(1)), lse


def backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    q_pos,
    kv_pos,
    *,
    scale: float,
    is_causal: bool,
    window=None,
    mask=None,
    softcap=None,
    alibi_slopes=None,
    bias=None,
    dlse=None,
    score_grads: bool = False,
):
    """(dq, dk, dv), and with ``score_grads`` the gradient with respect to the modified scores (a bias's)."""
    acc = accumulation_dtype(q.dtype)
    dout, q, k, v, out, lse = (t.to(acc) for t in (dout, q, k, v, out, lse))
    if _fused_applies(
        q, q_pos, kv_pos, is_causal, window, mask, softcap, alibi_slopes, bias, dlse, score_grads or None
    ):
        return _fused_backward_split(dout, q, k, v, out, lse, is_causal, scale)
    scores, capped = _scores(q, k, q_pos, kv_pos, scale, softcap, alibi_slopes, bias)
    probs, _ = _probabilities(scores, visible_pairs(q_pos, kv_pos, is_causal, window, mask, q.device), lse=lse)
    k_rep, v_rep = _repeat_heads(k, q.size(1)), _repeat_heads(v, q.size(1))
    delta = (dout * out).sum(-1)
    if dlse is not None:
        delta = delta - dlse.to(acc)
    dv = probs.mT @ dout
    biased = probs * (dout @ v_rep.mT - delta.unsqueeze(-1))  # with respect to the modified scores
    dscores = biased
    if softcap is not None:  # d/dx c·tanh(x/c) = 1 - tanh(x/c)^2
        dscores = dscores * (1 - (capped / softcap) ** 2)
    dq = (dscores @ k_rep) * scale
    dk = (dscores.mT @ q) * scale
    grads = dq, _sum_head_groups(dk, k.size(1)), _sum_head_groups(dv, v.size(1))
    return (*grads, biased) if score_grads else grads


def merge(out_acc, lse_acc, out_block, lse_block) -> None:
    """Fold a block's partial result into running accumulators, in place, exactly:
    lse = log(e^lse_acc + e^lse_block), out = (e^lse_acc out_acc + e^lse_block out_block) / e^lse.
    Rows that have seen no visible key keep out 0 and lse -inf (never NaN). ``out_block`` is consumed: it
    is scaled in place when it already has the accumulator's dtype (no temporary the size of the output)."""
    lse_new = torch.logaddexp(lse_acc, lse_block.to(lse_acc.dtype))
    shift = lse_new.masked_fill(torch.isneginf(lse_new), 0.0)
    out_acc.mul_(torch.exp(lse_acc - shift).unsqueeze(-1))
    block = out_block.to(out_acc.dtype)
    out_acc.add_(block.mul_(torch.exp(lse_block.to(lse_acc.dtype) - shift).unsqueeze(-1)))
    lse_acc.copy_(lse_new)


def _fused_forward(q, k, v, is_causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) by the fused kernel; a causal square of ``2 * CAUSAL_LEAF`` to ``CAUSAL_SPLIT_BELOW`` rows as its
    halves (each split again) and the rectangle of the second half's queries over the first half's keys, merged."""
    n = q.size(2)
    if not _splits(n, is_causal):
        out, lse = _fused(q, k, v, 0.0, is_causal, scale=scale)[:2]
        return out, lse
    first, second = _halves(n)
    out_first, lse_first = _fused_forward(q[:, :, first], k[:, :, first], v[:, :, first], True, scale)
    out_second, lse_second = _fused_forward(q[:, :, second], k[:, :, second], v[:, :, second], True, scale)
    merge(out_second, lse_second, *_fused(q[:, :, second], k[:, :, first], v[:, :, first], 0.0, False, scale=scale)[:2])
    return torch.cat((out_first, out_second), 2), torch.cat((lse_first, lse_second), 2)


def _fused_backward_split(dout, q, k, v, out, lse, is_causal: bool, scale: float) -> tuple:
    """(dq, dk, dv) by the fused kernel, a causal square split as `_fused_forward` splits it (each part's gradients
    against the whole square's out and lse: its exact share)."""
    n = q.size(2)
    if not _splits(n, is_causal):
        return tuple(_fused_backward(dout, q, k, v, out, lse, 0.0, is_causal, scale=scale)[:3])
    first, second = _halves(n)

    def grads(rows: slice, keys: slice, causal: bool) -> tuple:
        query_side = (t[:, :, rows] for t in (dout, q))
        return _fused_backward_split(
            *query_side, k[:, :, keys], v[:, :, keys], out[:, :, rows], lse[:, :, rows], causal, scale
        )

    dq_first, dk_first, dv_first = grads(first, first, True)
    dq_second, dk_second, dv_second = grads(second, second, True)
    dq_below, dk_below, dv_below = grads(second, first, False)
    return (
        torch.cat((dq_first, dq_second.add_(dq_below)), 2),
        torch.cat((dk_first.add_(dk_below), dk_second), 2),
        torch.cat((dv_first.add_(dv_below), dv_second), 2),
    )


def _splits(n: int, is_causal: bool) -> bool:
    """A causal square of ``n`` rows runs as its halves and the rectangle between them (`CAUSAL_LEAF`)."""
    return is_causal and 2 * CAUSAL_LEAF <= n < CAUSAL_SPLIT_BELOW


def _halves(n: int) -> tuple[slice, slice]:
    return slice(0, n // 2), slice(n // 2, n)


def _fused_applies(q, q_pos, kv_pos, is_causal: bool, *options) -> bool:
    """aten's fused CPU kernel computes this block: on the CPU, no option set beyond a causal flag it can
    express (``options``: window, mask, score modifiers, an LSE gradient)."""
    if q.device.type != "cpu" or any(option is not None for option in options):
        return False
    return not is_causal or aligned(q_pos, kv_pos)


def visible_pairs(q_pos, kv_pos, is_causal: bool, window, mask, device) -> torch.Tensor | None:
    """bool, broadcastable to the scores: which pairs the positions, the window and the mask leave visible
    (None: all of them)."""
    q_pos, kv_pos = q_pos.to(device).unsqueeze(1), kv_pos.to(device).unsqueeze(0)
    visible = None
    if is_causal:
        visible = kv_pos <= q_pos
    if window is not None:
        inside = q_pos - kv_pos < window
        visible = inside if visible is None else visible & inside
    if mask is not None:
        mask = mask.to(device)
        visible = mask if visible is None else visible & mask
    return visible


def _scores(q, k, q_pos, kv_pos, scale, softcap, alibi_slopes, bias):
    """(the block's scores with every score modifier applied, the soft-capped scores before any bias)."""
    scores = (q @ _repeat_heads(k, q.size(1)).mT) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    capped = scores
    if alibi_slopes is not None:
        distance = (kv_pos.to(q.device)[None, :] - q_pos.to(q.device)[:, None]).to(scores.dtype)
        scores = scores + alibi_slopes.to(device=q.device, dtype=scores.dtype)[:, None, None] * distance
    if bias is not None:
        scores = scores + bias.to(device=q.device, dtype=scores.dtype)
    return scores, capped


def _probabilities(scores, visible, lse: torch.Tensor | None = None):
    """Softmax probabilities of the block (rows with no visible key are all zero) and their LSE.
    With ``lse`` given, probabilities are taken against it (the backward pass's global LSE)."""
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    finite_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - finite_lse.unsqueeze(-1))
    probs = torch.where(torch.isneginf(lse).unsqueeze(-1), torch.zeros_like(probs), probs)
    return probs, lse


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    groups = heads // x.size(1)
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _sum_head_groups(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, h, n, d = grad.shape
    return grad.view(b, kv_heads, h // kv_heads, n, d).sum(2)
