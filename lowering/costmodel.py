"""What one ring attention costs, counted from the layout, without running it.

For a layout and an attention's shape, `ring_cost` gives what each rank does at each ring step (the
planner's word for the block: ``diagonal``, ``full``, ``partial`` or ``skipped``), the (query, key) pairs
it scores there, the forward FLOPs those pairs take, the bytes that travel per hop, and the bytes one rank
holds for the attention's state, next to the same attention run unsharded (P = 1). Everything is counted
from global positions (`Layout.segments`), independently of the planner's rectangles.

Conventions (docs/inspect.md):
- FLOPs are useful FLOPs: ``4 · B · Hq · D`` per visible (query, key) pair forward (q·kᵀ and p·v, a
  multiply-add each); the backward does 2.5 times that (it recomputes the scores).
- A hop moves one KV block, ``2 · B · Hkv · n · D · itemsize`` (n = slots per rank, padding included);
  the backward also moves the dK/dV accumulators, in the accumulation dtype (fp32; fp64 for fp64 inputs).
- Attention state per rank, forward: q, k, v, the stacked KV block and the one arriving, the fp32 output
  and LSE accumulators and the returned output. Backward adds dout, dq (accumulation dtype), the dK/dV
  accumulators (one computed, one arriving) and the returned gradients. Unsharded: q, k, v, out, lse
  forward; plus dout, dq, dk, dv backward (a fused kernel's workspace not counted on either side).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional

from lowering.layout import Layout
from lowering.schedule import kv_source

BACKWARD_FLOPS_RATIO = 2.5


@dataclass(frozen=True)
class AttentionShape:
    """The sizes one attention runs at: batch, query and key/value heads, head dim, element size, mask."""

    batch: int
    query_heads: int
    kv_heads: int
    head_dim: int
    itemsize: int
    is_causal: bool = False
    window: Optional[int] = None

    @property
    def accumulation_itemsize(self) -> int:
        return 8 if self.itemsize == 8 else 4


@dataclass(frozen=True)
class RingCost:
    layout: Layout
    shape: AttentionShape

    @property
    def kv_bytes_per_hop(self) -> int:
        s = self.shape
        return 2 * s.batch * s.kv_heads * self.layout.local_len * s.head_dim * s.itemsize

    @property
    def dkv_bytes_per_hop(self) -> int:
        return self.kv_bytes_per_hop // self.shape.itemsize * self.shape.accumulation_itemsize

    @property
    def exchanges(self) -> dict[str, int]:
        """Messages each rank sends per call: KV blocks forward; KV blocks and dK/dV accumulators backward."""
        p = self.layout.world_size
        return {"forward_kv": p - 1, "backward_kv": p - 1, "backward_dkv": p if p > 1 else 0}

    @cached_property
    def schedule(self) -> list[list[str]]:
        """``[rank][step]``: ``diagonal`` (a rank's own block under a causal mask), ``full`` (every pair
        visible), ``partial`` or ``skipped`` (none visible: nothing is computed), from the visible pairs.
        Without a window these are the planner's words (`lowering.schedule.schedule_table`)."""
        p = self.layout.world_size
        words = []
        for r in range(p):
            row = []
            for step in range(p):
                kv_rank, pairs = kv_source(r, step, p), self.pairs[r][step]
                area = self.layout.valid_len(r) * self.layout.valid_len(kv_rank)
                row.append("skipped" if pairs == 0 else "diagonal" if self.shape.is_causal and kv_rank == r
                           else "full" if pairs == area else "partial")
            words.append(row)
        return words

    @cached_property
    def pairs(self) -> list[list[int]]:
        """``[rank][step]``: visible (query, key) pairs rank ``rank`` scores at ring step ``step``."""
        p = self.layout.world_size
        return [[self._block_pairs(r, kv_source(r, step, p)) for step in range(p)] for r in range(p)]

    @property
    def flops_forward(self) -> list[list[int]]:
        """``[rank][step]``: useful forward FLOPs (4 · B · Hq · D per visible pair)."""
        per_pair = 4 * self.shape.batch * self.shape.query_heads * self.shape.head_dim
        return [[per_pair * n for n in row] for row in self.pairs]

    def memory(self, unsharded: bool = False) -> dict[str, int]:
        """Bytes of attention state one rank holds, ``forward`` and ``backward`` (see the module's notes);
        ``unsharded=True``: the same attention run whole on one device (P = 1)."""
        s, a = self.shape, self.shape.accumulation_itemsize
        n = self.layout.seq_len if unsharded else self.layout.local_len
        q = s.batch * s.query_heads * n * s.head_dim
        kv = s.batch * s.kv_heads * n * s.head_dim
        rows = s.batch * s.query_heads * n
        if unsharded:
            forward = (2 * q + 2 * kv) * s.itemsize + rows * 4
            backward = forward + (2 * q + 2 * kv) * s.itemsize  # dout, dq, dk, dv
        else:
            forward = (2 * q + 6 * kv) * s.itemsize + (q + rows) * a  # q, out, k, v, stacked, arriving; acc
            backward = (3 * q + 6 * kv) * s.itemsize + rows * a + q * a + 4 * kv * a + (q + 2 * kv) * s.itemsize
        return {"forward": forward, "backward": backward}

    def _block_pairs(self, q_rank: int, kv_rank: int) -> int:
        return sum(
            _pairs(q.global_start, q.global_stop, k.global_start, k.global_stop, self.shape.is_causal, self.shape.window)
            for q in self.layout.segments(q_rank) for k in self.layout.segments(kv_rank)
        )


def ring_cost(layout: Layout, shape: AttentionShape) -> RingCost:
    return RingCost(layout, shape)


def _pairs(q_start: int, q_stop: int, k_start: int, k_stop: int, is_causal: bool, window: Optional[int]) -> int:
    """Visible (query, key) pairs between positions [q_start, q_stop) and [k_start, k_stop), in closed form.
    Causal: query q sees keys [k_start, min(k_stop, q + 1)); a window W hides the keys a query W positions
    later would see, so the count is ``seen(q) - seen(q - W)``."""
    if not is_causal:
        return (q_stop - q_start) * (k_stop - k_start)

    def seen(first: int, stop: int) -> int:  # sum over q in [first, stop) of |[k_start, min(k_stop, q + 1))|
        total = 0
        low, high = max(first, k_start), min(stop, k_stop)  # keys still arriving: q + 1 - k_start each
        if low < high:
            total += ((high - k_start) * (high - k_start + 1) - (low - k_start) * (low - k_start + 1)) // 2
        low = max(first, k_stop)  # every key already seen
        if low < stop:
            total += (stop - low) * (k_stop - k_start)
        return total

    pairs = seen(q_start, q_stop)
    return pairs - seen(q_start - window, q_stop - window) if window is not None else pairs
