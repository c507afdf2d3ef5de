"""Ulysses x ring (2-D attention): all-to-all over heads inside groups of U ranks, the ring across the groups.

The sequence is laid out over all P = R x U ranks as usual (`Layout`: rank ``c = g·U + u`` holds its chunks).
Before attention each rank of Ulysses group ``g`` trades heads for tokens with its U - 1 peers (one
all-to-all): it gives away all but its share of the heads and receives that share of the heads for every
token the group holds. The ring then runs over the R groups (ring rank ``g``) on U times longer blocks with
1/U of the heads, and a second all-to-all gives the output back to the ranks that hold its tokens. The
all-to-all runs over the fast links (inside a node), the ring over the slow ones; each ring step computes
U² times more per byte it moves than a P-rank ring's step, so its transfers hide sooner.

`lowering.layout.GroupLayout` is the ring's view of the tokens: group ``g`` holds the union of its ranks' positions,
in increasing order (the received tokens are put in that order), so real slots lead and padding trails, as
`lowering.schedule` expects of a layout. Zigzag over P ranks keeps the groups' causal work equal too (each
group holds U early and U mirrored late chunks).

GQA: keys and values need ``Hkv`` divisible by U, or U divisible by ``Hkv`` (then each KV head is repeated
U / Hkv times first, so every rank gets the one KV head its query heads read); the query heads need U to divide them.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from lowering import events
from lowering.errors import InvalidInputError, NotSupportedError
from lowering.failures import wait_collective
from lowering.groups import group_by_name, rank_in
from lowering.layout import Layout, cached_layout
from lowering.op import agree_on_call, check_inputs, default_scale
from lowering.ring_args import RingArgs


def check_heads(q_heads: int, kv_heads: int, ulysses: int) -> int:
    """How many times each KV head is repeated before the all-to-all (1: none); refuses head counts U cannot split."""
    if q_heads % ulysses:
        raise NotSupportedError(
            f"Ulysses groups of {ulysses} ranks split the query heads, but there are {q_heads}: "
            "use a group size that divides the heads."
        )
    if kv_heads % ulysses == 0:
        return 1
    if ulysses % kv_heads == 0:
        return ulysses // kv_heads
    raise NotSupportedError(
        f"Ulysses groups of {ulysses} ranks cannot share {kv_heads} key/value heads (neither divides "
        "the other): use a group size that divides the KV heads or a multiple of them."
    )


def _all_to_all(x: torch.Tensor, group_name: str, what: str) -> torch.Tensor:
    """``x[j]`` goes to rank j of the group; returns what every rank j sent this one, stacked the same way."""
    x = x.contiguous()
    received = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # not empty_like: it keeps x's strides
    group = group_by_name(group_name)
    if events.recording():
        events.emit("heads_exchange", direction=what, bytes=x.numel() * x.element_size())
    work = dist.all_to_all_single(received, x, group=group, async_op=True)
    wait_collective(work, received, group_name, f"the Ulysses all-to-all of {what}")
    return received


@torch.library.custom_op("ringpass::ulysses_heads_to_tokens", mutates_args=())
def heads_to_tokens(
    x: torch.Tensor,
    layout_kind: str,
    world_size: int,
    seq_len: int,
    ulysses: int,
    group_name: str,
    ring_group_name: str,
) -> torch.Tensor:
    """``x`` ``[B, H, n, ...]``, this rank's tokens with every head, becomes ``[B, H/U, U·n, ...]``: this rank's
    share of the heads for every token of its Ulysses group (``group_name``; the group's rank in the ring across
    groups is this rank's in ``ring_group_name``), in position order."""
    b, h, n = x.shape[:3]
    rest = x.shape[3:]
    parts = x.reshape(b, ulysses, h // ulysses, n, *rest).movedim(1, 0)
    received = _all_to_all(parts, group_name, "heads to tokens")  # [U (sender), B, H/U, n, ...]
    tokens = received.movedim(0, 2).reshape(b, h // ulysses, ulysses * n, *rest)
    order = cached_layout(layout_kind, world_size, seq_len, ulysses).order(rank_in(ring_group_name)).to(x.device)
    return tokens.index_select(2, order)


@heads_to_tokens.register_fake
def _(x, layout_kind, world_size, seq_len, ulysses, group_name, ring_group_name):
    b, h, n = x.shape[:3]
    return x.new_empty((b, h // ulysses, n * ulysses, *x.shape[3:]))


@torch.library.custom_op("ringpass::ulysses_tokens_to_heads", mutates_args=())
def tokens_to_heads(
    x: torch.Tensor,
    layout_kind: str,
    world_size: int,
    seq_len: int,
    ulysses: int,
    group_name: str,
    ring_group_name: str,
) -> torch.Tensor:
    """The inverse of `heads_to_tokens`: ``[B, H/U, U·n, ...]`` back to this rank's ``[B, H, n, ...]``."""
    b, h_share, total = x.shape[:3]
    rest, n = x.shape[3:], total // ulysses
    inverse = cached_layout(layout_kind, world_size, seq_len, ulysses).inverse_order(rank_in(ring_group_name))
    inverse = inverse.to(x.device)
    by_rank = x.index_select(2, inverse).reshape(b, h_share, ulysses, n, *rest).movedim(2, 0)
    received = _all_to_all(by_rank, group_name, "tokens to heads")  # [U (head share), B, H/U, n, ...]
    return received.movedim(0, 1).reshape(b, h_share * ulysses, n, *rest).contiguous()  # as the fake


@tokens_to_heads.register_fake
def _(x, layout_kind, world_size, seq_len, ulysses, group_name, ring_group_name):
    b, h_share, total = x.shape[:3]
    return x.new_empty((b, h_share * ulysses, total // ulysses, *x.shape[3:]))


def _setup(ctx, inputs, output):
    ctx.config = inputs[1:]


heads_to_tokens.register_autograd(
    lambda ctx, grad: (tokens_to_heads(grad, *ctx.config), *[None] * len(ctx.config)), setup_context=_setup
)
tokens_to_heads.register_autograd(
    lambda ctx, grad: (heads_to_tokens(grad, *ctx.config), *[None] * len(ctx.config)), setup_context=_setup
)


@functools.cache
def ulysses_mesh(ring: int, ulysses: int):
    """The default group's ranks as a (ring, ulysses) `DeviceMesh` (Ulysses groups of ``ulysses`` consecutive ranks),
    made once per process: every rank must ask for it, in the same order (making its groups is collective)."""
    from torch.distributed.device_mesh import init_device_mesh

    device = "cpu" if dist.get_backend() == "gloo" else "cuda"
    return init_device_mesh(device, (ring, ulysses), mesh_dim_names=("ring", "ulysses"))


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: Layout,
    ring_group,
    ulysses_group,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Exact attention over a sequence laid out by ``layout`` over the ranks of both groups (rank
    ``ring_rank · U + ulysses_rank``): q ``[B, Hq, n, D]``, k/v ``[B, Hkv, n, D]``, this rank's shard
    (``layout.shard(x, 2, rank)``). All-to-all over heads within ``ulysses_group`` (U ranks), the ring across
    ``ring_group`` (P / U ranks), all-to-all back. Differentiable in q, k, v."""
    check_inputs(q, k, v, layout)
    ulysses = dist.get_world_size(ulysses_group)
    ring_size = dist.get_world_size(ring_group)
    if ring_size * ulysses != layout.world_size:
        raise InvalidInputError(
            f"The layout spans {layout.world_size} ranks but the ring ({ring_size}) x Ulysses ({ulysses}) "
            f"groups have {ring_size * ulysses}."
        )
    ring = RingArgs(
        layout.kind,
        layout.world_size,
        layout.seq_len,
        bool(is_causal),
        default_scale(q) if scale is None else float(scale),
        ring_group.group_name,
        ulysses=ulysses,
    )
    for group in (ulysses_group, ring_group):  # together they join every rank of the layout
        agree_on_call("ulysses_attention", group.group_name, layout, (q, k, v), ring)
    repeat = check_heads(q.size(1), k.size(1), ulysses)
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    args = (layout.kind, layout.world_size, layout.seq_len, ulysses, ulysses_group.group_name, ring_group.group_name)
    q2, k2, v2 = (heads_to_tokens(t, *args) for t in (q, k, v))
    out, _ = torch.ops.ringpass.ring_attention(q2, k2, v2, *ring.op_args())
    return tokens_to_heads(out, *args)
