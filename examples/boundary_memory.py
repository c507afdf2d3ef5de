"""Per-rank peak memory of one training step when a stack makes many graphs (docs/performance.md).

    python examples/boundary_memory.py [--seq-len 8192] [--hidden 256] [--layers 4] [--world-size 2]

A Llama-style model (tests' `models.Llama` shape: RMSNorm, RoPE, GQA, SwiGLU; fp32) trains one step on gloo ranks
of this machine in each recipe, each in fresh processes, after one warm-up step: the whole model compiled with the
ring; each block compiled on its own (`SequenceSharded` between the blocks: ``outputs="auto"``), the same with every
block's output gathered (``outputs="gathered"``: what every boundary cost before), per-block with
``torch.utils.checkpoint`` around each block, and FSDP2 ``fully_shard`` on every block and the root with the model
compiled; and the model unsharded on one process. Peak: `ringpass.cli.bench.measure.PeakMemory` (VmHWM above the
resident set before the step; freed tensors leave it: MALLOC_MMAP_THRESHOLD_). Gathered: bytes the step's
all-gathers of sequence values moved into each rank (`lowering.record_ring_events`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

MIB = 2**20
RECIPES = (
    "whole model",
    "per block",
    "per block with gathered outputs",
    "per block + checkpoint",
    "FSDP2 per block + root",
)


def _model(hidden: int, layers: int):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "workers"))
    from models import Llama

    torch.manual_seed(0)
    return Llama(vocab=1024, dim=hidden, heads=4, kv_heads=2, layers=layers)


def _prepare(recipe: str, model, world_size: int):
    """(the callable that runs the model, whether it takes sharded token ids)."""
    import torch.nn as nn
    from torch.utils.checkpoint import checkpoint

    import ringpass

    if recipe == "whole model":
        return torch.compile(model, backend=ringpass.backend(compiler="aot_eager")), False
    if recipe == "FSDP2 per block + root":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return torch.compile(model, backend=ringpass.backend(compiler="aot_eager")), True
    outputs = "gathered" if recipe.endswith("gathered outputs") else "auto"
    backend = ringpass.backend(compiler="aot_eager", outputs=outputs)

    class Checkpointed(nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, *args):
            return checkpoint(self.block, *args, use_reentrant=False)

    for i, block in enumerate(model.blocks):
        compiled = torch.compile(block, backend=backend)
        model.blocks[i] = Checkpointed(compiled) if "checkpoint" in recipe else compiled
    return model, outputs == "auto"


def _step(run, ids, labels, sharded_ids: bool) -> torch.Tensor:
    import torch.nn.functional as F

    from ringpass import SequenceSharded

    logits = run(SequenceSharded.distribute(ids, 1) if sharded_ids else ids)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    loss.backward()
    return loss


def measure(rank: int, world_size: int, recipe: str, seq_len: int, hidden: int, layers: int) -> dict:
    from lowering import record_ring_events
    from ringpass.cli.bench.measure import PeakMemory

    torch.set_num_threads(1)
    model = _model(hidden, layers)
    generator = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, 1024, (1, seq_len), generator=generator) for _ in range(2))
    if world_size == 1:
        run, sharded = model, False
    else:
        run, sharded = _prepare(recipe, model, world_size)
    _step(run, ids, labels, sharded)  # compiles; the first call's one-time memory is not the step's
    model.zero_grad(set_to_none=False)
    memory = PeakMemory(torch.device("cpu"))
    memory.start()
    with record_ring_events() as events:
        loss = _step(run, ids, labels, sharded)
    peak = memory.peak()
    gathered = sum(e.fields["bytes"] for e in events if e.kind == "all_gather")
    return {"peak_mib": None if peak is None else peak / MIB, "gathered_mib": gathered / MIB, "loss": loss.item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated, from: " + ", ".join(RECIPES))
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # freed tensors leave the resident set (see PeakMemory)
    from ringpass.cli.launch import spawn_ranks

    shape = (args.seq_len, args.hidden, args.layers)
    rows = [("unsharded (one process)", spawn_ranks(measure, 1, ("unsharded", *shape), timeout=1800)[0])]
    for recipe in args.recipes.split(","):
        rows.append((recipe, max(spawn_ranks(measure, args.world_size, (recipe, *shape), timeout=1800), key=_peak)))
    print(
        f"Llama-style, hidden {args.hidden}, {args.layers} layers, N={args.seq_len}, fp32, "
        f"P={args.world_size}, one training step after a warm-up; the rank with the higher peak"
    )
    print("| recipe | peak MiB per rank | sequence all-gathered MiB per rank | loss |\n|---|---|---|---|")
    for name, row in rows:
        print(f"| {name} | {_peak(row):.0f} | {row['gathered_mib']:.1f} | {row['loss']:.6f} |")


def _peak(row: dict) -> float:
    return row["peak_mib"] or 0.0


if __name__ == "__main__":
    main()
