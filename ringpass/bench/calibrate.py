"""``ringpass bench --calibrate``: this machine's link and attention rate, for `lowering.costmodel`.

Link: two ranks exchange blocks of 256 KiB to 64 MiB with the ring's own `RingExchange` (median of five
after a warm-up each); a least-squares line through (bytes, seconds) gives the per-message latency
(intercept) and the bandwidth (1 / slope), in relative error. Device: one rank's attention kernel (the ring's
block kernel on a fully visible 2048 x 2048 block, B=1, Hq=8, Hkv=2, D=64, forward then backward, fp32, with the
threads a rank gets) gives useful FLOP/s as the cost model counts them; the model's own SDPA (aten's kernel, causal,
on a whole 4096-token sequence, forward then backward) gives the rate of an attention run whole (``strategy``
``none``, a plan's one-rank candidates). The rest of a training step, for
``ringpass plan`` of a whole model (`ringpass.model_plan`), measured on both ranks at once (a ring's ranks run
side by side, sharing a host's memory system; rank 0's numbers): a matrix product's rate (fp32 4096 x 256 by 256 x 1024
and 4096 x 1024 by 1024 x 256, the mean), an elementwise op's memory rate (a product of two 64 MiB tensors into a
new one: three tensors' bytes, fresh pages included, as a step allocates them) and the fixed cost of one op (2000
adds of one element). The result is the `Hardware` that ``ringpass plan --hardware FILE`` and ``ringpass bench
--hardware FILE`` read.
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
from lowering.kernels import block_attention, block_attention_backward
from ringpass.launch import spawn_ranks

SIZES = (2**18, 2**20, 2**22, 2**24, 2**26)  # bytes per message
BLOCK = dict(batch=1, heads=8, kv_heads=2, tokens=2048, head_dim=64)


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


def _device_rate() -> float:
    b, h, hkv, n, d = (BLOCK[k] for k in ("batch", "heads", "kv_heads", "tokens", "head_dim"))
    generator = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(b, h, n, d, generator=generator) for _ in range(2))
    k, v = (torch.randn(b, hkv, n, d, generator=generator) for _ in range(2))
    pos = torch.arange(n)

    def forward_and_backward():
        out, lse = block_attention(q, k, v, pos, pos, backend="torch")
        block_attention_backward(dout, q, k, v, out, lse, pos, pos, backend="torch")

    return 4 * b * h * d * n * n * (1 + BACKWARD_FLOPS_RATIO) / _seconds(forward_and_backward)


def _sdpa_rate(tokens: int = 4096) -> float:
    """Useful FLOP/s of ``F.scaled_dot_product_attention`` itself, causal, forward and backward."""
    b, h, hkv, d = (BLOCK[k] for k in ("batch", "heads", "kv_heads", "head_dim"))
    generator = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(b, h, tokens, d, generator=generator) for _ in range(2))
    k, v = (torch.randn(b, hkv, tokens, d, generator=generator) for _ in range(2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def forward_and_backward():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(dout)

    pairs = tokens * (tokens + 1) // 2
    return 4 * b * h * d * pairs * (1 + BACKWARD_FLOPS_RATIO) / _seconds(forward_and_backward)


def _other_work() -> dict:
    """The rates of a step's work outside attention, on this rank's threads."""
    shapes = (((4096, 256), (256, 1024)), ((4096, 1024), (1024, 256)))
    pairs = [(torch.randn(*a), torch.randn(*b)) for a, b in shapes]
    gemm = [2 * 4096 * 256 * 1024 / _seconds(lambda x=x, y=y: x @ y) for x, y in pairs]
    x = torch.randn(2**24)
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
    rates = {"flops_per_s": _device_rate(), "sdpa_flops_per_s": _sdpa_rate()} if rank == 0 else {}
    dist.barrier()
    rates.update(_other_work())  # every rank at once: a ring's ranks run their steps side by side
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
    return {
        "link_bytes_per_s": bandwidth,
        "link_latency_s": latency,
        "flops_per_s": result["flops_per_s"],
        "sdpa_flops_per_s": result["sdpa_flops_per_s"],
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
        f"  attention kernel: {data['flops_per_s'] / 1e9:.3g} GFLOP/s (forward+backward, useful FLOPs); the "
        f"model's SDPA on a whole sequence: {data['sdpa_flops_per_s'] / 1e9:.3g} GFLOP/s",
        f"  the rest of a step: matrix products {data['gemm_flops_per_s'] / 1e9:.3g} GFLOP/s, elementwise "
        f"{data['memory_bytes_per_s'] / 1e9:.3g} GB/s, {data['op_overhead_s'] * 1e6:.2g} us per op",
        "  message seconds: "
        + ", ".join(f"{m['bytes'] // 1024} KiB {m['seconds'] * 1e3:.2f} ms" for m in data["message_seconds"]),
    ]
    return "\n".join(lines)
