"""What the agreement between ranks costs per call: the GPT of compile_with_ring.py, one training step
per call, with checks="off", "first" (the default) and "every".

    torchrun --standalone --nproc-per-node 2 examples/reliability_cost.py [seq_len] [calls]

Rank 0 prints one line per setting: the median time of a step and the time of the agreement itself
(measured inside ringpass.guard), in milliseconds. docs/reliability.md records the numbers.
"""

import statistics
import sys
import time

import torch
import torch.distributed as dist

import ringpass
from compile_with_ring import GPT
from lowering import failures


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
            print(f"checks={checks:5s} seq_len={seq_len} step {statistics.median(steps) * 1e3:8.2f} ms   "
                  f"agreement {agreement:6.3f} ms per call")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
