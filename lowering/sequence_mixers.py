"""Sequence mixers other than attention on a sharded sequence: each chunk gets a summary of the chunks before it.

A causal depthwise convolution of width k reads, for each token, the token and the k - 1 before it; a cumulative
sum along the sequence reads every token before. On a sequence laid out over the ranks (`Layout`: one chunk per
rank, or zigzag's two), each of a rank's chunks needs from the rest of the sequence only a summary of the chunks
before it: their last k - 1 tokens (a halo), or their total. Every rank computes its chunks' summaries, one
all-gather gives every rank all of them in global chunk order (bytes: the summaries', independent of the
sequence's length), and each chunk is computed on its own tokens with the summary of the chunks before it. A
convolution does the unsharded op's arithmetic; a cumsum adds the chunks before as one offset, so in low precision it
rounds as a blocked sum does (bf16 at N=4096 over 8 chunks: 0.008 relative against the whole cumsum's 0.004).

- ``ringpass::chunk_summaries``: the all-gather, in global chunk order. Its backward and the mixers' all-reduce the
  summaries' gradients and keep this rank's own chunks' rows, so the gradient reaches the tokens that made each summary
  (`lowering.state_passing` differentiates through it).
- ``ringpass::causal_conv1d``: ``conv1d(x, weight, bias, padding=k-1, groups=C)[..., :N]`` on this rank's tokens
  ``x [B, C, n]`` (in layout order), with the halo from the chunks before each chunk.
- ``ringpass::sequence_cumsum``: ``cumsum(x, dim)`` along the sequence on this rank's tokens.
- `sharded_conv1d` and `sharded_cumsum`: the two for a user who shards by hand (a `Layout` and a process group).

The two mixers and their backwards are single ops to the compiler, the backwards written out (a convolution's
input and weight gradients per chunk, a cumsum's reversed cumsum; the summaries' gradients all-reduced to the ranks
that made them), so the rank is read at run time and every rank runs the same graph.
Padding slots (`Layout`: at the end of the sequence) follow every real token, so no real token reads them.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from lowering import events
from lowering.all_gather import all_gather_into
from lowering.failures import wait_collective
from lowering.groups import checked_group, group_by_name, rank_in
from lowering.layout import Layout, cached_layout
from lowering.sequence_ops import all_reduce_sum


@functools.cache
def _chunk_order(kind: str, world_size: int, seq_len: int) -> torch.Tensor:
    """Where each global chunk lies among the all-gathered (rank, local chunk) rows."""
    layout = cached_layout(kind, world_size, seq_len)
    row_of = {
        chunk: r * len(layout.chunks(r)) + i for r in range(world_size) for i, chunk in enumerate(layout.chunks(r))
    }
    return torch.tensor([row_of[chunk] for chunk in range(layout.num_chunks)])


@torch.library.custom_op("ringpass::chunk_summaries", mutates_args=())
def chunk_summaries(summaries: torch.Tensor, kind: str, world_size: int, seq_len: int, group_name: str) -> torch.Tensor:
    """``summaries [c, ...]``, one row per chunk this rank holds (local order), becomes ``[2P or P, ...]``: every
    chunk's row, in global chunk order."""
    summaries = summaries.contiguous()
    if group_name:
        if events.recording():
            events.emit(
                "mixer_exchange", bytes=summaries.numel() * summaries.element_size(), shape=tuple(summaries.shape)
            )
        gathered = summaries.new_empty((world_size * summaries.shape[0], *summaries.shape[1:]))
        work = all_gather_into(gathered, summaries, group=group_by_name(group_name), async_op=True)
        wait_collective(work, gathered, group_name, f"all-gathering {tuple(summaries.shape)} chunk summaries")
        summaries = gathered
    return summaries.index_select(0, _chunk_order(kind, world_size, seq_len).to(summaries.device))


@chunk_summaries.register_fake
def _(summaries, kind, world_size, seq_len, group_name):
    return summaries.new_empty((cached_layout(kind, world_size, seq_len).num_chunks, *summaries.shape[1:]))


def _chunks(x: torch.Tensor, dim: int, kind: str, world_size: int, seq_len: int, group_name: str):
    """(this rank's chunks of ``x`` along ``dim``, each one's global chunk index)."""
    layout = cached_layout(kind, world_size, seq_len)
    owned = layout.chunks(rank_in(group_name))
    return x.split(layout.chunk_len, dim), owned


def _conv_forward(x, weight, bias, kind, world_size, seq_len, group_name):
    width = weight.shape[-1] - 1  # tokens before each token that it reads
    chunks, owned = _chunks(x, -1, kind, world_size, seq_len, group_name)
    every = _gathered_tails(chunks, width, kind, world_size, seq_len, group_name)
    outs = [
        F.conv1d(
            torch.cat((_halo(every, index, width), chunk), -1) if width else chunk, weight, bias, groups=x.shape[1]
        )
        for chunk, index in zip(chunks, owned)
    ]
    return torch.cat(outs, -1).contiguous()


def _gathered_tails(chunks, width: int, kind: str, world_size: int, seq_len: int, group_name: str):
    """Every chunk's last ``width`` tokens (all of a shorter chunk's), ``[chunks, B, C, tokens]`` in global order."""
    if width == 0:
        return None
    tails = torch.stack([c[..., -width:] for c in chunks])
    return chunk_summaries(tails, kind, world_size, seq_len, group_name)


def _halo(every: torch.Tensor, index: int, width: int) -> torch.Tensor:
    """The ``width`` tokens before global chunk ``index`` (zeros before the sequence's first token)."""
    before = every[:index].permute(1, 2, 0, 3).flatten(2)  # [B, C, tokens of the chunks before, in order]
    return F.pad(before[..., -width:], (max(0, width - before.shape[-1]), 0))


@torch.library.custom_op("ringpass::causal_conv1d", mutates_args=())
def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    kind: str,
    world_size: int,
    seq_len: int,
    group_name: str,
) -> torch.Tensor:
    """This rank's tokens of ``conv1d(x_full, weight, bias, padding=k-1, groups=C)[..., :seq_len]``: ``x [B, C, n]``
    its tokens in layout order, ``weight [C, 1, k]``."""
    return _conv_forward(x, weight, bias, kind, world_size, seq_len, group_name)


@causal_conv1d.register_fake
def _(x, weight, bias, kind, world_size, seq_len, group_name):
    return x.new_empty(x.shape)  # contiguous, as the op's result (an input given transposed is not)


def _sequence_cumsum_forward(x, dim, kind, world_size, seq_len, group_name):
    chunks, owned = _chunks(x, dim, kind, world_size, seq_len, group_name)
    totals = torch.stack([c.sum(dim) for c in chunks])
    every = chunk_summaries(totals, kind, world_size, seq_len, group_name)
    outs = [c.cumsum(dim) + every[:index].sum(0).unsqueeze(dim) for c, index in zip(chunks, owned)]
    return torch.cat(outs, dim).contiguous()


@torch.library.custom_op("ringpass::sequence_cumsum", mutates_args=())
def sequence_cumsum(
    x: torch.Tensor, dim: int, kind: str, world_size: int, seq_len: int, group_name: str
) -> torch.Tensor:
    """This rank's tokens of ``cumsum(x_full, dim)``: ``dim`` the sequence axis of ``x``, its tokens in layout order."""
    return _sequence_cumsum_forward(x, dim, kind, world_size, seq_len, group_name)


@sequence_cumsum.register_fake
def _(x, dim, kind, world_size, seq_len, group_name):
    return x.new_empty(x.shape)


# The backwards are ops of their own, so a compiled backward graph holds one opaque call per mixer, the same on
# every rank (the rank is read when it runs), and its collectives run in the same order everywhere. Each sends the
# gradient of every chunk's summary back to the chunk's rank (`_to_owners`: one all-reduce of the summaries' size).
@torch.library.custom_op("ringpass::causal_conv1d_backward", mutates_args=())
def causal_conv1d_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    kind: str,
    world_size: int,
    seq_len: int,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias: empty without a bias) of `causal_conv1d`; its halos are gathered again."""
    width, channels = weight.shape[-1] - 1, x.shape[1]
    chunks, owned = _chunks(x, -1, kind, world_size, seq_len, group_name)
    grads = grad.split(chunks[0].shape[-1], -1)
    every = _gathered_tails(chunks, width, kind, world_size, seq_len, group_name)
    d_every = torch.zeros_like(every) if every is not None else None
    dx, dweight = [], torch.zeros_like(weight)
    for chunk, index, g in zip(chunks, owned, grads):
        padded = torch.cat((_halo(every, index, width), chunk), -1) if width else chunk
        d_padded = torch.nn.grad.conv1d_input(padded.shape, weight, g, groups=channels)
        dweight += torch.nn.grad.conv1d_weight(padded, weight.shape, g, groups=channels)
        dx.append(d_padded[..., width:].clone())
        if width and index:  # the halo's gradient, to the tails it came from: [B, C, tokens before] -> rows
            tokens = every.shape[-1]
            taken = min(width, index * tokens)
            before = d_padded.new_zeros((*d_padded.shape[:2], index * tokens))
            before[..., -taken:] = d_padded[..., width - taken : width]
            d_every[:index] += before.unflatten(2, (index, tokens)).permute(2, 0, 1, 3)
    if width:
        for d_chunk, d_tail in zip(dx, _to_owners(d_every, kind, world_size, seq_len, group_name)):
            d_chunk[..., -d_tail.shape[-1] :] += d_tail
    dbias = grad.sum((0, 2)) if bias is not None else weight.new_zeros(0)
    return torch.empty_like(x).copy_(torch.cat(dx, -1)), dweight, dbias  # x's strides, as the fake says


@causal_conv1d_backward.register_fake
def _(grad, x, weight, bias, kind, world_size, seq_len, group_name):
    return (
        torch.empty_like(x),
        torch.empty_like(weight),
        torch.empty_like(bias) if bias is not None else weight.new_empty(0),
    )


@torch.library.custom_op("ringpass::sequence_cumsum_backward", mutates_args=())
def sequence_cumsum_backward(
    grad: torch.Tensor, dim: int, kind: str, world_size: int, seq_len: int, group_name: str
) -> torch.Tensor:
    """dx of `sequence_cumsum`: each token's gradient summed over the tokens from it to the end (within its chunk,
    then every later chunk's total, from their ranks)."""
    grads, owned = _chunks(grad, dim, kind, world_size, seq_len, group_name)
    totals = torch.stack([g.sum(dim) for g in grads])  # what each chunk's offset receives
    layout = cached_layout(kind, world_size, seq_len)
    d_every = totals.new_zeros((layout.num_chunks, *totals.shape[1:]))
    for total, index in zip(totals, owned):
        d_every[:index] += total  # every chunk before adds into this one's offset
    after = _to_owners(d_every, kind, world_size, seq_len, group_name)
    return torch.cat([g.flip(dim).cumsum(dim).flip(dim) + a.unsqueeze(dim) for g, a in zip(grads, after)], dim)


@sequence_cumsum_backward.register_fake
def _(grad, dim, kind, world_size, seq_len, group_name):
    return grad.new_empty(grad.shape)


def _to_owners(d_every: torch.Tensor, kind: str, world_size: int, seq_len: int, group_name: str) -> torch.Tensor:
    """Every rank's gradient of every chunk's summary, summed, as this rank's own chunks' rows (local order)."""
    total = all_reduce_sum(d_every.contiguous(), group_name)
    own = cached_layout(kind, world_size, seq_len).chunks(rank_in(group_name))
    return total.index_select(0, torch.tensor(own, device=total.device))


def _save_conv(ctx, inputs, output):
    x, weight, bias, *ctx.args = inputs
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, weight, *([bias] if ctx.has_bias else []))


def _conv_backward(ctx, grad):
    x, weight, *bias = ctx.saved_tensors
    dx, dw, db = causal_conv1d_backward(grad.contiguous(), x, weight, bias[0] if bias else None, *ctx.args)
    return dx, dw, db if ctx.has_bias else None, *[None] * len(ctx.args)


def _save_cumsum(ctx, inputs, output):
    ctx.args = inputs[1:]  # its backward reads no tensor


def _cumsum_backward(ctx, grad):
    return sequence_cumsum_backward(grad.contiguous(), *ctx.args), *[None] * len(ctx.args)


def _save_summaries(ctx, inputs, output):
    ctx.args = inputs[1:]


def _summaries_backward(ctx, grad):
    return _to_owners(grad, *ctx.args), *[None] * len(ctx.args)


chunk_summaries.register_autograd(_summaries_backward, setup_context=_save_summaries)
causal_conv1d.register_autograd(_conv_backward, setup_context=_save_conv)
sequence_cumsum.register_autograd(_cumsum_backward, setup_context=_save_cumsum)


def sharded_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, layout: Layout, group=None
):
    """This rank's tokens of the causal depthwise convolution ``conv1d(x_full, weight, bias, padding=k-1,
    groups=C)[..., :N]``: ``x [B, C, n]`` is ``layout.shard(x_full, 2, rank)``, ``weight [C, 1, k]``. Differentiable;
    ``group``: the ranks of the layout (None: the default group)."""
    name = _group_name(group, layout)
    return causal_conv1d(x, weight, bias, layout.kind, layout.world_size, layout.seq_len, name)


def sharded_cumsum(x: torch.Tensor, dim: int, *, layout: Layout, group=None) -> torch.Tensor:
    """This rank's tokens of ``cumsum(x_full, dim)``: ``x`` is ``layout.shard(x_full, dim, rank)``. Differentiable."""
    name = _group_name(group, layout)
    return sequence_cumsum(x, dim % x.dim(), layout.kind, layout.world_size, layout.seq_len, name)


def _group_name(group, layout: Layout) -> str:
    resolved = checked_group(group, layout.world_size)
    return "" if resolved is None else resolved.group_name
