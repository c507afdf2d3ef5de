"""Chunked scans on a sharded sequence by passing state: each chunk starts from the state the chunks before it leave.

A chunked scan (Mamba2's SSD, Gated DeltaNet's delta rule) carries a state ``S`` along the sequence, and the state
after a span of tokens is affine in the state before it: ``S_after = M S_before + U`` (``U`` the state the span leaves
from a zero state, ``M`` the span's transition: a decay per head for SSD, a ``dk x dk`` matrix per head for the delta
rule). So a span needs from the rest of the sequence only the state before it, and that state follows from every
earlier span's ``(M, U)``, a summary of fixed size whatever the span's length.

`sharded_scan` runs a scan on this rank's chunks of a `Layout` (one chunk per rank, or zigzag's two); `scan_region` is
what the ring backend writes in a graph in place of a model's call of a known scan:

- each chunk's summary ``(U, M)`` comes from one call of the scan itself on the chunk, with the value widened by
  columns that start from the identity (zero inputs in them, so they carry ``M`` applied to the identity: ``M``),
  as the state's value columns evolve apart (`AffineScan.summary`);
- one all-gather (``ringpass::chunk_summaries``) gives every rank every chunk's summary, in sequence order; every rank
  folds them into the state before each chunk (small: ``2P - 1`` steps of the transition), keeps its own chunks'
  (``ringpass::own_heads``) and runs the scan on each chunk from it: its outputs are the unsharded scan's (up to
  rounding: the state at a chunk's start is summed in another order);
- bytes per rank per call: the summaries', ``chunks x B x H x dk x (dv + dk)`` for the delta rule,
  ``chunks x B x H x (head_dim + 1) x state`` for SSD, independent of the sequence's length;
- backward: autograd through the scans and the fold; each summary's gradient goes back to the rank whose chunk made
  it (the all-gather's backward: one all-reduce of the summaries' size; the fold's gradient reaches every summary
  on every rank, so each runs it).

Per rank, the scan runs on ``n = N / P`` tokens twice (the summary's call with the value widened, then the output's):
about ``2.5 / P`` of the unsharded scan's compute for the delta rule, ``2 / P`` for SSD, against splitting by heads'
``1 / P`` and its all-to-alls of ``O(N)`` bytes.

The scans are the model's own functions (`AffineScan`: how to call one, and which input carries the state's value
columns), so the arithmetic of each chunk is the model's: `gated_delta_rule` for the
``chunk_gated_delta_rule(query, key, value, g, beta, ...)`` signature (Hugging Face's Qwen3-Next, Qwen3.5,
OLMo-Hybrid; flash-linear-attention's), `ssd` for ``mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, ...)``'s.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lowering.groups import checked_group
from lowering.head_exchange import own_heads
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

    call: Callable  # (tokens: dict, weights: dict, initial_state | None) -> (output, final state)
    tokens: tuple[str, ...]
    value: str
    value_dim: int  # of the state [B, H, ., .]: -1 (delta rule: [B, H, dk, dv]) or -2 (SSD: [B, H, head_dim, N])
    transition_width: Callable[[torch.Tensor], int]
    transition: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (M, S) -> M applied to S
    weights: tuple[str, ...] = field(default=())

    def summary(self, tokens: dict, weights: dict, zero: torch.Tensor) -> torch.Tensor:
        """``[U | M]`` along the state's value dim: the state a chunk leaves from ``zero`` (a zero state), and its
        transition."""
        width, value = self.transition_width(zero), tokens[self.value]
        widened = dict(tokens, **{self.value: torch.cat((value, value.new_zeros((*value.shape[:-1], width))), -1)})
        _, final = self.call(
            widened, weights, torch.cat((zero, _identity_columns(zero, width, self.value_dim)), self.value_dim)
        )
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


# each adapter's (per-token arguments, weights), in the order `scan_region` takes them
ARGUMENTS = {
    "delta rule": (("query", "key", "value", "g", "beta"), ()),
    "ssd": (("hidden_states", "dt", "B", "C"), ("A", "D", "dt_bias")),
}


def gated_delta_rule(function: Callable, **constants) -> AffineScan:
    """``function(query, key, value, g, beta, chunk_size=.., initial_state=.., output_final_state=..,
    use_qk_l2norm_in_kernel=..)``: ``S_t = exp(g_t) (I - beta_t k_t k_t^T) S_(t-1) + beta_t k_t v_t^T``, the state
    ``[B, H, dk, dv]``; ``constants``: its other keyword arguments as the model passes them."""

    def call(tokens, weights, initial_state):
        return function(**tokens, initial_state=initial_state, output_final_state=True, **constants)

    return AffineScan(
        call=call,
        tokens=ARGUMENTS["delta rule"][0],
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
        call=call,
        tokens=ARGUMENTS["ssd"][0],
        value="hidden_states",
        value_dim=-2,
        transition_width=lambda state: 1,
        transition=torch.mul,
        weights=ARGUMENTS["ssd"][1],
    )


def sharded_scan(scan: AffineScan, tokens: dict, weights: dict, *, layout: Layout, group=None) -> torch.Tensor:
    """This rank's tokens of ``scan``'s output on the whole sequence (from a zero state): ``tokens`` are
    ``layout.shard(t, 1, rank)`` of each per-token input (by name), ``weights`` whole. Differentiable; ``group``: the
    layout's ranks (None: the default group)."""
    resolved = checked_group(group, layout.world_size)
    name = "" if resolved is None else resolved.group_name
    return scan_chunks(scan, tokens, weights, layout.kind, layout.world_size, layout.seq_len, name)


def scan_chunks(scan: AffineScan, tokens: dict, weights: dict, kind: str, world_size: int, seq_len: int, group_name):
    """`sharded_scan` with the layout spelled as the compiled graph spells it (kind, P, N, the group's name). The rank
    is read only inside ops when they run (``chunk_summaries``, ``own_heads``), so every rank traces the same graph."""
    layout = cached_layout(kind, world_size, seq_len)
    per_chunk = [dict(zip(tokens, parts)) for parts in zip(*(t.split(layout.chunk_len, 1) for t in tokens.values()))]
    zero = zero_state(scan, per_chunk[0], weights)
    summaries = torch.stack([scan.summary(chunk, weights, zero) for chunk in per_chunk])
    every = chunk_summaries(summaries, kind, world_size, seq_len, group_name)  # every chunk's, in sequence order
    starts, state = [zero], zero
    for summary in every[:-1]:  # the state before each chunk
        state = scan.advance(summary, state)
        starts.append(state)
    by_rank = torch.tensor([c for r in range(world_size) for c in layout.chunks(r)], device=zero.device)
    mine = own_heads(torch.stack(starts).index_select(0, by_rank), 0, world_size, group_name)  # local order
    return torch.cat([scan.call(chunk, weights, start)[0] for chunk, start in zip(per_chunk, mine)], 1)


def zero_state(scan: AffineScan, chunk: dict, weights: dict) -> torch.Tensor:
    """A zero state of the scan's shape and dtype (its function's final state after one token; a compiled graph keeps
    no trace of that call, as nothing reads its values)."""
    _, final = scan.call({name: t[:, :1] for name, t in chunk.items()}, weights, None)
    return torch.zeros(final.shape, dtype=final.dtype, device=final.device)


ADAPTERS = {"delta rule": gated_delta_rule, "ssd": ssd}


def scan_region(
    adapter: str,
    module: str,
    function: str,
    constants: tuple,
    tokens: list,
    weights: list,
    kind: str,
    world_size: int,
    seq_len: int,
    group_name: str,
) -> torch.Tensor:
    """What the ring backend writes in place of a model's call of a known scan (`ringpass.passes.pass_scan_states`):
    ``module.function`` (imported by name) as ``ADAPTERS[adapter]`` with its keyword ``constants`` (name, value pairs),
    on this rank's ``tokens`` and the whole ``weights`` (in the adapter's order; None where the call passed none)."""
    scan = scan_for(adapter, module, function, constants)
    return scan_chunks(
        scan, dict(zip(scan.tokens, tokens)), dict(zip(scan.weights, weights)), kind, world_size, seq_len, group_name
    )


def summary_nbytes(adapter: str, module: str, function: str, constants: tuple, tokens: dict, weights: dict) -> int:
    """Bytes of one chunk's summary of `scan_region`'s scan (any chunk's: its size does not depend on the length)."""
    scan = scan_for(adapter, module, function, constants)
    first = {name: t[:, :1] for name, t in tokens.items()}
    summary = scan.summary(first, weights, zero_state(scan, first, weights))
    return summary.numel() * summary.element_size()


@functools.cache
def scan_for(adapter: str, module: str, function: str, constants: tuple) -> AffineScan:
    """``module.function`` (imported by name) as ``ADAPTERS[adapter]`` with its keyword ``constants``."""
    return ADAPTERS[adapter](getattr(importlib.import_module(module), function), **dict(constants))
