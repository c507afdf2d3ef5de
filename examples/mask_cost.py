"""What a window or a mask program costs the ring over plain causal attention (issue 13, item 4).

    torchrun --standalone --nproc-per-node 2 examples/mask_cost.py [seq_len] [calls]

Causal zigzag ring attention, B=1, Hq=8, Hkv=2, D=64, fp32, forward+backward: plain causal; a window as
long as the sequence and a one-document mask program (both hide nothing: the ring must cost what plain
causal costs); then a window of N/4 and four packed documents (they hide work: they should cost less).
Rank 0 prints the median seconds over ``calls`` after a warm-up. docs/performance.md records the numbers.
"""

import statistics
import sys

import torch
import torch.distributed as dist
from ring_call import ring_inputs, timed_call


def packed_documents(q_pos, kv_pos, document):
    return document[q_pos][:, None] == document[kv_pos][None, :]


def main(seq_len: int, calls: int) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    layout, q, k, v = ring_inputs(rank, world_size, seq_len)
    one_document = torch.zeros(seq_len, dtype=torch.long)
    four_documents = torch.arange(seq_len) * 4 // seq_len
    cases = {
        "plain causal": {},
        f"window={seq_len} (hides nothing)": dict(window=seq_len),
        "one-document program (hides nothing)": dict(mask=packed_documents, mask_inputs=[one_document]),
        f"window={seq_len // 4}": dict(window=seq_len // 4),
        "four packed documents": dict(mask=packed_documents, mask_inputs=[four_documents]),
    }
    results = {}
    for name, options in cases.items():
        times = [timed_call(layout, q, k, v, **options) for _ in range(calls + 1)]
        results[name] = statistics.median(times[1:])
    if rank == 0:
        plain = results["plain causal"]
        print(f"ring zigzag, P={world_size}, N={seq_len}, forward+backward, median of {calls}:")
        for name, seconds in results.items():
            print(f"  {name:<40} {seconds:7.3f} s  {100 * (seconds / plain - 1):+5.1f}%")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 16384, int(sys.argv[2]) if len(sys.argv) > 2 else 3)
