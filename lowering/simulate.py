"""A P-rank ring run in one process: every rank's schedule, the same block compute and merge.

The simulation moves KV blocks by indexing instead of sending them, and is otherwise the ring itself
(`lowering.ring`'s per-rank state), so it tests the schedule without processes and measures kernels and
balance on one device. Inputs and results are full (unsharded) tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lowering.layout import Layout
from lowering.masks import BlockMask, document_ids
from lowering.op import check_inputs, default_scale
from lowering.ring import RankBackward, RankForward, RingSpec
from lowering.schedule import kv_source
from lowering.scores import ScoreMod


@dataclass
class SimulatedRing:
    """Full-sequence results of a simulated ring (``dq``/``dk``/``dv`` only when ``dout`` was given;
    ``program_grads``: the gradients of the mask and bias programs' inputs that require grad, mask inputs
    first, summed over the ranks as the graph's gradient reduction sums them)."""

    out: torch.Tensor
    lse: torch.Tensor
    dq: torch.Tensor | None = None
    dk: torch.Tensor | None = None
    dv: torch.Tensor | None = None
    program_grads: list | None = None


def simulate_ring(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: Layout,
    is_causal: bool = False,
    scale: float | None = None,
    dout: torch.Tensor | None = None,
    window: int | None = None,
    mask: Callable | None = None,
    mask_inputs: Sequence[torch.Tensor] = (),
    softcap: float | None = None,
    alibi_slopes: Sequence[float] | None = None,
    bias: Callable | None = None,
    bias_inputs: Sequence[torch.Tensor] = (),
    fully_masked: str = "zero",
    documents: torch.Tensor | None = None,
) -> SimulatedRing:
    """Run the ring's forward (and, given ``dout``, backward) lap for every rank of ``layout``.

    q ``[B, Hq, N, D]``, k/v ``[B, Hkv, N, D]`` with N = ``layout.seq_len``; ``window``, ``mask``,
    ``mask_inputs``, the score modifiers (``softcap``, ``alibi_slopes``, ``bias``, ``bias_inputs``),
    ``fully_masked`` and ``documents`` as in `lowering.ring_attention`.
    """
    p = layout.world_size
    if documents is not None:
        documents = document_ids((documents,), layout.seq_len, q.size(0))
    block_mask = (
        BlockMask(is_causal, window, mask, tuple(mask_inputs), documents)
        if window is not None or mask is not None or documents is not None
        else None
    )
    scores = ScoreMod(
        softcap, None if alibi_slopes is None else tuple(float(s) for s in alibi_slopes), bias, tuple(bias_inputs)
    )
    spec = RingSpec(
        layout, is_causal, default_scale(q) if scale is None else float(scale), block_mask, scores, fully_masked
    )
    qs, ks, vs = ([layout.shard(t, 2, r) for r in range(p)] for t in (q, k, v))
    check_inputs(qs[0], ks[0], vs[0], layout)

    forward = [RankForward(qs[r], spec, r) for r in range(p)]
    for step in range(p):
        for r in range(p):
            src = kv_source(r, step, p)
            forward[r].add_block(ks[src], vs[src], src)
    outs, lses = zip(*(f.result() for f in forward))
    result = SimulatedRing(layout.unshard(outs, 2), layout.unshard(lses, 2))
    if dout is None:
        return result

    douts = [layout.shard(dout, 2, r) for r in range(p)]
    trained = [[t.requires_grad for t in inputs] for _, inputs in spec.programs()]
    backward = [RankBackward(douts[r], qs[r], outs[r], lses[r], None, spec, r, trained) for r in range(p)]
    dkvs = [None] * p
    for step in range(p):
        for r in range(p):
            src = kv_source(r, step, p)
            grads = backward[r].block_grads(ks[src], vs[src], src)
            dkvs[src] = grads if dkvs[src] is None else dkvs[src] + grads
    result.dq = layout.unshard([b.dq.to(q.dtype) for b in backward], 2)
    result.dk = layout.unshard([d[0].to(k.dtype) for d in dkvs], 2)
    result.dv = layout.unshard([d[1].to(v.dtype) for d in dkvs], 2)
    result.program_grads = [sum(shares) for shares in zip(*(b.program_results() for b in backward))]
    return result
