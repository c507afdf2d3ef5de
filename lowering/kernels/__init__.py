"""The block-compute contract: what the ring calls once per planned tile.

    out, lse = block_attention(q, k, v, q_pos, kv_pos, scale=s, is_causal=c, window=w, mask=m)
    block_attention_merge_(q, k, v, q_pos, kv_pos, out_acc, lse_acc, scale=s, ...)      # in place
    dq, dk, dv = block_attention_backward(dout, q, k, v, out, lse, q_pos, kv_pos, scale=s, ...)
    dq, dk, dv, ds = block_attention_backward(..., score_grads=True)      # ds: d loss / d scores (a bias's)

q ``[B, Hq, n, D]``, k/v ``[B, Hkv, m, D]`` (query head h reads KV head ``h // (Hq // Hkv)``; K/V are
never repeated in memory), q_pos ``[n]`` and kv_pos ``[m]`` int64 global positions. ``is_causal``: key
visible iff ``kv_pos <= q_pos``; ``window=W`` additionally needs ``q_pos - kv_pos < W``; ``mask``: bool
``[B or 1, Hq or 1, n, m]`` (True = visible), combined with the others; ``seq_bound``: keys at positions
``>= seq_bound`` are padding and never visible (an argument, not a sentinel). ``scale`` defaults to
``1/sqrt(D)``. A row with no visible key gives out 0 and lse -inf. Score modifiers (`lowering.scores`):
``softcap=c`` (scores ``c·tanh(s/c)``), ``alibi_slopes`` (float ``[Hq]``: adds ``slope·(kv_pos − q_pos)``),
``bias`` (float, broadcast to ``[B, Hq, n, m]``, added after the soft-cap).

Results come back in the accumulation dtype (fp32; fp64 for fp64 inputs), out as well as lse and the
gradients: the ring merges and accumulates partial results without rounding them to half precision
(rounding each block's out to bf16 before the merge measurably breaks the "within 2x of unsharded
bf16" bound); cast the final merged out to the input dtype once. ``block_attention_merge_`` folds the
block into running (out, lse) accumulators in place (inside the Triton kernel, so the ring needs no
merge pass). The backward takes the *final* (merged) out and lse, so the block's gradients are its
exact share of the full-sequence gradients; ``dlse`` is the gradient flowing into the LSE, if any. With
``score_grads=True`` it also returns ``ds`` ``[B, Hq, n, m]``: the gradient with respect to the modified
scores (after the soft-cap, ALiBi and bias), which is a score bias's gradient; 0 at hidden pairs.

``backend``: ``"auto"`` = Triton on CUDA (fp16/bf16/fp32), torch otherwise; ``"triton"`` forces Triton
(on CPU only under ``TRITON_INTERPRET=1``); ``"torch"`` forces `torch_attention`.
"""

from __future__ import annotations

import torch

from lowering import events
from lowering.errors import InvalidInputError, NotSupportedError
from lowering.kernels import torch_attention
from lowering.kernels.torch_attention import accumulation_dtype, merge
from lowering.scores import check_score_options

__all__ = [
    "block_attention",
    "block_attention_backward",
    "block_attention_merge_",
    "accumulation_dtype",
    "merge",
    "kernel_applies_window",
]

BACKENDS = ("auto", "triton", "torch")
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def block_attention(
    q,
    k,
    v,
    q_pos,
    kv_pos,
    *,
    scale=None,
    is_causal: bool = False,
    window=None,
    mask=None,
    seq_bound=None,
    softcap=None,
    alibi_slopes=None,
    bias=None,
    backend: str = "auto",
):
    impl = _implementation(q, backend)
    _record("block_forward", q_pos, kv_pos, is_causal, mask)
    options = _options(impl, q, k, kv_pos, scale, is_causal, window, mask, seq_bound, softcap, alibi_slopes, bias)
    return impl.forward(q, k, v, q_pos, kv_pos, **options)


def block_attention_merge_(
    q,
    k,
    v,
    q_pos,
    kv_pos,
    out,
    lse,
    *,
    scale=None,
    is_causal: bool = False,
    window=None,
    mask=None,
    seq_bound=None,
    softcap=None,
    alibi_slopes=None,
    bias=None,
    backend: str = "auto",
) -> None:
    """Fold this block's attention into running accumulators ``out [B, Hq, n, D]`` and ``lse [B, Hq, n]``
    (accumulation dtype), in place, by the log-sum-exp identity."""
    impl = _implementation(q, backend)
    _record("block_forward", q_pos, kv_pos, is_causal, mask)
    options = _options(impl, q, k, kv_pos, scale, is_causal, window, mask, seq_bound, softcap, alibi_slopes, bias)
    if impl is not torch_attention and out.dtype == torch.float32:
        impl.forward(q, k, v, q_pos, kv_pos, **options, out=out, lse=lse)
    else:
        merge(out, lse, *impl.forward(q, k, v, q_pos, kv_pos, **options))


def block_attention_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    q_pos,
    kv_pos,
    *,
    scale=None,
    is_causal: bool = False,
    window=None,
    mask=None,
    seq_bound=None,
    softcap=None,
    alibi_slopes=None,
    bias=None,
    dlse=None,
    score_grads: bool = False,
    backend: str = "auto",
):
    impl = _implementation(q, backend)
    _record("block_backward", q_pos, kv_pos, is_causal, mask)
    options = _options(impl, q, k, kv_pos, scale, is_causal, window, mask, seq_bound, softcap, alibi_slopes, bias)
    return impl.backward(dout, q, k, v, out, lse, q_pos, kv_pos, dlse=dlse, score_grads=score_grads, **options)


def kernel_applies_window(q, backend: str = "auto") -> bool:
    """The kernel that runs on ``q`` evaluates a sliding window itself (Triton does; the torch path takes
    the window as tiles' masks)."""
    return _implementation(q, backend) is not torch_attention


def _implementation(q, backend: str):
    if backend not in BACKENDS:
        raise InvalidInputError(f"backend={backend!r}: choose one of {', '.join(map(repr, BACKENDS))}.")
    if backend == "torch" or (backend == "auto" and not (q.is_cuda and q.dtype in TRITON_DTYPES)):
        return torch_attention
    if q.dtype not in TRITON_DTYPES:
        raise InvalidInputError(
            f"The Triton kernels take float16, bfloat16 or float32, not {q.dtype}; use backend='torch'."
        )
    try:
        from lowering.kernels import triton_attention
    except ImportError as error:
        raise NotSupportedError(
            f"backend='triton' needs Triton ({error}); install it or use backend='torch'."
        ) from None
    if not q.is_cuda and not triton_attention.INTERPRETED:
        raise InvalidInputError(
            "backend='triton' on CPU runs only in Triton's interpreter: set TRITON_INTERPRET=1 before "
            "lowering.kernels.triton_attention is first imported."
        )
    return triton_attention


def _options(impl, q, k, kv_pos, scale, is_causal, window, mask, seq_bound, softcap, alibi_slopes, bias) -> dict:
    if window is not None and (not isinstance(window, int) or window < 1):
        raise InvalidInputError(f"window={window!r}: a sliding window is a whole number of keys, at least 1.")
    if seq_bound is not None and not isinstance(seq_bound, int):
        raise InvalidInputError(f"seq_bound={seq_bound!r}: the sequence length bound must be an int.")
    if mask is not None and mask.dtype != torch.bool:
        raise InvalidInputError(f"mask has dtype {mask.dtype}; block masks are bool (True = visible).")
    check_score_options(softcap, None)
    if alibi_slopes is not None and (not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.shape != (q.size(1),)):
        raise InvalidInputError(
            f"alibi_slopes must be a tensor of one slope per query head ({q.size(1)}), "
            f"got {getattr(alibi_slopes, 'shape', alibi_slopes)!r}."
        )
    if bias is not None and not (isinstance(bias, torch.Tensor) and bias.is_floating_point()):
        raise InvalidInputError("bias must be a float tensor that broadcasts to [B, Hq, n, m].")
    if q.size(1) % k.size(1):
        raise InvalidInputError(
            f"q has {q.size(1)} heads and k/v {k.size(1)}: query heads must be a multiple of key heads."
        )
    if impl is torch_attention and seq_bound is not None:  # the torch path takes padding as part of the mask
        keys = (kv_pos < seq_bound).to(q.device)[None, None, None, :]
        mask, seq_bound = (keys if mask is None else mask.to(q.device) & keys), None
    options = dict(
        scale=q.size(-1) ** -0.5 if scale is None else float(scale),
        is_causal=bool(is_causal),
        window=window,
        mask=mask,
        softcap=None if softcap is None else float(softcap),
        alibi_slopes=alibi_slopes,
        bias=bias,
    )
    return options if impl is torch_attention else {**options, "seq_bound": seq_bound}


def _record(kind, q_pos, kv_pos, is_causal, mask) -> None:
    if events.recording():
        events.emit(kind, q_pos=q_pos, kv_pos=kv_pos, causal=is_causal, masked=mask is not None)
