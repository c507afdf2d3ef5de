"""The all-gather alternative to the ring (the Llama-3 recipe): ``ring_attention(..., strategy="all-gather")``.

Each rank gathers every rank's K/V block at once (one all-gather, nothing overlapped), attends with its own
queries to all of them with the ring's own block kernels and plan (`lowering.ring.RankForward`), and in the
backward gathers K/V again, computes every block's dK/dV contribution and reduce-scatters them to their owners.
It moves the same bytes as the ring but holds the whole K/V on every rank (P blocks instead of two) and exposes
all of its communication; where the link is slow against the compute the ring hides it and wins, where the
sequence is short the one collective beats P - 1 ring steps (``strategy="auto"`` weighs both: `lowering.costmodel`).
A call in which no rank needs another's block (packed documents each whole on one rank: `lowering.ring.RingSpec.hops`
all 0) gathers nothing: the op runs the ring's lap instead, which sends nothing (the local pass).
`gathered_forward` and `gathered_backward` keep `lowering.ring.ring_forward`'s and ``ring_backward``'s contracts,
so the ring op runs either; the collectives and the compute are profiler ranges and ``span`` events as the
ring's steps are (``ringpass bench`` reads them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from lowering.failures import wait_collective
from lowering.ring import RankBackward, RankForward, RingSpec, span

# torch 2.13 renamed the tensor collectives (the old names still work, with a warning)
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def gathered_forward(q, k, v, spec: RingSpec, group):
    """This rank's (out, lse) of exact full-sequence attention, every K/V block gathered at once."""
    blocks = _gather_blocks(k, v, group, "forward")
    state = RankForward(q, spec, dist.get_rank(group))
    with span("forward", 0, "compute"):
        for kv_rank, block in enumerate(blocks):
            state.add_block(block[0], block[1], kv_rank)
    del blocks  # the backward gathers again rather than holding every block until then
    return state.result()


def gathered_backward(dout, q, k, v, out, lse, dlse, spec: RingSpec, group, trained: Sequence[Sequence[bool]] = ()):
    """(dq, dk, dv, the trained program inputs' gradients), as `lowering.ring.ring_backward` gives them."""
    blocks = _gather_blocks(k, v, group, "backward")
    state = RankBackward(dout, q, out, lse, dlse, spec, dist.get_rank(group), trained)
    with span("backward", 0, "compute"):
        grads = torch.cat([state.block_grads(block[0], block[1], kv_rank) for kv_rank, block in enumerate(blocks)])
    del blocks
    mine = grads.new_empty((2, *grads.shape[1:]))
    with span("backward", 0, "wait", "dkv reduce-scatter"):
        work = reduce_scatter_into(mine, grads, group=group, async_op=True)
        wait_collective(work, mine, group.group_name, "the reduce-scatter of the all-gathered blocks' dK/dV")
    # copies: dk and dv must not be views of one buffer (custom ops may not return aliases)
    return state.dq.to(q.dtype), mine[0].to(k.dtype, copy=True), mine[1].to(v.dtype, copy=True), state.program_results()


def _gather_blocks(k, v, group, phase: str) -> torch.Tensor:
    """``[P, 2, B, Hkv, n, D]``: every rank's stacked K/V block, in rank order."""
    kv = torch.stack((k, v))
    p = dist.get_world_size(group)
    blocks = kv.new_empty((p * kv.size(0), *kv.shape[1:]))  # the collectives concatenate along dim 0
    with span(phase, 0, "wait", "kv all-gather"):
        work = all_gather_into(blocks, kv, group=group, async_op=True)
        wait_collective(work, blocks, group.group_name, f"the {phase} all-gather of every rank's K/V block")
    return blocks.view(p, *kv.shape)
