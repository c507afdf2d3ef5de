"""What the reliability machinery costs. First the agreement between ranks per call: the GPT of
compile_with_ring.py, one training step per call, with checks="off", "first" and "every" (the default).
Then the bounded wait of each ring exchange: a small `lowering.ring_attention` forward (P-1 exchanges)
with the bounded waits, and with plain ``work.wait()`` in their place.

    torchrun --standalone --nproc-per-node 2 examples/reliability_cost.py [seq_len] [calls]

Rank 0 prints the median times in milliseconds. docs/reliability.md records the numbers.
"""

import statistics
import sys
import time

import torch
import torch.distributed as dist
from compile_with_ring import GPT

import lowering.comm
import ringpass
from lowering import Layout, failures, ring_attention


def _timed_agreement():
    """Wrap lowering.failures.agree to record how long each agreement takes."""
    spent, agree = [], failures.agree

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return agree(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    failures.agree = timed
    return spent


def main() -> None:
    seq_len = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    dist.init_process_group("gloo")
    spent = _timed_agreement()
    ids = torch.randint(0, 256, (2, seq_len), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1, dims=1)
    for checks in ("off", "first", "every"):
        torch.manual_seed(0)
        torch._dynamo.reset()
        model = torch.compile(GPT(), backend=ringpass.backend(compiler="aot_eager", report="off", checks=checks))
        model(ids, labels).backward()  # compile
        spent.clear()
        steps = []
        for _ in range(calls):
            start = time.perf_counter()
            model(ids, labels).backward()
            steps.append(time.perf_counter() - start)
        if dist.get_rank() == 0:
            agreement = statistics.median(spent) * 1e3 if spent else 0.0
            print(
                f"checks={checks:5s} seq_len={seq_len} step {statistics.median(steps) * 1e3:8.2f} ms   "
                f"agreement {agreement:6.3f} ms per call"
            )
    _exchange_waits(calls)
    dist.destroy_process_group()


def _plain_wait(works, *args, **kwargs):
    for work in works:
        work.wait()


def _exchange_waits(calls: int) -> None:
    layout = Layout("zigzag", dist.get_world_size(), 256)
    q = torch.randn(1, 2, layout.local_len, 16)
    bounded = lowering.comm.wait_works
    for name, wait in (("bounded", bounded), ("plain", _plain_wait)):
        lowering.comm.wait_works = wait
        times = []
        for _ in range(calls * 10):
            dist.barrier()
            start = time.perf_counter()
            ring_attention(q, q, q, layout=layout, is_causal=True)
            times.append(time.perf_counter() - start)
        if dist.get_rank() == 0:
            print(
                f"ring_attention forward, 256 tokens, {dist.get_world_size() - 1} exchange(s): "
                f"{statistics.median(times) * 1e3:.3f} ms with {name} waits"
            )
    lowering.comm.wait_works = bounded


if __name__ == "__main__":
    main()
