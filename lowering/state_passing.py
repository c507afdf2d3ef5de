"""Chunked scans on a sharded sequence by passing state: each chunk starts from the state the chunks before it leave.

A chunked scan (Mamba2's SSD, Gated DeltaNet's delta rule) carries a state ``S`` along the sequence, and the state
after a span of tokens is affine in the state before it: ``S_after = M S_before + U`` (``U`` the state the span leaves
from a zero state, ``M`` the span's transition: a decay per head for SSD, a ``dk x dk`` matrix per head for the delta
rule). So a span needs from the rest of the sequence only the state before it, and that state follows from every
earlier span's ``(M, U)``, a summary of fixed size whatever the span's length.

`sharded_scan` runs a scan on this rank's chunks of a `Layout` (one chunk per rank, or zigzag's two):

- each chunk's summary ``(U, M)`` comes from one call of the scan itself on the chunk, with the value widened by
  columns that start from the identity (zero inputs in them, so they carry ``M`` applied to the identity: ``M``),
  as the state's value columns evolve apart (`AffineScan.summary`);
- one all-gather (``ringpass::chunk_summaries``) gives every rank every chunk's summary, in sequence order; each chunk
  folds the summaries before it into its initial state and the scan runs on the chunk from it: its outputs are the
  unsharded scan's (up to rounding: the state at a chunk's start is summed in another order);
- bytes per rank per call: the summaries', ``chunks x B x H x dk x (dv + dk)`` for the delta rule,
  ``chunks x B x H x (head_dim + 1) x state`` for SSD, independent of the sequence's length;
- backward: autograd through the scans and the fold; each summary's gradient goes back to the rank whose chunk made
  it (the all-gather's backward: one all-reduce of the summaries' size).

Per rank, the scan runs on ``n = N / P`` tokens twice (the summary's call with the value widened, then the output's):
about ``2.5 / P`` of the unsharded scan's compute for the delta rule, ``2 / P`` for SSD, against splitting by heads'
``1 / P`` and its all-to-alls of ``O(N)`` bytes.

The scans are the model's own functions (`AffineScan`: how to call one, and which input carries the state's value
columns), so the arithmetic of each chunk is the model's: `gated_delta_rule` for the
``chunk_gated_delta_rule(query, key, value, g, beta, ...)`` signature (Hugging Face's Qwen3-Next, Qwen3.5,
OLMo-Hybrid; flash-linear-attention's), `ssd` for ``mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, ...)``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lowering.groups import checked_group, rank_in
from lowering.layout import Layout, cached_layout
from lowering.sequence_mixers import chunk_summaries


@dataclass(frozen=True)
class AffineScan:
    """A scan ``function(*tokens, *weights, initial_state=..., **constants) -> (output, final_state)`` whose state
    after a span is affine in the state before it, each of the state's value columns evolving apart.

    ``tokens``' names are the per-token inputs (``[B, n, ...]``, the sequence in dim 1); ``value`` the one whose last
    dim is the state's value dim ``value_dim`` (of ``[B, H, ., .]``); ``transition_width(state)`` how many value
    columns the transition needs (the state's other dim for a matrix, 1 for a decay), `transition` how ``M`` (those
    columns) applies to a state."""

    name: str
    call: Callable  # (tokens: dict, weights: dict, initial_state | None) -> (output, final state)
    tokens: tuple[str, ...]
    value: str
    value_dim: int  # of the state [B, H, ., .]: -1 (delta rule: [B, H, dk, dv]) or -2 (SSD: [B, H, head_dim, N])
    transition_width: Callable[[torch.Tensor], int]
    transition: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (M, S) -> M applied to S
    weights: tuple[str, ...] = field(default=())

    def summary(self, tokens: dict, weights: dict, state_like: torch.Tensor) -> torch.Tensor:
        """``[U | M]`` along the state's value dim: the state a chunk leaves from zero, and its transition."""
        width, value = self.transition_width(state_like), tokens[self.value]
        widened = dict(tokens, **{self.value: torch.cat((value, value.new_zeros((*value.shape[:-1], width))), -1)})
        identity = _identity_columns(state_like, width, self.value_dim)
        _, final = self.call(widened, weights, torch.cat((torch.zeros_like(state_like), identity), self.value_dim))
        return final

    def advance(self, summary: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """The state after a chunk whose summary is ``summary``, from ``state`` before it."""
        columns = state.shape[self.value_dim]
        made, transition = summary.split((columns, summary.shape[self.value_dim] - columns), self.value_dim)
        return self.transition(transition, state) + made


def _identity_columns(state_like: torch.Tensor, width: int, value_dim: int) -> torch.Tensor:
    """Columns to append along the value dim whose image under the transition is ``M``: the identity (``dk``
    columns against the ``dk`` rows of a matrix transition) or ones (one column, for a decay)."""
    rows = state_like.shape[-1 if value_dim == -2 else -2]
    if value_dim == -1:  # [B, H, dk, width]: M @ I
        block = torch.eye(rows, width, dtype=state_like.dtype, device=state_like.device)
        return block.expand(*state_like.shape[:2], rows, width)
    return state_like.new_ones((*state_like.shape[:2], width, rows))  # [B, H, 1, N]: M * 1


def gated_delta_rule(function: Callable, **constants) -> AffineScan:
    """``function(query, key, value, g, beta, chunk_size=.., initial_state=.., output_final_state=..,
    use_qk_l2norm_in_kernel=..)``: ``S_t = exp(g_t) (I - beta_t k_t k_t^T) S_(t-1) + beta_t k_t v_t^T``, the state
    ``[B, H, dk, dv]``; ``constants``: its other keyword arguments as the model passes them."""

    def call(tokens, weights, initial_state):
        return function(**tokens, initial_state=initial_state, output_final_state=True, **constants)

    return AffineScan(
        name=getattr(function, "__name__", "gated delta rule"),
        call=call,
        tokens=("query", "key", "value", "g", "beta"),
        value="value",
        value_dim=-1,
        transition_width=lambda state: state.shape[-2],
        transition=torch.matmul,
    )


def ssd(function: Callable, **constants) -> AffineScan:
    """``function(hidden_states, dt, A, B, C, chunk_size, D=.., dt_bias=.., initial_states=.., return_final_states=..,
    ..)``: Mamba2's state-space duality, ``S_t = exp(A dt_t) S_(t-1) + dt_t x_t B_t^T``, the state
    ``[B, H, head_dim, N]``; ``A``, ``D``, ``dt_bias`` are weights; ``constants`` its other keyword arguments."""

    def call(tokens, weights, initial_state):
        return function(**tokens, **weights, initial_states=initial_state, return_final_states=True, **constants)

    return AffineScan(
        name=getattr(function, "__name__", "ssd"),
        call=call,
        tokens=("hidden_states", "dt", "B", "C"),
        value="hidden_states",
        value_dim=-2,
        transition_width=lambda state: 1,
        transition=torch.mul,
        weights=("A", "D", "dt_bias"),
    )


def sharded_scan(
    scan: AffineScan,
    tokens: dict,
    weights: dict,
    state_like: torch.Tensor,
    *,
    layout: Layout,
    group=None,
) -> torch.Tensor:
    """This rank's tokens of ``scan``'s output on the whole sequence (from a zero state): ``tokens`` are
    ``layout.shard(t, 1, rank)`` of each per-token input, ``weights`` whole, ``state_like`` a zero state of the
    scan's shape and dtype for one chunk (``[B, H, ., .]``). Differentiable; ``group``: the layout's ranks."""
    resolved = checked_group(group, layout.world_size)
    name = "" if resolved is None else resolved.group_name
    return scan_chunks(scan, tokens, weights, state_like, layout.kind, layout.world_size, layout.seq_len, name)


def scan_chunks(scan, tokens, weights, state_like, kind: str, world_size: int, seq_len: int, group_name: str):
    """`sharded_scan` with the layout spelled as the compiled graph spells it (kind, P, N, the group's name)."""
    layout = cached_layout(kind, world_size, seq_len)
    owned = layout.chunks(rank_in(group_name))
    per_chunk = [dict(zip(tokens, parts)) for parts in zip(*(t.split(layout.chunk_len, 1) for t in tokens.values()))]
    summaries = torch.stack([scan.summary(chunk, weights, state_like) for chunk in per_chunk])
    every = chunk_summaries(summaries, kind, world_size, seq_len, group_name)
    starts, state = [torch.zeros_like(state_like)], torch.zeros_like(state_like)
    for summary in every[: max(owned)]:
        state = scan.advance(summary, state)
        starts.append(state)
    outputs = [scan.call(chunk, weights, starts[index])[0] for chunk, index in zip(per_chunk, owned)]
    return after_summaries(torch.cat(outputs, 1), every)


@torch.library.custom_op("ringpass::after_summaries", mutates_args=())
def after_summaries(output: torch.Tensor, summaries: torch.Tensor) -> torch.Tensor:
    """``output``, made to depend on ``summaries``: a rank whose chunks read no summary (the first chunk's) still runs
    the all-gather's backward (its all-reduce), which every rank must run."""
    return output.clone()


@after_summaries.register_fake
def _(output, summaries):
    return torch.empty_like(output)


def _after_summaries_backward(ctx, grad):
    return grad, grad.new_zeros(ctx.summaries_shape, dtype=ctx.summaries_dtype)


def _save_after_summaries(ctx, inputs, output):
    ctx.summaries_shape, ctx.summaries_dtype = inputs[1].shape, inputs[1].dtype


after_summaries.register_autograd(_after_summaries_backward, setup_context=_save_after_summaries)
