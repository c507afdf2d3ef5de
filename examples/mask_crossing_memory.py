"""Per-rank peak memory of a Hugging Face training step whose padding mask crosses graphs (docs/performance.md).

    python examples/mask_crossing_memory.py [--seq-len 4096] [--hidden 64] [--layers 2] [--world-size 2]

A Hugging Face Llama (random weights, fp32, SDPA) with a left-padded batch trains one step on gloo ranks of this
machine, in fresh processes, after one warm-up step: under FSDP2 per layer and root with the model compiled with the
ring (a graph per layer; HF builds the [B, 1, S, S] mask in the first graph, and it crosses to each layer's graph as
its per-token description, `ringpass.SequenceMask`); with each layer compiled on its own (HF builds the mask
eagerly, whole, before the layers: allowed with ``masks="materialize"``); and unsharded on one process. Peak:
`ringpass.cli.bench.measure.PeakMemory`, as in `examples/boundary_memory.py`. Crossing: the bytes the mask's boundary
carries (the backend's report).
"""

from __future__ import annotations

import argparse
import os
import re

import torch

MIB = 2**20
VOCAB = 1024


def _model(hidden: int, layers: int):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1 << 20,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config)


def measure(rank: int, world_size: int, recipe: str, seq_len: int, hidden: int, layers: int) -> dict:
    from lowering import record_ring_events
    from ringpass.cli.bench.measure import PeakMemory

    torch.set_num_threads(1)
    model = _model(hidden, layers)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, seq_len), generator=generator)
    attention_mask = torch.ones(1, seq_len, dtype=torch.long)
    attention_mask[:, : seq_len // 16] = 0  # left padding
    labels = ids.masked_fill(attention_mask == 0, -100)
    kwargs = {"labels": labels, "attention_mask": attention_mask, "use_cache": False}
    run, backend = model, None
    if recipe == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        import ringpass

        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        backend = ringpass.backend(compiler="aot_eager", report="off")
        run = torch.compile(model, backend=backend)
    elif recipe == "layers":
        import ringpass

        backend = ringpass.backend(compiler="aot_eager", masks="materialize", report="off")
        for layer in model.model.layers:
            layer.compile(backend=backend)
    if backend is not None:
        ids = ringpass.SequenceSharded.distribute(ids, 1)

    def step():
        loss = run(input_ids=ids, **kwargs).loss
        loss.backward()
        return loss

    step()  # compiles; the first call's one-time memory is not the step's
    model.zero_grad(set_to_none=False)
    memory = PeakMemory(torch.device("cpu"))
    memory.start()
    with record_ring_events():
        loss = step()
    peak = memory.peak()
    return {"peak_mib": (peak or 0) / MIB, "crossing": _crossing(backend, seq_len), "loss": loss.item()}


def _crossing(backend, seq_len: int) -> str:
    """The bytes the mask's boundary carries, from the report of the graph that builds it."""
    if backend is None:
        return ""
    for report in backend.reports:
        for line in report.masks:
            found = re.search(r"(\d+) bytes instead of (\d+)", line)
            if found:
                return f"{int(found[1]) / 1024:.1f} KiB (not {int(found[2]) / MIB:.1f} MiB)"
    return f"{seq_len * seq_len / MIB:.1f} MiB (the [1, 1, S, S] bool mask, whole)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # freed tensors leave the resident set (see PeakMemory)
    from ringpass.cli.launch import spawn_ranks

    shape = (args.seq_len, args.hidden, args.layers)
    rows = [("unsharded (one process)", spawn_ranks(measure, 1, ("unsharded", *shape), timeout=1800)[0])]
    for recipe, name in (
        ("fsdp2", "FSDP2 per layer + root, the model compiled: the mask crosses as its description"),
        ("layers", "each layer compiled: HF builds the mask eagerly, whole (masks='materialize')"),
    ):
        ranks = spawn_ranks(measure, args.world_size, (recipe, *shape), timeout=1800)
        rows.append((name, max(ranks, key=lambda r: r["peak_mib"])))
    print(
        f"HF Llama, hidden {args.hidden}, {args.layers} layers, N={args.seq_len} left-padded, fp32, "
        f"P={args.world_size}, one training step after a warm-up; the rank with the higher peak"
    )
    print("| recipe | peak MiB per rank | the mask's boundary carries | loss |\n|---|---|---|---|")
    for name, row in rows:
        print(f"| {name} | {row['peak_mib']:.0f} | {row['crossing']} | {row['loss']:.6f} |")


if __name__ == "__main__":
    main()
