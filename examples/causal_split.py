"""What splitting a causal square saves on aten's fused CPU attention kernel (`lowering.kernels.torch_attention`).

    python examples/causal_split.py                       # squares of 256 to 4096 rows
    python examples/causal_split.py --sizes 512 2048 --repeats 5

One thread, B=1, Hq=8, Hkv=2, D=64, fp32: per size, the seconds of a causal block's forward and backward through
`lowering.kernels.block_attention` / `block_attention_backward` run whole and split (halves and the rectangle between
them, recursively down to ``CAUSAL_LEAF`` rows; ``CAUSAL_SPLIT_BELOW`` set beyond the size, so sizes the ring runs
whole are measured split too), in alternating turns, the median of ``--repeats``; smaller squares repeat their calls.
docs/performance.md ("Causal squares on the CPU") has a run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lowering.kernels import block_attention, block_attention_backward, torch_attention


def timed(q, k, v, dout, calls: int) -> float:
    """Seconds of ``calls`` causal forward+backward block calls on q, k, v (aligned positions)."""
    positions = torch.arange(q.size(2))
    start = time.perf_counter()
    for _ in range(calls):
        out, lse = block_attention(q, k, v, positions, positions, is_causal=True)
        block_attention_backward(dout, q, k, v, out, lse, positions, positions, is_causal=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096], help="rows per square")
    parser.add_argument("--repeats", type=int, default=3, help="turns per size (the median is printed)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    leaf, below = torch_attention.CAUSAL_LEAF, torch_attention.CAUSAL_SPLIT_BELOW
    print(f"rows   calls  whole s  split s  split/whole   (CAUSAL_LEAF = {leaf}; split by default below {below})")
    for size in args.sizes:
        generator = torch.Generator().manual_seed(size)
        q, k, v, dout = (torch.randn(1, h, size, 64, generator=generator) for h in (8, 2, 2, 8))
        calls = max(1, (8192 // size) ** 2 // 16)
        seconds = {"whole": [], "split": []}
        for _ in range(args.repeats):
            for name, split_below in (("whole", 0), ("split", size + 1)):
                torch_attention.CAUSAL_SPLIT_BELOW = split_below
                seconds[name].append(timed(q, k, v, dout, calls))
        torch_attention.CAUSAL_SPLIT_BELOW = below
        whole, split = (statistics.median(seconds[name]) for name in ("whole", "split"))
        print(f"{size:5d}  {calls:5d}  {whole:7.3f}  {split:7.3f}  {split / whole:11.2f}")


if __name__ == "__main__":
    main()
