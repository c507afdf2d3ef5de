"""The whole-model plan's memory against measurement on this machine (docs/performance.md).

    python examples/plan_check.py [--model llama,qwen2,hand] [--seq-len 4096] [--world-sizes 1,2,4]

For each model, ring size P and checkpointing off / on: what one training step (forward + backward, after a
warm-up step) adds to a rank's memory. Predicted: `ringpass.model_plan.measure_step` on fake tensors at the rank's
share of the sequence (activations and temporaries + the gradients live at the step's peak; no optimizer) plus
the ring's buffers, as `ringpass plan` adds them. Measured: `ringpass.bench.measure.PeakMemory` (VmHWM above the
resident set before the step; MALLOC_MMAP_THRESHOLD_ so freed tensors leave it), P gloo ranks of this machine with
the model compiled by the ring backend (``compiler="eager"``: autograd keeps what the model's ops keep, as in the
fake step), the rank with the higher peak. Models: Hugging Face Llama and Qwen2 (hidden 256, 4 layers, 8 query / 2
KV heads, vocabulary 1000, fp32) and the tests' hand-written Llama (no checkpointing method: checkpointing off only).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

MIB = 2**20
ROOT = Path(__file__).resolve().parent.parent


def build(model: str, tokens: int, checkpointing: bool = False):
    """(model, keyword inputs) of ``tokens`` tokens; random weights, on the current device (fake or real)."""
    if model == "hand":
        sys.path.insert(0, str(ROOT / "tests"))
        from models import Llama, WithLoss

        net = WithLoss(Llama(vocab=1000, dim=256, heads=8, kv_heads=2, layers=4))
        ids = torch.zeros(1, tokens, dtype=torch.long)
        return net, (ids, ids)
    import transformers

    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[model]
    config = config_class(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=tokens,
    )
    net = model_class(config)
    if checkpointing:
        net.activation_checkpointing_enable()
    ids = torch.zeros(1, tokens, dtype=torch.long)
    return net, {"input_ids": ids, "labels": ids, "use_cache": False}


def predicted(model: str, seq_len: int, world_size: int, checkpointing: bool) -> int:
    from lowering.costmodel import ring_cost
    from lowering.layout import Layout
    from ringpass.model_plan import PLAN_ATTENTION, hf_plan_attention, measure_step

    layout = Layout("zigzag", world_size, seq_len)

    def fake_build(tokens):
        net, inputs = build(model, tokens)
        if model != "hand":
            net.config._attn_implementation = PLAN_ATTENTION
        return net, inputs

    hf_plan_attention()
    step = measure_step(fake_build, layout.local_len, "none")
    if checkpointing:
        step = {**step, **{k: step[f"{k}_checkpointed"] for k in ("activations", "gradients")}}
    ring = 0
    if world_size > 1:
        from lowering.costmodel import AttentionShape

        shape = AttentionShape(1, 8, 2, 32, 4, True)
        ring = ring_cost(layout, shape).working_memory()["backward"]
    return step["activations"] + step["gradients"] + ring


def measure(rank: int, world_size: int, model: str, seq_len: int, checkpointing: bool) -> float:
    import ringpass
    from ringpass.bench.measure import PeakMemory

    torch.set_num_threads(1)
    torch.manual_seed(0)
    net, inputs = build(model, seq_len, checkpointing)
    net.train()
    backend = ringpass.backend(compiler="aot_eager", report="off")
    run = net if world_size == 1 else torch.compile(net, backend=backend)

    def step():
        out = run(**inputs) if isinstance(inputs, dict) else run(*inputs)
        loss = out.loss if hasattr(out, "loss") else out[0]
        loss.backward()

    step()  # compiles; the first call's one-time memory is not the step's
    net.zero_grad(set_to_none=True)
    memory = PeakMemory(torch.device("cpu"))
    memory.start()
    step()
    return memory.peak() / MIB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama,qwen2,hand")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--world-sizes", default="1,2,4")
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # freed tensors leave the resident set (see PeakMemory)
    from ringpass.launch import spawn_ranks

    print(f"N={args.seq_len}, one training step (forward + backward) after a warm-up; MiB per rank")
    print("| model | P | checkpointing | predicted | measured | predicted / measured |\n|---|---|---|---|---|---|")
    for model in args.model.split(","):
        for world_size in map(int, args.world_sizes.split(",")):
            for checkpointing in (False, True) if model != "hand" else (False,):
                guess = predicted(model, args.seq_len, world_size, checkpointing) / MIB
                peaks = spawn_ranks(measure, world_size, (model, args.seq_len, checkpointing), timeout=1800)
                real = max(peaks)
                print(
                    f"| {model} | {world_size} | {'on' if checkpointing else 'off'} | {guess:.0f} | {real:.0f} | "
                    f"{guess / real:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
