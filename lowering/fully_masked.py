"""Query rows whose keys are all hidden: what attention gives there, as the model it replaces does.

A softmax over scores that are all hidden has no single answer; each way of hiding gives its own, and the
ring reproduces the one its model uses (``fully_masked=`` of `lowering.ring_attention`):

- ``"zero"``: out 0, lse -inf. SDPA with a bool mask gives 0 (and a ``-inf`` fill gives NaN in eager).
- ``"uniform"``: the mean of every key's value, over all ``N`` keys of the sequence. Eager attention that
  *adds* a finite mask (``scores + finfo.min``, Hugging Face's eager and SDPA with a float mask) turns every
  score of such a row into the same number, so its softmax is uniform; autograd then differentiates that
  uniform softmax, and the gradient reaches q and k too: ``dv_j += dout / N`` and
  ``ds_j = (dout·v_j - dout·out) / N`` (times the soft-cap's derivative when the scores are capped).
- ``"uniform_values"``: the same mean, its gradient into v only. Eager attention that *replaces* the scores
  with a finite value (``masked_fill``, ``where``) passes them no gradient.

The ring sees a row's keys block by block, and a row is fully masked when its merged lse is still -inf
after the lap. So the forward keeps a running sum of the values it sees (``value_sum``) and rewrites those
rows at the end (`fill_fully_masked_`); the backward finds them once and adds their gradient to each KV block it sees
(`FullyMaskedGrads`), in tiles of at most ``MASK_TILE`` rows and keys, for those rows only. Padding
slots of the layout (positions ``>= seq_len``) are neither averaged nor rewritten.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lowering import masks
from lowering.errors import InvalidInputError

FULLY_MASKED = ("zero", "uniform", "uniform_values")


def check_fully_masked(mode) -> None:
    if mode not in FULLY_MASKED:
        raise InvalidInputError(
            f"fully_masked={mode!r}: choose one of {', '.join(map(repr, FULLY_MASKED))} "
            "(what a query whose keys are all hidden gives)."
        )


def value_sum(v: torch.Tensor, kv_pos: torch.Tensor, seq_len: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, Hkv, D]``: the sum of this block's values over its real keys (not the layout's padding)."""
    real = (kv_pos < seq_len).to(device=v.device, dtype=dtype)
    return (v.to(dtype) * real[:, None]).sum(2)


def fully_masked_rows(lse: torch.Tensor, q_pos: torch.Tensor, seq_len: int) -> torch.Tensor:
    """bool ``[B, Hq, n]``: the real query rows that saw no visible key."""
    return torch.isneginf(lse) & (q_pos < seq_len).to(lse.device)


def fill_fully_masked_(
    out: torch.Tensor, lse: torch.Tensor, values: torch.Tensor, q_pos: torch.Tensor, seq_len: int
) -> None:
    """Give the fully masked rows of ``out`` (accumulation dtype) the mean value, ``values / seq_len``
    (``values``: the sum over every key, ``[B, Hkv, D]``). Their lse stays -inf: they saw no visible key."""
    rows = fully_masked_rows(lse, q_pos, seq_len)
    mean = (values / seq_len).repeat_interleave(out.size(1) // values.size(1), dim=1).unsqueeze(2)
    out.copy_(torch.where(rows.unsqueeze(-1), mean.to(out.dtype), out))


class FullyMaskedGrads:
    """The fully masked rows of one rank's queries, found once per backward (one host sync), and their share
    of each KV block's gradients as autograd computes them through the uniform softmax of ``mode``."""

    def __init__(self, mode: str, lse: torch.Tensor, q_pos: torch.Tensor, seq_len: int):
        self.mode, self.seq_len, self.q_pos = mode, seq_len, q_pos
        self.rows = fully_masked_rows(lse, q_pos, seq_len) if mode != "zero" else None
        self.local = self.rows.any(0).any(0).nonzero().squeeze(1) if self.rows is not None else None  # in some b, h

    def add_(
        self,
        dout,
        q,
        k,
        v,
        out,
        kv_pos,
        scale: float,
        softcap,
        dq: torch.Tensor,
        dkv: torch.Tensor,
        program_grads: Sequence = (),
    ) -> None:
        """Into ``dq`` (``[B, Hq, n, D]``) and ``dkv`` (``stack((dk, dv))`` of the block, accumulation dtype);
        the scores' gradient also into the trained inputs of score programs (`lowering.program_grads`): a
        bias added to such a row's scores receives it, as in eager attention."""
        if self.local is None or self.local.numel() == 0:
            return
        acc, groups, tile, n = dq.dtype, q.size(1) // k.size(1), masks.MASK_TILE, self.seq_len
        real = (kv_pos < n).to(device=k.device, dtype=acc)  # padding keys of the layout get nothing

        def by_kv_head(grad):  # [B, Hq, m, D] -> [B, Hkv, m, D]: a KV head's gradient sums over its query heads
            b, h, m, d = grad.shape
            return grad.view(b, h // groups, groups, m, d).sum(2)

        for start in range(0, self.local.numel(), tile):
            r = self.local[start : start + tile]
            weighted = dout[:, :, r].to(acc) * (self.rows[:, :, r].to(acc) / n).unsqueeze(-1)  # p · dout, 0 elsewhere
            dkv[1] += by_kv_head(weighted.sum(2, keepdim=True)) * real[:, None]
            if self.mode != "uniform":
                continue
            q_r, out_r = q[:, :, r].to(acc), out[:, :, r].to(acc)
            delta = (weighted * out_r).sum(-1, keepdim=True)
            for c in range(0, k.size(2), tile):
                cols = slice(c, c + tile)
                k_c, v_c = (t[:, :, cols].to(acc).repeat_interleave(groups, dim=1) for t in (k, v))
                ds = (weighted @ v_c.transpose(-1, -2) - delta) * real[cols]  # p (dp - delta) with p = 1/N
                for grads in program_grads:  # (padding keys, ds 0, read as the last real one)
                    grads.add_(self.q_pos[r], kv_pos[cols].clamp(max=n - 1), ds)
                if softcap is not None:
                    ds = ds * (1 - torch.tanh(q_r @ k_c.transpose(-1, -2) * (scale / softcap)) ** 2)
                dq[:, :, r] += scale * (ds @ k_c)
                dkv[0, :, :, cols] += by_kv_head(scale * (ds.transpose(-1, -2) @ q_r))
