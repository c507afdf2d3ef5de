"""Decode attention over a KV cache that stays sharded: a few new queries against every rank's part.

    out = decode_attention(q, k_cache, v_cache, q_pos=q_pos, kv_pos=kv_pos, is_causal=True)

A decode step has a handful of queries (one per new token) and a long cache. Rotating the cache around a
ring for them moves the whole cache for almost no compute, so instead every rank attends with the same
queries to the keys it holds, and the ranks merge their partial results exactly by the log-sum-exp
identity: one all-gather of ``B·Hq·t·(D+1)`` numbers (out and LSE) per attention, whatever the cache
length. No key or value leaves its rank.

- ``q`` ``[B, Hq, t, D]``: the new tokens' queries, the same on every rank (replicated).
- ``k_cache``, ``v_cache`` ``[B, Hkv, m, D]``: this rank's cache slots; ``m`` may differ between ranks
  (0 too). Query head ``h`` reads KV head ``h // (Hq // Hkv)``.
- ``q_pos`` ``[t]`` and ``kv_pos`` ``[m]``: int64 global positions of the queries and of this rank's slots.
- ``is_causal``: a key is visible iff ``kv_pos <= q_pos``; ``window=W`` also needs ``q_pos - kv_pos < W``;
  ``key_padding`` bool ``[B, m]`` (True = a real token): left padding of the prompt, per row; ``mask``
  bool ``[B or 1, Hq or 1, t, m]`` (True = visible): any other mask, already read at this rank's slots.

A query that sees no key on any rank gets 0 (as the ring gives). Inference only: inputs that require
gradients are refused.

Cache ownership (`new_position_owner`): the prompt's positions stay where the prefill's layout put them
(`Layout.positions(rank)`); a position ``p`` past a prompt of ``n`` tokens belongs to rank
``(p - n) % P``, so generated tokens spread evenly and every rank's cache grows by one slot in P steps.
`append_to_cache` keeps the new keys and values of the positions this rank owns.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lowering import events
from lowering.errors import InvalidInputError
from lowering.failures import wait_collective
from lowering.groups import resolve_group, world_of
from lowering.kernels import accumulation_dtype, block_attention
from lowering.kernels.torch_attention import visible_pairs
from lowering.op import default_scale

_FUSED = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    q_pos: torch.Tensor,
    kv_pos: torch.Tensor,
    is_causal: bool = True,
    window: int | None = None,
    key_padding: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    group=None,
) -> torch.Tensor:
    """Exact attention of the replicated queries ``q`` over the cache every rank holds a part of (module
    docstring); the same ``[B, Hq, t, D]`` result on every rank of ``group`` (default: the whole world)."""
    _check(q, k_cache, v_cache, q_pos, kv_pos, key_padding, mask, window, is_causal)
    scale = default_scale(q) if scale is None else float(scale)
    group = resolve_group(group)
    group_name = "" if group is None else group.group_name
    return torch.ops.ringpass.decode_attention(
        q, k_cache, v_cache, q_pos, kv_pos, key_padding, mask, bool(is_causal), window, scale, group_name
    )


@torch.library.custom_op("ringpass::decode_attention", mutates_args=())
def _decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    kv_pos: torch.Tensor,
    key_padding: torch.Tensor | None,
    mask: torch.Tensor | None,
    is_causal: bool,
    window: int | None,
    scale: float,
    group_name: str,
) -> torch.Tensor:
    out, lse = _local(q, k, v, q_pos, kv_pos, key_padding, mask, is_causal, window, scale)
    if group_name:
        world_size, _, group = world_of(group_name)
        packed = torch.cat((out, lse.unsqueeze(-1)), dim=-1).contiguous()
        parts = [torch.empty_like(packed) for _ in range(world_size)]
        work = dist.all_gather(parts, packed, group=group, async_op=True)
        wait_collective(work, packed, group_name, f"all-gathering decode attention's out and LSE {tuple(packed.shape)}")
        events.emit("decode_merge", bytes=packed.numel() * packed.element_size(), ranks=len(parts))
        every = torch.stack(parts)
        out, lse = _merge(every[..., :-1], every[..., -1])
    return out.to(q.dtype)


@_decode_attention.register_fake
def _(q, k, v, q_pos, kv_pos, key_padding, mask, is_causal, window, scale, group_name):
    return torch.empty_like(q)


def _local(q, k, v, q_pos, kv_pos, key_padding, mask, is_causal, window, scale):
    """This rank's (out, lse) over its own slots, in the accumulation dtype; (0, -inf) for no slots."""
    dtype = accumulation_dtype(q.dtype)
    if k.size(2) == 0:
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=dtype, device=q.device)
        return torch.zeros(q.shape, dtype=dtype, device=q.device), lse
    if key_padding is not None:
        mask = key_padding[:, None, None, :] if mask is None else mask & key_padding[:, None, None, :]
    batch, heads, t, head_dim = q.shape
    groups = heads // k.size(1)
    if groups > 1:  # GQA: each KV head's group of queries stacked along the tokens, so no key or value is copied
        q, q_pos = q.reshape(batch, k.size(1), groups * t, head_dim), q_pos.repeat(groups)
        if mask is not None:
            mask = mask.expand(-1, -1, t, -1)
            mask = (
                mask.repeat(1, 1, groups, 1)
                if mask.size(1) == 1
                else mask.reshape(mask.size(0), k.size(1), groups * t, -1)
            )
    if q.device.type == "cpu":
        visible = visible_pairs(q_pos, kv_pos, is_causal, window, mask, q.device)
        out, lse = _fused_local(q, k, v, None if visible is None or bool(visible.all()) else visible, scale)
    else:
        out, lse = block_attention(
            q, k, v, q_pos, kv_pos, scale=scale, is_causal=is_causal, window=window, mask=mask, backend="torch"
        )
    return out.reshape(batch, heads, t, -1), lse.reshape(batch, heads, t)


def _fused_local(q, k, v, visible: torch.Tensor | None, scale: float):
    """aten's fused CPU kernel over the slots (reads each key and value once; 1.4x the written-out softmax at
    131072 slots), the mask as 0 / -inf; rows that see no slot get (0, -inf), as the block kernels give."""
    dtype = accumulation_dtype(q.dtype)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if visible is None:
        return _FUSED(q, k, v, 0.0, False, scale=scale)
    hidden = torch.zeros(visible.shape, dtype=dtype, device=q.device).masked_fill_(~visible, float("-inf"))
    out, lse = _FUSED(q, k, v, 0.0, False, attn_mask=hidden, scale=scale)
    blind = ~visible.any(-1).expand(lse.shape)
    return out.masked_fill(blind.unsqueeze(-1), 0.0), lse.masked_fill(blind, float("-inf"))


def _merge(outs: torch.Tensor, lses: torch.Tensor):
    """Every rank's ``[P, ...]`` partial (out, lse) merged exactly; rows no rank saw stay (0, -inf)."""
    total = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - total).nan_to_num(0.0)  # -inf - -inf: a row no rank saw
    return (weights.unsqueeze(-1) * outs).sum(dim=0), total


def new_position_owner(position: int, prompt_len: int, world_size: int) -> int:
    """The rank whose cache holds the keys of generated position ``position`` (``>= prompt_len``)."""
    if position < prompt_len:
        raise InvalidInputError(
            f"position {position} is in the prompt ({prompt_len} tokens): the prefill's layout "
            "owns it (Layout.positions(rank))."
        )
    return (position - prompt_len) % world_size


def append_to_cache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_pos: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    new_pos: torch.Tensor,
    *,
    prompt_len: int,
    rank: int,
    world_size: int,
):
    """(k_cache, v_cache, kv_pos) with the new tokens' keys and values ``[B, Hkv, t, D]`` at positions
    ``new_pos [t]`` appended where this rank owns them (`new_position_owner`)."""
    mine = torch.tensor(
        [new_position_owner(int(p), prompt_len, world_size) == rank for p in new_pos.tolist()], device=k_new.device
    )
    return (
        torch.cat((k_cache, k_new[:, :, mine]), dim=2),
        torch.cat((v_cache, v_new[:, :, mine]), dim=2),
        torch.cat((kv_pos, new_pos.to(kv_pos.device)[mine])),
    )


def _check(q, k, v, q_pos, kv_pos, key_padding, mask, window, is_causal) -> None:
    for name, t in (("q", q), ("k_cache", k), ("v_cache", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise InvalidInputError(
                f"{name} must be a 4-D tensor [batch, heads, tokens, head_dim], got "
                f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}."
            )
        if t.requires_grad and torch.is_grad_enabled():
            raise InvalidInputError(
                f"{name} requires gradients: decode attention is for inference; run it under "
                "torch.no_grad() (training goes through ring_attention)."
            )
    if k.shape != v.shape or q.size(0) != k.size(0) or q.size(-1) != k.size(-1) or q.size(1) % k.size(1):
        raise InvalidInputError(
            f"q {tuple(q.shape)} and the cache {tuple(k.shape)} / {tuple(v.shape)} do not fit: "
            "one batch and head dim, and query heads a multiple of KV heads."
        )
    if q_pos.shape != (q.size(2),) or kv_pos.shape != (k.size(2),):
        raise InvalidInputError(
            f"q_pos must be [{q.size(2)}] and kv_pos [{k.size(2)}] (one global position per "
            f"token), got {tuple(q_pos.shape)} and {tuple(kv_pos.shape)}."
        )
    if key_padding is not None and (key_padding.dtype != torch.bool or key_padding.shape != (k.size(0), k.size(2))):
        raise InvalidInputError(f"key_padding must be bool [{k.size(0)}, {k.size(2)}] (True = a real token).")
    if mask is not None and (
        mask.dtype != torch.bool
        or mask.dim() != 4
        or mask.shape[2:] != (q.size(2), k.size(2))
        or mask.size(0) not in (1, q.size(0))
        or mask.size(1) not in (1, q.size(1))
    ):
        raise InvalidInputError(
            f"mask must be bool [{q.size(0)} or 1, {q.size(1)} or 1, {q.size(2)}, {k.size(2)}] "
            f"(True = visible), got {mask.dtype} {tuple(mask.shape)}."
        )
    if window is not None and not is_causal:
        raise InvalidInputError(f"window={window} needs is_causal=True (a sliding window looks back from each query).")
