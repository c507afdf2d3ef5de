"""`gathered_attention`: the all-gather alternative to the ring (the Llama-3 recipe), exact and differentiable.

Each rank gathers every rank's K/V block at once (one all-gather, nothing overlapped), attends with its
own queries to all of them with the ring's own block kernels and plan, and in the backward gathers K/V
again, computes every block's dK/dV contribution and reduce-scatters them to their owners. It moves the
same bytes as the ring but holds the whole K/V on every rank (P blocks instead of two) and exposes all of
its communication; ``ringpass bench`` runs it next to the ring, and ``ringpass plan`` predicts it. With
``timings`` (a dict) the seconds spent in collectives are added under ``"communication"``.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from lowering.errors import InvalidInputError
from lowering.groups import checked_group
from lowering.layout import Layout
from lowering.op import agree_on_call, check_inputs, default_scale
from lowering.ring import RankBackward, RankForward, RingSpec
from lowering.ring_args import RingArgs

# torch 2.13 renamed the tensor collectives (the old names still work, with a warning)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def gathered_attention(
    q,
    k,
    v,
    *,
    layout: Layout,
    is_causal: bool = False,
    scale: float | None = None,
    group=None,
    timings: dict | None = None,
) -> torch.Tensor:
    """This rank's rows of exact full-sequence attention, for shards in ``layout`` order (as
    `lowering.ring_attention` takes them), by gathering K/V instead of passing it around a ring."""
    check_inputs(q, k, v, layout)
    group = checked_group(group, layout.world_size)  # the same checks of group and layout as ring_attention's
    if group is None:
        raise InvalidInputError("gathered_attention needs an initialised process group (init_process_group).")
    spec = RingSpec(layout, bool(is_causal), default_scale(q) if scale is None else float(scale))
    options = RingArgs(layout.kind, layout.world_size, layout.seq_len, spec.is_causal, spec.scale, group.group_name)
    agree_on_call("gathered_attention", group.group_name, layout, (q, k, v), options)
    return _GatheredAttention.apply(q, k, v, spec, group, timings if timings is not None else {})


def _gather_blocks(k, v, group, timings: dict) -> torch.Tensor:
    """``[P, 2, B, Hkv, n, D]``: every rank's stacked K/V block, in rank order."""
    kv = torch.stack((k, v))
    p = dist.get_world_size(group)
    blocks = kv.new_empty((p * kv.size(0), *kv.shape[1:]))  # the collectives concatenate along dim 0
    with _timed(timings):
        _all_gather(blocks, kv, group=group)
    return blocks.view(p, *kv.shape)


@contextmanager
def _timed(timings: dict):
    start = time.perf_counter()
    yield
    timings["communication"] = timings.get("communication", 0.0) + time.perf_counter() - start


class _GatheredAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, spec: RingSpec, group, timings: dict):
        rank = dist.get_rank(group)
        blocks = _gather_blocks(k.contiguous(), v.contiguous(), group, timings)
        state = RankForward(q.contiguous(), spec, rank)
        for kv_rank, block in enumerate(blocks):
            state.add_block(block[0], block[1], kv_rank)
        del blocks  # the backward gathers again rather than holding every block until then
        out, lse = state.result()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec, ctx.group, ctx.timings = spec, group, timings
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        rank = dist.get_rank(ctx.group)
        blocks = _gather_blocks(k.contiguous(), v.contiguous(), ctx.group, ctx.timings)
        state = RankBackward(dout.contiguous(), q.contiguous(), out, lse, None, ctx.spec, rank)
        grads = torch.cat([state.block_grads(block[0], block[1], kv_rank) for kv_rank, block in enumerate(blocks)])
        del blocks
        mine = grads.new_empty((2, *grads.shape[1:]))
        with _timed(ctx.timings):
            _reduce_scatter(mine, grads, group=ctx.group)
        return state.dq.to(q.dtype), mine[0].to(k.dtype, copy=True), mine[1].to(v.dtype, copy=True), None, None, None
