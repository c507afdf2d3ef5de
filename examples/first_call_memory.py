"""Where the first ring call's one-time memory goes (``first_call_mib`` in ``ringpass bench``).

    python examples/first_call_memory.py [--seq-len 8192]

Two gloo ranks on this machine. Each measures the peak memory (`ringpass.cli.bench.measure.PeakMemory`: VmHWM
after a reset, freed memory not counted) of one ring attention forward+backward, and how much resident
memory stays after it, in two orders: the long call first and again (the bench's case), then a process
whose first call is 64 tokens long, then the long one. A one-time cost that the 64-token call pays
instead of the long one is lazy initialisation (threads, connections, caches), not memory the long call
needs.
"""

from __future__ import annotations

import argparse
import os

import torch

MIB = 2**20


def _resident() -> int:
    from ringpass.cli.bench.measure import _status_kib

    return _status_kib("VmRSS") * 1024


def _call(seq_len: int, rank: int, world_size: int, memory) -> tuple[float, float]:
    """(peak MiB of one forward+backward, MiB still resident after it) on this rank."""
    import lowering

    layout = lowering.Layout("zigzag", world_size, seq_len)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (
        layout.shard(torch.randn(1, heads, seq_len, 64, generator=generator), 2, rank).requires_grad_()
        for heads in (8, 2, 2)
    )
    before = _resident()
    memory.start()
    out = lowering.ring_attention(q, k, v, is_causal=True, layout=layout)
    out.backward(torch.ones_like(out))
    peak = memory.peak()
    del out, q, k, v
    return peak / MIB, (_resident() - before) / MIB


def measure(rank: int, world_size: int, seq_len: int) -> dict:
    from ringpass.cli.bench.measure import PeakMemory

    torch.set_num_threads(1)
    memory = PeakMemory(torch.device("cpu"))
    return {
        "long first": _call(seq_len, rank, world_size, memory),
        "long again": _call(seq_len, rank, world_size, memory),
    }


def measure_tiny_first(rank: int, world_size: int, seq_len: int) -> dict:
    from ringpass.cli.bench.measure import PeakMemory

    torch.set_num_threads(1)
    memory = PeakMemory(torch.device("cpu"))
    return {
        "64 tokens first": _call(64, rank, world_size, memory),
        "then long": _call(seq_len, rank, world_size, memory),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # freed tensors leave the resident set (see PeakMemory)
    from ringpass.cli.launch import spawn_ranks

    rows = {}
    for fn in (measure, measure_tiny_first):
        rows.update(spawn_ranks(fn, 2, (args.seq_len,), timeout=600)[0])
    print(f"ring zigzag, causal, P=2, N={args.seq_len}, B=1, H=8, Hkv=2, D=64, fp32, rank 0")
    print(f"{'call':<18}{'peak MiB':>10}{'kept MiB':>10}")
    for name, (peak, kept) in rows.items():
        print(f"{name:<18}{peak:>10.1f}{kept:>10.1f}")


if __name__ == "__main__":
    main()
