"""What one ring attention costs, counted from the layout, without running it.

For a layout and an attention's shape, `ring_cost` gives what each rank does at each ring step (the
planner's word for the block: ``diagonal``, ``full``, ``partial`` or ``skipped``), the (query, key) pairs
it scores there, the forward FLOPs those pairs take, the bytes that travel per hop, and the bytes one rank
holds for the attention's state, next to the same attention run unsharded (P = 1). Everything is counted
from global positions (`Layout.segments`), independently of the planner's rectangles.

On given `Hardware` (a link's bandwidth and latency, the FLOP rate one rank's kernel reaches; presets
`LINKS`, `DEVICES`), `predict` gives each step's compute and transfer time and whether the transfer hides,
`hiding_slice` the fewest tokens per rank at which it does, and `all_gather_seconds` the alternative's
forward time (`ringpass plan` prints them and recommends); `ulysses_seconds` the same attention as Ulysses x
ring (all-to-all over heads on the fast links inside groups, the ring over the slow ones). `choose_strategies`
picks, per attention, the fastest predicted of these and of no sequence parallelism (``strategy="auto"``). A decode step
(`DecodeCost`, `decode_seconds`): every rank reads its part of the cache (memory-bound: `MEMORY` presets) and
the ranks merge their out and LSE in one small all-gather.

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

import math
from dataclasses import dataclass
from functools import cached_property

from lowering.documents import DocumentLayout
from lowering.layout import DOCUMENTS_KIND, GroupLayout, Layout
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
    window: int | None = None

    @property
    def accumulation_itemsize(self) -> int:
        return 8 if self.itemsize == 8 else 4

    def elements(self, tokens: int) -> tuple[int, int, int]:
        """Elements of q (and out), of one of k / v, and of the LSE, for ``tokens`` tokens."""
        return (
            self.batch * self.query_heads * tokens * self.head_dim,
            self.batch * self.kv_heads * tokens * self.head_dim,
            self.batch * self.query_heads * tokens,
        )


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
                row.append(
                    "skipped"
                    if pairs == 0
                    else "diagonal"
                    if self.shape.is_causal and kv_rank == r
                    else "full"
                    if pairs == area
                    else "partial"
                )
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
        q, kv, rows = self.shape.elements(self.layout.seq_len if unsharded else self.layout.local_len)
        if unsharded:
            forward = (2 * q + 2 * kv) * s.itemsize + rows * 4
            backward = forward + (2 * q + 2 * kv) * s.itemsize  # dout, dq, dk, dv
        else:
            forward = (2 * q + 6 * kv) * s.itemsize + (q + rows) * a  # q, out, k, v, stacked, arriving; acc
            backward = (3 * q + 6 * kv) * s.itemsize + rows * a + q * a + 4 * kv * a + (q + 2 * kv) * s.itemsize
        return {"forward": forward, "backward": backward}

    def working_memory(self) -> dict[str, int]:
        """Bytes one rank needs beyond its inputs (q, k, v and the output gradient): what the algorithm
        itself must hold, the yardstick ``ringpass bench`` puts next to measured memory. ``forward``: the
        out and LSE accumulators and two KV blocks (the one in use and the one arriving); ``backward``
        (the whole call's peak): the saved out and LSE, the dq accumulator, the dK/dV accumulators, two KV
        blocks, and the returned dk, dv (and dq, out in the input dtype when
        that is narrower than the accumulators). Three dK/dV accumulators: the one computed, the one
        arriving and the one leaving (a send buffer stays intact until the neighbour has it), which an
        overlapped backward holds at once."""
        s, a = self.shape, self.shape.accumulation_itemsize
        q, kv, rows = self.shape.elements(self.layout.local_len)
        narrow = q * s.itemsize if s.itemsize < a else 0  # the result cast to the input dtype
        forward = q * a + rows * a + 2 * 2 * kv * s.itemsize + narrow
        backward = (
            q * s.itemsize + rows * a + q * a + 3 * 2 * kv * a + 2 * 2 * kv * s.itemsize + 2 * kv * s.itemsize + narrow
        )
        return {"forward": forward, "backward": backward}

    def _block_pairs(self, q_rank: int, kv_rank: int) -> int:
        return sum(
            _pairs(
                q.global_start, q.global_stop, k.global_start, k.global_stop, self.shape.is_causal, self.shape.window
            )
            for q in self.layout.segments(q_rank)
            for k in self.layout.segments(kv_rank)
        )


def ring_cost(layout: Layout, shape: AttentionShape) -> RingCost:
    return RingCost(layout, shape)


def _pairs(q_start: int, q_stop: int, k_start: int, k_stop: int, is_causal: bool, window: int | None) -> int:
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


# ---- time: what a ring step takes on given hardware ---------------------------------------------------------
@dataclass(frozen=True)
class Hardware:
    """A link between neighbouring ranks (bytes per second one way, seconds of latency per message) and the
    rate one rank's attention kernel reaches (FLOP/s), each with where the number comes from."""

    link_bytes_per_s: float
    link_latency_s: float
    flops_per_s: float
    link: str = "custom"
    device: str = "custom"
    memory_bytes_per_s: float | None = None  # how fast one rank reads its memory (a decode step's bound)
    # the rest of a training step (`ringpass.planning.model_plan`): matrix products outside attention (None:
    # flops_per_s) and the fixed cost of launching one op
    gemm_flops_per_s: float | None = None
    op_overhead_s: float = 0.0
    # the model's own attention kernel on a whole sequence (strategy "none"; None: flops_per_s, as on a GPU, where
    # both are flash kernels)
    sdpa_flops_per_s: float | None = None
    # both attentions' rates by head dim as measured (`ringpass bench --calibrate`): (head dim, the ring's compute
    # FLOP/s, the model's SDPA FLOP/s); empty: flops_per_s and sdpa_flops_per_s at every head dim
    head_dim_rates: tuple[tuple[int, float, float], ...] = ()

    def attention_flops_per_s(self, head_dim: int, kernel: str = "ring") -> float:
        """The rate of the ring's compute (``kernel="ring"``) or of the model's own SDPA (``"sdpa"``) at
        ``head_dim``: from `head_dim_rates`, linear in log2(head dim) between the measured head dims and the nearest
        one's outside them; without them, `flops_per_s` (`sdpa_flops_per_s` for SDPA, where given)."""
        column = 1 if kernel == "ring" else 2
        if not self.head_dim_rates:
            return self.flops_per_s if kernel == "ring" else self.sdpa_flops_per_s or self.flops_per_s
        points = sorted((math.log2(row[0]), row[column]) for row in self.head_dim_rates)
        x = math.log2(head_dim)
        if x <= points[0][0]:
            return points[0][1]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if x <= x1:
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        return points[-1][1]


LINKS = {  # name: (bytes/s one way, latency per message in s, source)
    "nvlink": (450e9, 10e-6, "NVLink 4 (H100/H200 SXM): 900 GB/s both ways, nominal"),
    "infiniband": (50e9, 20e-6, "InfiniBand NDR, 400 Gb/s per port, nominal"),
    "pcie": (25e9, 15e-6, "PCIe 4.0 x16, ~25 GB/s achieved of 32 nominal"),
    "loopback": (
        1.19e9,
        0.25e-3,
        "gloo on 127.0.0.1 on the 2-core dev machine: `ringpass bench --calibrate`, "
        "messages of 256 KiB-64 MiB, 2026-12-01",
    ),
}
DEVICES = {  # name: (attention FLOP/s one rank reaches, source)
    "h100": (600e12, "H100/H200 SXM: 989 dense bf16 TFLOP/s peak, ~60% in flash attention"),
    "a100": (190e12, "A100: 312 dense bf16 TFLOP/s peak, ~60% in flash attention"),
    "cpu": (
        78.5e9,
        "the 2-core dev machine, one thread per rank: the block kernel forward+backward, "
        "`ringpass bench --calibrate`, 2026-12-01",
    ),
}


MEMORY = {  # name: (bytes/s one rank reads from its memory, source)
    "h100": (3.35e12, "H100 SXM HBM3, nominal (H200: 4.8e12)"),
    "a100": (2.0e12, "A100 80GB HBM2e, nominal"),
    "cpu": (
        3.8e9,
        "the 2-core dev machine, one thread: SDPA of one query over a 64 and a 256 MiB fp32 cache "
        "(3.79, 3.84 GB/s), `ringpass bench --what decode`, 2026-12-02",
    ),
}


OTHER_WORK = {  # name: (matrix-product FLOP/s outside attention, seconds per op launched, source)
    "h100": (700e12, 5e-6, "H100/H200 SXM: ~70% of 989 dense bf16 TFLOP/s in large GEMMs; ~5 us per eager launch"),
    "a100": (220e12, 5e-6, "A100: ~70% of 312 dense bf16 TFLOP/s in large GEMMs; ~5 us per eager launch"),
    "cpu": (
        70e9,
        2e-6,
        "the 2-core dev machine, one thread per rank, both ranks at once: fp32 mm of 4096 x 256 by 256 x 1024 and "
        "4096 x 1024 by 1024 x 256, 2000 adds of one element; five `ringpass bench --calibrate` runs, 2026-12-03: "
        "68-84 GFLOP/s, 1.7-3.6 us",
    ),
}


@dataclass(frozen=True)
class Prediction:
    """Per ring step of the busiest rank: ``compute`` and ``transfer`` seconds, forward and backward; the
    totals with the transfer overlapped (a step lasts the longer of the two; the last step sends nothing
    but, in the backward, the last dK/dV accumulator, ``final_hop``, whose trip home nothing can hide)."""

    compute_forward: list[float]
    compute_backward: list[float]
    transfer_forward: float
    transfer_backward: float
    final_hop: float = 0.0

    @property
    def forward_s(self) -> float:
        return _overlapped(self.compute_forward, self.transfer_forward)

    @property
    def backward_s(self) -> float:
        return _overlapped(self.compute_backward, self.transfer_backward) + self.final_hop

    @property
    def hides(self) -> bool:
        """Every transfer fits under the compute of the step it overlaps, forward and backward."""
        return all(c >= self.transfer_forward for c in self.compute_forward[:-1]) and all(
            c >= self.transfer_backward for c in self.compute_backward[:-1]
        )


def predict(cost: RingCost, hardware: Hardware) -> Prediction:
    """The ring's time on ``hardware``: each step as long as the busiest rank's compute there."""
    steps = cost.layout.world_size
    rate = hardware.attention_flops_per_s(cost.shape.head_dim)
    busiest = [max(cost.flops_forward[r][step] for r in range(steps)) / rate for step in range(steps)]
    hop = hardware.link_latency_s + cost.kv_bytes_per_hop / hardware.link_bytes_per_s
    backward_hop = hop + cost.dkv_bytes_per_hop / hardware.link_bytes_per_s  # a KV block and its dK/dV travel together
    final_hop = hardware.link_latency_s + cost.dkv_bytes_per_hop / hardware.link_bytes_per_s if steps > 1 else 0.0
    return Prediction(busiest, [t * BACKWARD_FLOPS_RATIO for t in busiest], hop, backward_hop, final_hop)


def all_gather_seconds(cost: RingCost, hardware: Hardware, *, backward: bool = False) -> float:
    """Time of the all-gather alternative (`lowering.all_gather`: each rank gathers every K/V block, then
    attends with its own queries): the gather (P-1 blocks, not overlapped) and then this rank's whole
    compute; ``backward=True``: the backward's time (gather again, compute, reduce-scatter the dK/dV of P-1
    blocks)."""
    p = cost.layout.world_size
    gather = (p - 1) * (hardware.link_latency_s + cost.kv_bytes_per_hop / hardware.link_bytes_per_s)
    compute = max(sum(row) for row in cost.flops_forward) / hardware.attention_flops_per_s(cost.shape.head_dim)
    if not backward:
        return gather + compute
    scatter = (p - 1) * (hardware.link_latency_s + cost.dkv_bytes_per_hop / hardware.link_bytes_per_s)
    return gather + compute * BACKWARD_FLOPS_RATIO + scatter


def hiding_slice(shape: AttentionShape, hardware: Hardware) -> int:
    """The fewest tokens per rank at which a step's compute covers its KV transfer: a block of n queries
    against n keys scores n² pairs (half of them under a causal zigzag layout) at 4·B·Hq·D FLOPs each,
    while the hop moves 2·B·Hkv·n·D·itemsize bytes after the link's latency."""
    visible = 0.5 if shape.is_causal else 1.0
    a = visible * 4 * shape.batch * shape.query_heads * shape.head_dim / hardware.attention_flops_per_s(shape.head_dim)
    b = 2 * shape.batch * shape.kv_heads * shape.head_dim * shape.itemsize / hardware.link_bytes_per_s
    return math.ceil((b + math.sqrt(b * b + 4 * a * hardware.link_latency_s)) / (2 * a))


def ulysses_seconds(
    shape: AttentionShape, layout: Layout, ulysses: int, ring_link: Hardware, fast_link: Hardware
) -> dict:
    """Ulysses x ring (`lowering.ulysses`) with groups of ``ulysses`` ranks over ``fast_link``, the ring across the
    groups over ``ring_link``: forward and backward seconds of the all-to-alls (q, k, v and the output forward;
    their gradients backward; each moves (U-1)/U of a rank's tensor, not overlapped) and of the ring (R = P/U
    steps of U-times longer blocks with 1/U of the heads, `predict`). KV heads fewer than U are repeated to U."""
    per_rank = ulysses_shape(shape, ulysses)
    ring = predict(ring_cost(GroupLayout(layout, ulysses), per_rank), ring_link)
    elements = (
        shape.batch * layout.local_len * shape.head_dim * 2 * (per_rank.query_heads + per_rank.kv_heads) * ulysses
    )
    moved = elements * shape.itemsize * (ulysses - 1) / ulysses
    exchange = 4 * fast_link.link_latency_s + moved / fast_link.link_bytes_per_s
    return {
        "all_to_all_forward": exchange,
        "all_to_all_backward": exchange,
        "ring_forward": ring.forward_s,
        "ring_backward": ring.backward_s,
        "forward": exchange + ring.forward_s,
        "backward": exchange + ring.backward_s,
        "hides": ring.hides,
    }


def ulysses_shape(shape: AttentionShape, ulysses: int) -> AttentionShape:
    """What one rank's ring runs on with Ulysses groups of ``ulysses`` ranks: 1/U of the query heads, and of the
    KV heads after those fewer than U are repeated (`lowering.ulysses.check_heads`)."""
    from lowering.ulysses import check_heads

    repeat = check_heads(shape.query_heads, shape.kv_heads, ulysses)
    return AttentionShape(
        shape.batch,
        shape.query_heads // ulysses,
        shape.kv_heads * repeat // ulysses,
        shape.head_dim,
        shape.itemsize,
        shape.is_causal,
        shape.window,
    )


def _overlapped(compute: list[float], transfer: float) -> float:
    return sum(max(c, transfer) for c in compute[:-1]) + compute[-1]


# ---- decode: a few new queries against a KV cache ---------------------------------------------------------------
@dataclass(frozen=True)
class DecodeCost:
    """One decode attention: ``queries`` new tokens (replicated) against a cache of ``cache_len`` positions
    that ``world_size`` ranks hold a part of each (``slots``: ceil(cache_len / P), the busiest rank), as
    `lowering.decode_attention` runs it; ``world_size=1``: the whole cache on one device (unsharded, or every
    rank holding all of it)."""

    shape: AttentionShape
    cache_len: int
    world_size: int
    queries: int = 1

    @property
    def slots(self) -> int:
        return -(-self.cache_len // self.world_size)

    @property
    def flops(self) -> int:
        """The busiest rank's FLOPs: every query against each of its slots."""
        return 4 * self.shape.batch * self.shape.query_heads * self.shape.head_dim * self.queries * self.slots

    @property
    def cache_bytes(self) -> int:
        """Keys and values one rank holds, and reads once per step."""
        return 2 * self.shape.batch * self.shape.kv_heads * self.slots * self.shape.head_dim * self.shape.itemsize

    @property
    def merge_bytes(self) -> int:
        """Each rank's out and LSE in the merge's all-gather, ``B·Hq·t·(D+1)`` in the accumulation dtype."""
        s = self.shape
        return s.batch * s.query_heads * self.queries * (s.head_dim + 1) * s.accumulation_itemsize


def decode_seconds(cost: DecodeCost, hardware: Hardware) -> dict:
    """A decode attention's time on ``hardware``: ``compute`` (the slower of its FLOPs at the kernel's rate
    and reading its cache at the memory's rate, when that is known), ``merge`` (the all-gather: P - 1
    messages of every rank's out and LSE, one after another) and their sum, ``total``."""
    compute = cost.flops / hardware.attention_flops_per_s(cost.shape.head_dim)
    if hardware.memory_bytes_per_s:
        compute = max(compute, cost.cache_bytes / hardware.memory_bytes_per_s)
    p = cost.world_size
    merge = (p - 1) * (hardware.link_latency_s + cost.merge_bytes / hardware.link_bytes_per_s) if p > 1 else 0.0
    return {"compute": compute, "merge": merge, "total": compute + merge}


# ---- strategies: the exact ways to run one attention over P ranks, and the cheapest ---------------------------
@dataclass(frozen=True)
class ScanCost:
    """One call of a chunked scan as the cost model sees it (docs/backend.md, "Chunked scans"): the (FLOPs, bytes
    read and written) of each op of its forward on the whole sequence, every head (``heads_ops``: split by heads, each
    runs on 1/P of them), and of one rank's forward passing the state (``state_ops``: its chunks' summaries and
    outputs); the buffers a rank hands to the collectives split by heads (``heads_bytes``: its tokens of the inputs,
    its heads of the output, the inputs without heads gathered; forward, and as many backward) and every chunk's
    summary passing the state (``summaries_bytes``: all-gathered forward, their gradients all-reduced backward)."""

    heads_ops: tuple[tuple[int, int], ...]
    state_ops: tuple[tuple[int, int], ...]
    heads_bytes: int
    summaries_bytes: int


def scan_seconds(cost: ScanCost, world_size: int, hardware: Hardware) -> dict[str, float]:
    """Predicted forward + backward seconds of one scan call split by heads (``"heads"``) and passing the state
    (``"state"``): each op the longer of its FLOPs at the GEMM rate and its bytes at the memory rate, plus one launch
    (the backward three times the forward's work, two launches per op), and the collectives ((P-1)/P of each buffer
    crosses the link, a latency per message: four all-to-alls, against an all-gather and an all-reduce)."""
    gemm, memory = hardware.gemm_flops_per_s or hardware.flops_per_s, hardware.memory_bytes_per_s

    def ops_seconds(ops, share: float) -> float:
        work = sum(max(f * share / gemm, m * share / memory if memory else 0.0) for f, m in ops)
        return 3 * work + 3 * len(ops) * hardware.op_overhead_s

    crossing = (world_size - 1) / world_size / hardware.link_bytes_per_s
    heads = ops_seconds(cost.heads_ops, 1 / world_size) + 2 * cost.heads_bytes * crossing
    state = ops_seconds(cost.state_ops, 1.0) + 3 * cost.summaries_bytes * crossing  # an all-reduce: twice the bytes
    return {"heads": heads + 4 * hardware.link_latency_s, "state": state + 2 * hardware.link_latency_s}


@dataclass(frozen=True)
class Strategy:
    """One exact way to run an attention over P ranks: ``ring`` (K/V passed around, transfers overlapped),
    ``ulysses`` (all-to-all over heads in groups of ``ulysses`` ranks, the ring across the groups), ``all-gather``
    (K/V gathered at once) in the graph's ``layout``; or ``none`` (no sequence parallelism: every rank runs the
    attention whole)."""

    kind: str
    layout: str = ""
    ulysses: int = 1

    def __str__(self) -> str:
        if self.kind == "none":
            return "none"
        if self.kind == "ulysses":
            return f"ulysses {self.ulysses} ({self.layout})"
        return f"{self.kind} ({self.layout})"


PREFERENCE = ("ring", "ulysses", "all-gather", "none")  # on equal predicted times: the ring holds the least


def strategy_seconds(
    strategy: Strategy, shape: AttentionShape, seq_len: int, world_size: int, hw: Hardware, *, backward: bool = True
) -> float:
    """The predicted seconds of one attention call (forward, plus its backward with ``backward``) by ``strategy``
    over ``world_size`` ranks on ``hw`` (a Ulysses group's all-to-alls over the same link; ``none``: the model's own
    kernel on the whole sequence, at its SDPA rate, `Hardware.attention_flops_per_s`)."""
    if strategy.kind == "none":
        cost = ring_cost(Layout("contiguous", 1, seq_len), shape)
        forward = cost.flops_forward[0][0] / hw.attention_flops_per_s(shape.head_dim, kernel="sdpa")
        return forward * (1 + BACKWARD_FLOPS_RATIO * backward)
    layout = priced_layout(strategy, world_size, seq_len)
    if strategy.kind == "ulysses":
        times = ulysses_seconds(shape, layout, strategy.ulysses, hw, hw)
        return times["forward"] + backward * times["backward"]
    cost = ring_cost(layout, shape)
    if strategy.kind == "all-gather":
        return all_gather_seconds(cost, hw) + backward * all_gather_seconds(cost, hw, backward=True)
    prediction = predict(cost, hw)
    return prediction.forward_s + backward * prediction.backward_s


def strategy_memory(strategy: Strategy, shape: AttentionShape, seq_len: int, world_size: int) -> int:
    """Bytes one rank holds at the backward's peak for one attention by ``strategy`` beyond its own q, k, v and output
    gradient (`RingCost.working_memory`'s yardstick): the ring's two KV blocks and three dK/dV accumulators; the
    all-gather holds all P blocks and P dK/dV blocks before the reduce-scatter; Ulysses x ring the ring across the
    groups plus the exchanged q, k, v and output (each as large as the rank's own) and their gradients; ``none`` the
    whole attention's state."""
    if strategy.kind == "none":
        return ring_cost(Layout("contiguous", 1, seq_len), shape).memory(unsharded=True)["backward"]
    layout = priced_layout(strategy, world_size, seq_len)
    if strategy.kind == "ulysses":
        ring = ring_cost(GroupLayout(layout, strategy.ulysses), ulysses_shape(shape, strategy.ulysses))
        q, kv, _ = ring.shape.elements(layout.local_len)
        exchanged = 2 * (2 * q + 2 * kv * max(1, strategy.ulysses // shape.kv_heads)) * shape.itemsize
        return ring.working_memory()["backward"] + exchanged
    cost = ring_cost(layout, shape)
    working = cost.working_memory()["backward"]
    if strategy.kind == "all-gather":
        working += (world_size - 2) * (cost.kv_bytes_per_hop + cost.dkv_bytes_per_hop)
    return working


def priced_layout(strategy: Strategy, world_size: int, seq_len: int) -> Layout:
    """The layout ``strategy`` is priced on. The documents layout is planned per call from the packing, which a
    compile does not know: it is priced as the layout of one document over the row, its upper bound (split as zigzag
    splits it, without zigzag's padding to 2P; more documents leave each rank fewer pairs, as balanced, and the ring
    sends a block only as far as a rank needs it, never more than the lap priced here)."""
    if strategy.layout == DOCUMENTS_KIND:
        return DocumentLayout((seq_len,), world_size)
    return Layout(strategy.layout, world_size, seq_len)


def local_attention_bytes(shape: AttentionShape, tokens: int) -> int:
    """What local attention (SDPA on a rank's own ``tokens``) holds at its backward that a ring holds too: the saved
    out and LSE (in the accumulation dtype) and the returned dq, dk, dv. `ringpass.planning.model_plan` adds only a
    strategy's memory beyond it to a step that ran local attention."""
    q, kv, rows = shape.elements(tokens)
    return (2 * q + 2 * kv) * shape.itemsize + rows * shape.accumulation_itemsize


def candidate_strategies(shape: AttentionShape, world_size: int, layouts: tuple[str, ...], ulysses: bool) -> list:
    """Every `Strategy` ``shape`` can run by over ``world_size`` ranks in ``layouts``: the ring and the all-gather
    in each; Ulysses with each group size U > 1 dividing the ranks whose heads it can split (``ulysses``: the
    groups exist; not on the documents layout, which Ulysses does not run on)."""
    from lowering.errors import NotSupportedError
    from lowering.ulysses import check_heads

    found = []
    for layout in layouts:
        found += [Strategy("ring", layout), Strategy("all-gather", layout)]
        for u in range(2, world_size + 1):
            if not ulysses or world_size % u or layout == DOCUMENTS_KIND:
                continue
            try:
                check_heads(shape.query_heads, shape.kv_heads, u)
            except NotSupportedError:  # the group cannot split these heads
                continue
            found.append(Strategy("ulysses", layout, u))
    return found


@dataclass(frozen=True)
class StrategyChoice:
    """What `choose_strategies` decided for a graph: the layout, each attention's strategy, and each attention's
    predicted seconds by every alternative (``str(Strategy)`` -> seconds, ``none`` included)."""

    layout: str
    chosen: list[Strategy]
    alternatives: list[dict[str, float]]

    @property
    def unsharded(self) -> bool:
        return all(s.kind == "none" for s in self.chosen)


def choose_strategies(
    shapes: list[AttentionShape],
    seq_len: int,
    world_size: int,
    hw: Hardware,
    *,
    layouts: tuple[str, ...],
    ulysses: bool | list[bool] = True,
    none: bool = True,
    backward: bool = True,
) -> StrategyChoice:
    """The fastest predicted strategy for each attention of one graph. The layout is the graph's (activations
    between attentions are sharded in it), so it is chosen for the sum over the attentions (``layouts``: those
    allowed, the preferred first: it wins ties); ``none`` holds for the whole graph or for no attention: it is
    chosen when running every attention whole beats the best sharded total (``none=False``: not allowed).
    ``ulysses``: whether Ulysses x ring may run the attentions (one flag for all, or one per attention)."""
    alternatives, best_per_layout = [], {layout: [] for layout in layouts}
    allowed = ulysses if isinstance(ulysses, list) else [ulysses] * len(shapes)
    for shape, may_ulysses in zip(shapes, allowed):
        times = {
            s: strategy_seconds(s, shape, seq_len, world_size, hw, backward=backward)
            for s in candidate_strategies(shape, world_size, layouts, may_ulysses)
        }
        whole = Strategy("none")
        times[whole] = strategy_seconds(whole, shape, seq_len, world_size, hw, backward=backward)
        alternatives.append({str(s): t for s, t in times.items()})
        for layout in layouts:
            mine = [s for s in times if s.layout == layout]
            best_per_layout[layout].append(min(mine, key=lambda s: (times[s], PREFERENCE.index(s.kind))))
    totals = {
        layout: sum(alt[str(s)] for alt, s in zip(alternatives, chosen)) for layout, chosen in best_per_layout.items()
    }
    layout = min(layouts, key=lambda name: totals[name])  # min keeps the first of equal totals
    whole_total = sum(alt["none"] for alt in alternatives)
    if none and whole_total < totals[layout]:
        return StrategyChoice(layout, [Strategy("none")] * len(shapes), alternatives)
    return StrategyChoice(layout, best_per_layout[layout], alternatives)
