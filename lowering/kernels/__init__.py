"""The block-compute contract: what the ring calls once per planned task.

    out, lse = block_attention(q, k, v, q_pos, kv_pos, scale=s, is_causal=c, window=w, mask=m)
    dq, dk, dv = block_attention_backward(dout, q, k, v, out, lse, q_pos, kv_pos, scale=s, is_causal=c, window=w, mask=m)

q ``[B, Hq, n, D]``, k/v ``[B, Hkv, m, D]`` (query head h reads KV head ``h // (Hq // Hkv)``), q_pos
``[n]`` and kv_pos ``[m]`` int64 global positions. ``is_causal``: key visible iff ``kv_pos <= q_pos``;
``window=W`` additionally needs ``q_pos - kv_pos < W``; ``mask``: bool ``[B or 1, Hq or 1, n, m]``
(True = visible), combined with the others. ``scale`` defaults to ``1/sqrt(D)``.
``out``, ``lse`` ``[B, Hq, n]`` and the gradients come back in the accumulation dtype (fp32; fp64 for
fp64 inputs), so the ring merges and accumulates partial results without rounding them to half
precision first; a row with no visible key gives out 0 and lse -inf. The backward takes the *final*
(merged) out and lse of the whole ring, so the block's gradients are its exact share of the
full-sequence gradients; ``dlse`` is the gradient flowing into the LSE, if any (it takes the math path,
which materialises the block's scores). dk/dv come back with Hkv heads.

Today there is one implementation, plain torch (`torch_attention`); the Triton kernels plug in here.
"""

from __future__ import annotations

from lowering import events
from lowering.kernels import torch_attention
from lowering.kernels.torch_attention import accumulation_dtype

__all__ = ["block_attention", "block_attention_backward", "accumulation_dtype"]


def block_attention(q, k, v, q_pos, kv_pos, *, scale=None, is_causal: bool = False, window=None, mask=None):
    if events.recording():
        events.emit("block_forward", q_pos=q_pos, kv_pos=kv_pos, causal=is_causal, masked=mask is not None)
    return torch_attention.forward(
        q, k, v, q_pos, kv_pos, scale=_scale(q, scale), is_causal=is_causal, window=window, mask=mask
    )


def block_attention_backward(
    dout, q, k, v, out, lse, q_pos, kv_pos, *, scale=None, is_causal: bool = False, window=None, mask=None, dlse=None
):
    if events.recording():
        events.emit("block_backward", q_pos=q_pos, kv_pos=kv_pos, causal=is_causal, masked=mask is not None)
    return torch_attention.backward(
        dout, q, k, v, out, lse, q_pos, kv_pos, scale=_scale(q, scale), is_causal=is_causal, window=window,
        mask=mask, dlse=dlse,
    )


def _scale(q, scale):
    return q.size(-1) ** -0.5 if scale is None else float(scale)
