"""Two ways to run a chunked scan on a sequence sharded over P ranks, side by side: split by heads, or pass the state
(docs/performance.md, "Chunked scans: split by heads or pass the state").

    python examples/scan_strategies.py [--scans ssd,delta_rule] [--seq-lens 8192,32768] [--world-sizes 2,4]

One scan layer, forward and backward, batch 1, fp32, on P gloo ranks of this machine (one thread each), each rank
holding its zigzag chunks of the inputs, against the same scan on the whole sequence in one process: ``ssd`` is
Hugging Face's ``mamba2_chunk_scan`` with Mamba2's shapes (8 heads of 64, state 64, one group for B and C, chunks of
256), ``delta_rule`` its ``torch_chunk_gated_delta_rule`` with Qwen3-Next's (8 heads, dk = dv = 64, chunks of 64, q and
k l2-normed). Per strategy: the step's time (slowest rank, after one warm-up), peak memory (the higher rank, as
`ringpass.cli.bench.measure.PeakMemory` counts it on CPU) and the bytes a rank sends per step
(`lowering.record_ring_events`):

- ``heads``: `lowering.head_exchange`'s all-to-alls give each rank every token of H/P heads (B and C, shared by the
  heads, all-gathered), the scan runs on the whole sequence, and its output goes back (the pass's `split_region_heads`);
- ``state``: `lowering.state_passing.sharded_scan`: each chunk's summary all-gathered, each chunk scanned from the
  state before it.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

MIB = 2**20
HEADS, HEAD_DIM, STATE = 8, 64, 64


def inputs(scan: str, seq_len: int) -> tuple[dict, dict, dict]:
    """(per-token inputs [1, N, ...], weights, constants) of one layer, the same on every rank."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(shape, generator=gen)

    if scan == "ssd":
        tokens = dict(hidden_states=randn(1, seq_len, HEADS, HEAD_DIM), dt=randn(1, seq_len, HEADS))
        tokens.update(B=randn(1, seq_len, 1, STATE), C=randn(1, seq_len, 1, STATE))
        weights = dict(A=-torch.rand(HEADS, generator=gen), D=randn(HEADS), dt_bias=randn(HEADS))
        return tokens, weights, dict(chunk_size=256, dt_softplus=True, dt_limit=(0.0, float("inf")))
    tokens = dict(query=randn(1, seq_len, HEADS, HEAD_DIM), key=randn(1, seq_len, HEADS, HEAD_DIM))
    tokens.update(value=randn(1, seq_len, HEADS, HEAD_DIM), g=-torch.rand(1, seq_len, HEADS, generator=gen))
    tokens.update(beta=torch.rand(1, seq_len, HEADS, generator=gen))
    return tokens, {}, dict(chunk_size=64, use_qk_l2norm_in_kernel=True)


def function(scan: str):
    if scan == "ssd":
        from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

        return mamba2_chunk_scan
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    return torch_chunk_gated_delta_rule


def whole_call(scan: str, tokens: dict, weights: dict, constants: dict) -> torch.Tensor:
    out = function(scan)(**tokens, **weights, **constants)
    return out if scan == "ssd" else out[0]


def split_by_heads(scan: str, local: dict, weights: dict, constants: dict, seq_len: int, group: str):
    """This rank's tokens of the scan's output, computed on every token of its H/P heads."""
    from lowering.head_exchange import heads_to_sequence, own_heads, sequence_to_heads
    from lowering.sequence_ops import gather_sequence, reduce_grad

    world_size = torch.distributed.get_world_size()
    where = ("zigzag", world_size, seq_len, group)
    mine = {
        name: reduce_grad(gather_sequence(t, 1, *where), group)  # shared by every head: read whole
        if t.shape[2] == 1
        else sequence_to_heads(t, 1, 2, *where)
        for name, t in local.items()
    }
    narrowed = {name: own_heads(w, 0, world_size, group) for name, w in weights.items()}
    return heads_to_sequence(whole_call(scan, mine, narrowed, constants).contiguous(), 1, 2, *where)


def pass_state(scan: str, local: dict, weights: dict, constants: dict, seq_len: int, group: str):
    from lowering import Layout
    from lowering.state_passing import gated_delta_rule, sharded_scan, ssd

    adapter = (ssd if scan == "ssd" else gated_delta_rule)(function(scan), **constants)
    layout = Layout("zigzag", torch.distributed.get_world_size(), seq_len)
    return sharded_scan(adapter, local, weights, layout=layout)


def measure(rank: int, world_size: int, scan: str, seq_len: int, strategy: str) -> dict:
    from lowering import Layout, record_ring_events
    from ringpass.cli.bench.measure import PeakMemory

    torch.set_num_threads(1)
    tokens, weights, constants = inputs(scan, seq_len)
    weights = {name: w.requires_grad_() for name, w in weights.items()}
    if world_size == 1:
        local = tokens
    else:
        layout = Layout("zigzag", world_size, seq_len)
        local = {name: layout.shard(t, 1, rank) for name, t in tokens.items()}
    local = {name: t.requires_grad_() for name, t in local.items()}
    group = torch.distributed.group.WORLD.group_name if world_size > 1 else ""

    def step():
        if world_size == 1:
            out = whole_call(scan, local, weights, constants)
        else:
            run = split_by_heads if strategy == "heads" else pass_state
            out = run(scan, local, weights, constants, seq_len, group)
        out.square().sum().backward()

    step()  # warm-up
    memory = PeakMemory(torch.device("cpu"))
    memory.start()
    start = time.perf_counter()
    with record_ring_events() as events:
        step()
    seconds = time.perf_counter() - start
    sent = {"heads_exchange", "mixer_exchange", "all_gather", "all_reduce"}
    return {
        "seconds": seconds,
        "peak_mib": (memory.peak() or 0) / MIB,
        "bytes": sum(e.fields["bytes"] for e in events if e.kind in sent),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scans", default="ssd,delta_rule")
    parser.add_argument("--seq-lens", default="8192,32768")
    parser.add_argument("--world-sizes", default="2,4")
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # freed tensors leave the resident set (see PeakMemory)
    from ringpass.cli.launch import spawn_ranks

    print("one scan layer, forward and backward, batch 1, fp32; time: the slowest rank; peak: the higher rank")
    print("| scan | N | P | strategy | step s | peak MiB per rank | vs unsharded | sent per rank |")
    print("|---|---|---|---|---|---|---|---|")
    for scan in args.scans.split(","):
        for seq_len in map(int, args.seq_lens.split(",")):
            whole = spawn_ranks(measure, 1, (scan, seq_len, "whole"), timeout=3600)[0]
            print(
                f"| {scan} | {seq_len} | 1 | unsharded | {whole['seconds']:.2f} | {whole['peak_mib']:.0f} | 1.00 | 0 |"
            )
            for world_size in map(int, args.world_sizes.split(",")):
                for strategy in ("heads", "state"):
                    rows = spawn_ranks(measure, world_size, (scan, seq_len, strategy), timeout=3600)
                    peak = max(r["peak_mib"] for r in rows)
                    sent = max(r["bytes"] for r in rows)
                    print(
                        f"| {scan} | {seq_len} | {world_size} | {strategy} | {max(r['seconds'] for r in rows):.2f} | "
                        f"{peak:.0f} | {peak / whole['peak_mib']:.2f} | {sent / MIB:.2f} MiB |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
