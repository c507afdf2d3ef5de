"""``ringpass bench --calibrate``: this machine's link and attention rate, for `lowering.costmodel`.

Link: two ranks exchange blocks of 256 KiB to 64 MiB with the ring's own `RingExchange` (median of five
after a warm-up each); a least-squares line through (bytes, seconds) gives the per-message latency
(intercept) and the bandwidth (1 / slope), in relative error. Then every rate below on both ranks at once (a
ring's ranks compute side by side, sharing a host's memory system; rank 0's numbers), with the threads a rank gets:

- the ring's attention: one rank's share of the ring's own compute (`lowering.simulate_ring`: every rank's blocks,
  masks and merges in one process, no transfers) for a causal zigzag ring of 2 ranks over 4096 tokens, B=1, Hq=8,
  Hkv=2, forward then backward, fp32, in useful FLOP/s as the cost model counts them (the ring's tiles and merges
  reach 0.8 of the block kernel on one fully visible 2048 x 2048 block here);
- the model's own SDPA (aten's kernel, causal, on the whole 4096-token sequence, forward then backward): an
  attention run whole (``strategy`` ``none``, a plan's one-rank candidates);
- both at head dims 32, 64 and 128 (`HEAD_DIMS`: a kernel's rate depends on it, 35 / 47 / 56 GFLOP/s for the ring
  here with both ranks computing), D=64 also as the single rates;
- the rest of a training step, for ``ringpass plan`` of a whole model (`ringpass.planning.model_plan`): a matrix
  product's rate (fp32 4096 x 256 by 256 x 1024 and 4096 x 1024 by 1024 x 256, the mean), an elementwise op's memory
  rate (a product of two 8 MiB tensors into a new one: three tensors' bytes, the new one taken from memory the allocator
  reuses, as a step's activations are; a tensor past glibc's mmap threshold, 32 MiB at most, gets fresh pages each time
  instead: 3-4 GB/s here against 20-25) and the fixed cost of one op (2000 adds of one element).

The result is the `Hardware` that ``ringpass plan --hardware FILE`` and ``ringpass bench --hardware FILE`` read.
"""

from __future__ import annotations

import os
import statistics
import time
from datetime import date

import torch
import torch.distributed as dist

from lowering.comm import RingExchange
from lowering.costmodel import BACKWARD_FLOPS_RATIO
from lowering.layout import Layout
from lowering.simulate import simulate_ring
from ringpass.cli.launch import spawn_ranks

SIZES = (2**18, 2**20, 2**22, 2**24, 2**26)  # bytes per message
BLOCK = dict(batch=1, heads=8, kv_heads=2, tokens=4096)
HEAD_DIMS = (32, 64, 128)


def _link(rank: int) -> list[tuple[int, float]]:
    exchange = RingExchange(dist.group.WORLD)
    points = []
    for size in SIZES:
        block = torch.zeros(size // 4)
        times = []
        for _ in range(6):
            dist.barrier()
            start = time.perf_counter()
            exchange.start(block, payload="calibration", step=0, tag=0).wait()
            times.append(time.perf_counter() - start)
        points.append((size, statistics.median(times[1:])))
    return points


def _attention(d: int) -> tuple:
    """q, k, v and an output gradient of `BLOCK`'s shape at head dim ``d``."""
    b, h, hkv, n = (BLOCK[k] for k in ("batch", "heads", "kv_heads", "tokens"))
    generator = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(b, h, n, d, generator=generator) for _ in range(2))
    k, v = (torch.randn(b, hkv, n, d, generator=generator) for _ in range(2))
    return q, k, v, dout


def _useful_flops(d: int) -> float:
    """Forward + backward FLOPs of `BLOCK`'s causal attention at head dim ``d``, as the cost model counts them."""
    n = BLOCK["tokens"]
    return 4 * BLOCK["batch"] * BLOCK["heads"] * d * n * (n + 1) / 2 * (1 + BACKWARD_FLOPS_RATIO)


def _ring_rate(d: int, ranks: int = 2) -> float:
    """Useful FLOP/s of one rank's share of a causal zigzag ring's compute (module docstring)."""
    q, k, v, dout = _attention(d)
    layout = Layout("zigzag", ranks, BLOCK["tokens"])
    seconds = _seconds(lambda: simulate_ring(q, k, v, layout=layout, is_causal=True, dout=dout))
    return _useful_flops(d) / seconds  # every rank's share of the FLOPs in every rank's share of the time


def _sdpa_rate(d: int) -> float:
    """Useful FLOP/s of ``F.scaled_dot_product_attention`` itself, causal, forward and backward."""
    q, k, v, dout = _attention(d)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def forward_and_backward():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(dout)

    return _useful_flops(d) / _seconds(forward_and_backward)


def _other_work() -> dict:
    """The rates of a step's work outside attention, on this rank's threads."""
    shapes = (((4096, 256), (256, 1024)), ((4096, 1024), (1024, 256)))
    pairs = [(torch.randn(*a), torch.randn(*b)) for a, b in shapes]
    gemm = [2 * 4096 * 256 * 1024 / _seconds(lambda x=x, y=y: x @ y) for x, y in pairs]
    x = torch.randn(2**21)  # 8 MiB (module docstring)
    y = torch.randn_like(x)
    small = torch.ones(1)
    return {
        "gemm_flops_per_s": statistics.mean(gemm),
        "memory_bytes_per_s": 3 * x.nbytes / _seconds(lambda: x * y),
        "op_overhead_s": _seconds(lambda: [small + small for _ in range(2000)]) / 2000,
    }


def _seconds(run) -> float:
    """The median of four timed runs after a warm-up."""
    times = []
    for _ in range(5):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _calibrate_rank(rank: int, world_size: int) -> dict:
    points = _link(rank)
    dist.barrier()  # then every rate on every rank at once: a ring's ranks compute side by side
    rates = {"head_dim_rates": [(d, _ring_rate(d), _sdpa_rate(d)) for d in HEAD_DIMS], **_other_work()}
    return {"points": points, **rates, "threads": torch.get_num_threads()}


def fit_link(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(bytes per second, seconds of latency) of the line seconds = latency + bytes / bandwidth that fits
    the points in relative error (least squares weighted by 1 / seconds², so a small message's latency
    counts as much as a large one's bandwidth)."""
    w = [1.0 / (y * y) for _, y in points]
    sw = sum(w)
    mx = sum(wi * x for wi, (x, _) in zip(w, points)) / sw
    my = sum(wi * y for wi, (_, y) in zip(w, points)) / sw
    slope = sum(wi * (x - mx) * (y - my) for wi, (x, y) in zip(w, points)) / sum(
        wi * (x - mx) ** 2 for wi, (x, _) in zip(w, points)
    )
    return 1.0 / slope, max(0.0, my - slope * mx)


def calibrate(timeout: float = 600.0) -> dict:
    """Measure on two spawned ranks (one per half of the cores); the calibration file's contents."""
    result = spawn_ranks(_calibrate_rank, 2, timeout=timeout)[0]
    bandwidth, latency = fit_link(result["points"])
    _, ring_rate, sdpa_rate = next(row for row in result["head_dim_rates"] if row[0] == 64)
    return {
        "link_bytes_per_s": bandwidth,
        "link_latency_s": latency,
        "flops_per_s": ring_rate,
        "sdpa_flops_per_s": sdpa_rate,
        "head_dim_rates": [
            {"head_dim": d, "flops_per_s": ring, "sdpa_flops_per_s": sdpa} for d, ring, sdpa in result["head_dim_rates"]
        ],
        "gemm_flops_per_s": result["gemm_flops_per_s"],
        "memory_bytes_per_s": result["memory_bytes_per_s"],
        "op_overhead_s": result["op_overhead_s"],
        "link": "calibrated",
        "device": "calibrated",
        "measured": date.today().isoformat(),
        "threads_per_rank": result["threads"],
        "cores": os.cpu_count(),
        "message_seconds": [{"bytes": b, "seconds": s} for b, s in result["points"]],
    }


def format_calibration(data: dict) -> str:
    lines = [
        f"ringpass bench --calibrate ({data['measured']}, {data['threads_per_rank']} thread(s) per rank, "
        f"{data['cores']} cores)",
        f"  link: {data['link_bytes_per_s'] / 1e9:.3g} GB/s one way, {data['link_latency_s'] * 1e6:.0f} us per message",
        "  attention, forward+backward, useful GFLOP/s by head dim: "
        + ", ".join(
            f"D={r['head_dim']} ring {r['flops_per_s'] / 1e9:.3g}, "
            f"whole-sequence SDPA {r['sdpa_flops_per_s'] / 1e9:.3g}"
            for r in data["head_dim_rates"]
        ),
        f"  the rest of a step: matrix products {data['gemm_flops_per_s'] / 1e9:.3g} GFLOP/s, elementwise "
        f"{data['memory_bytes_per_s'] / 1e9:.3g} GB/s, {data['op_overhead_s'] * 1e6:.2g} us per op",
        "  message seconds: "
        + ", ".join(f"{m['bytes'] // 1024} KiB {m['seconds'] * 1e3:.2f} ms" for m in data["message_seconds"]),
    ]
    return "\n".join(lines)
