"""What a hybrid's sequence mixers cost on a sharded sequence: per-rank peak memory, bytes and time of a training
step (docs/performance.md, "Sequence mixers").

    python examples/mixer_cost.py [--family lfm2|bamba|mamba2] [--seq-lens 8192,32768] [--world-sizes 2,4]
                                  [--hidden 256] [--scans heads,whole,state]

A model from a config (random weights; hidden 256, 4 layers, fp32, batch 1) trains one step compiled with
``backend="ring"`` (``aot_eager``) on P gloo ranks of this machine (one thread each), and unsharded on one process, each
in fresh processes after one warm-up step. ``lfm2``: three short-convolution layers of width 3 around one attention
layer (the convolutions pass state); ``bamba``: three Mamba2 layers (8 heads, state 64, chunks of 256) around one
attention layer; ``mamba2``: four Mamba2 layers, no attention (a Mamba2 layer's convolution passes state; its chunked
scan runs split by heads, with ``--scans whole`` on the whole sequence on every rank, with ``--scans state`` on this
rank's chunks from the state the chunks before them leave: the backend's ``scans`` option, one row each). Peak:
`ringpass.cli.bench.measure.PeakMemory` (VmHWM above the resident set before the step; freed tensors leave it:
MALLOC_MMAP_THRESHOLD_). Bytes per rank per step (`lowering.record_ring_events`): the mixers' summaries (the
convolutions' halos, all-gathered: forward, and again in the backward; passing the state, the scans' chunk summaries,
all-gathered in the forward), the scans' all-to-alls (what a rank sends: its tokens of the inputs and its heads of the
outputs, forward and backward) and all-gathers (what a rank receives: the inputs read whole in the forward, the
outputs' gradients in the backward) and the attention's KV exchanges.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

MIB = 2**20


def build(family: str, hidden: int):
    import transformers

    torch.manual_seed(0)
    mamba2 = dict(n_groups=1, conv_kernel=4, chunk_size=256)
    if family == "mamba2":
        config = transformers.Mamba2Config(
            vocab_size=1024, hidden_size=hidden, num_hidden_layers=4, num_heads=8, head_dim=hidden // 4,
            state_size=64, **mamba2,
        )  # fmt: skip
        return transformers.Mamba2ForCausalLM(config)
    if family == "bamba":
        config = transformers.BambaConfig(
            vocab_size=1024, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[2], mamba_n_heads=8,
            mamba_d_head=hidden // 4, mamba_n_groups=1, mamba_d_state=64, mamba_expand=2, mamba_chunk_size=256,
            mamba_d_conv=4, max_position_embeddings=65536,
        )  # fmt: skip
        return transformers.BambaForCausalLM(config)
    config = transformers.Lfm2Config(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["conv", "conv", "full_attention", "conv"],
        conv_L_cache=3,
        max_position_embeddings=65536,
    )
    return transformers.Lfm2ForCausalLM(config)


def measure(rank: int, world_size: int, family: str, seq_len: int, hidden: int, scans: str = "heads") -> dict:
    import ringpass
    from lowering import record_ring_events
    from ringpass.cli.bench.measure import PeakMemory

    torch.set_num_threads(1)
    model = build(family, hidden)
    ids = torch.randint(0, 1024, (1, seq_len), generator=torch.Generator().manual_seed(1))
    kwargs = {"input_ids": ids, "labels": ids, "use_cache": False}
    run = model
    if world_size > 1:
        backend = ringpass.backend(compiler="aot_eager", report="off", scans=scans)
        run = torch.compile(model, backend=backend, fullgraph=True)
    run(**kwargs).loss.backward()  # compiles; the first call's one-time memory is not the step's
    model.zero_grad(set_to_none=False)
    memory = PeakMemory(torch.device("cpu"))
    memory.start()
    start = time.perf_counter()
    with record_ring_events() as events:
        loss = run(**kwargs).loss
        loss.backward()
    seconds = time.perf_counter() - start
    peak = memory.peak()
    mixer = sum(e.fields["bytes"] for e in events if e.kind == "mixer_exchange")
    gathered = sum(e.fields["bytes"] for e in events if e.kind == "all_gather")
    exchanged = sum(e.fields["bytes"] for e in events if e.kind == "heads_exchange")
    kv = sum(e.fields["bytes"] for e in events if e.kind == "exchange")
    return {
        "peak_mib": (peak or 0) / MIB,
        "seconds": seconds,
        "mixer_bytes": mixer,
        "gathered_bytes": gathered,
        "exchanged_bytes": exchanged,
        "kv_bytes": kv,
        "loss": loss.item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", choices=["lfm2", "bamba", "mamba2"], default="lfm2")
    parser.add_argument("--seq-lens", default="8192,32768")
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--scans", default="heads,whole", help="the backend's scans option, one row each")
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # freed tensors leave the resident set (see PeakMemory)
    from ringpass.cli.launch import spawn_ranks

    print(f"{args.family}, hidden {args.hidden}, 4 layers, fp32, batch 1, one training step after a warm-up; the rank")
    print("with the higher peak")
    print(
        "| N | P | scans | peak MiB per rank | vs unsharded | step s | mixers' summaries sent per rank | "
        "scans' all-to-alls sent per rank | scans' all-gathers received per rank | KV sent per rank | loss |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|"
    )
    for seq_len in map(int, args.seq_lens.split(",")):
        whole = spawn_ranks(measure, 1, (args.family, seq_len, args.hidden), timeout=3600)[0]
        print(
            f"| {seq_len} | 1 | | {whole['peak_mib']:.0f} | 1.00 | {whole['seconds']:.2f} | 0 | 0 | 0 | 0 | "
            f"{whole['loss']:.6f} |"
        )
        for world_size in map(int, args.world_sizes.split(",")):
            for scans in args.scans.split(",") if args.family != "lfm2" else ["heads"]:
                rows = spawn_ranks(measure, world_size, (args.family, seq_len, args.hidden, scans), timeout=3600)
                row = max(rows, key=lambda r: r["peak_mib"])
                print(
                    f"| {seq_len} | {world_size} | {scans if args.family != 'lfm2' else ''} | {row['peak_mib']:.0f} | "
                    f"{row['peak_mib'] / whole['peak_mib']:.2f} | {max(r['seconds'] for r in rows):.2f} | "
                    f"{row['mixer_bytes'] / 1024:.0f} KiB | {row['exchanged_bytes'] / MIB:.1f} MiB | "
                    f"{row['gathered_bytes'] / MIB:.1f} MiB | {row['kv_bytes'] / MIB:.1f} MiB | {row['loss']:.6f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
